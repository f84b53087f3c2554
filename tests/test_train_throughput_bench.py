"""tools/bench/train_throughput.py: the issue's configs, and one tiny eager run of both sides."""

import pytest

from megalite.errors import UserError
from tools.bench.train_throughput import build_config, get_args, main as bench_main, median_interval

TINY = ["--config", "preset", "--num-layers", "1", "--hidden-size", "64", "--ffn-hidden-size", "96",
        "--num-attention-heads", "2", "--num-query-groups", "2", "--vocab-size", "128", "--seq-length", "16",
        "--micro-batch-size", "2", "--iters", "2", "--rounds", "2", "--warmup-iters", "1"]


def test_configs_a_and_b_have_the_issue_dimensions():
    a = get_args(["--config", "A"])
    config = build_config(a)
    assert (config.hidden_size, config.num_layers, config.num_attention_heads, config.ffn_hidden_size,
            config.real_vocab_size, config.seq_length, a.micro_batch_size) == (256, 4, 4, 688, 8192, 256, 8)
    b = get_args(["--config", "B"])
    config = build_config(b)
    assert (config.hidden_size, config.num_layers, config.num_attention_heads, config.ffn_hidden_size,
            config.real_vocab_size, config.seq_length, b.micro_batch_size) == (512, 8, 8, 1376, 32000, 512, 4)
    assert config.vocab_size == 32000  # no padding: both sides compute the same logits


def test_eager_run_reports_both_sides_and_a_ratio(capsys):
    summary = bench_main(TINY + ["--modes", "eager", "--profile", "3"])
    out = capsys.readouterr().out
    assert "profile of one iteration of megalite eager" in out and "profile of one iteration of HF eager" in out
    assert summary["best"] == {"megalite": "megalite eager", "HF": "HF eager"}
    assert summary["ratio"] > 0 and summary["fastest_ratio"] > 0 and summary["mfu"] > 0
    for line in ("megalite eager", "HF eager", "ratio megalite / HF tokens/s"):
        assert line in out


def test_fewer_hf_iterations_fill_the_first_rounds_and_pair_by_round(capsys):
    """--hf-iters 1 over 2 rounds: HF has one block, in round 0, so one same-round pair."""
    summary = bench_main(TINY + ["--modes", "eager", "--hf-iters", "1", "--hf-warmup-iters", "1"])
    out = capsys.readouterr().out
    assert "as the median of 1 same-round pairs" in out
    assert summary["paired_ratio"] > 0


def test_the_gpu_config_is_the_1b_preset_at_seq_2048():
    args = get_args(["--config", "1B"])
    config = build_config(args)
    assert (config.num_layers, config.hidden_size, config.seq_length, args.micro_batch_size) == (22, 2048, 2048, 4)


def test_hf_eager_only_without_warm_up(capsys):
    summary = bench_main(TINY + ["--modes", "best", "--hf-modes", "eager", "--hf-warmup-iters", "0"])
    assert set(summary["medians"]) == {"megalite eager", "megalite compile", "HF eager"}
    assert summary["best"]["HF"] == "HF eager"


def test_a_compiled_hf_needs_a_warm_up_iteration():
    with pytest.raises(UserError, match="--hf-warmup-iters 0 would time HF's compilation"):
        bench_main(TINY + ["--hf-warmup-iters", "0"])


def test_the_paired_median_gets_a_bootstrap_interval_from_four_pairs(capsys):
    assert median_interval([1.0, 1.1, 0.9]) is None
    steady = median_interval([1.05] * 8)
    assert steady == (1.05, 1.05)
    low, high = median_interval([0.8, 0.9, 1.0, 1.05, 1.1, 1.2, 1.3, 1.4])
    assert 0.8 <= low < 1.075 < high <= 1.4  # around the sample median, inside the range
    assert median_interval([0.8, 0.9, 1.0, 1.05, 1.1, 1.2, 1.3, 1.4]) == (low, high)  # seeded
    summary = bench_main(TINY + ["--modes", "eager", "--iters", "4", "--rounds", "4"])
    assert "90% bootstrap interval" in capsys.readouterr().out
    assert summary["paired_interval"][0] <= summary["paired_ratio"] <= summary["paired_interval"][1]


def test_sdpa_variants_time_the_same_model_and_never_count_as_its_best(capsys):
    summary = bench_main(TINY + ["--modes", "eager", "--sdpa-variants"])
    out = capsys.readouterr().out
    assert set(summary["medians"]) == {"megalite eager", "megalite-sdpa eager", "HF eager"}
    assert summary["best"]["megalite"] == "megalite eager"
    assert summary["attention"]["eager"] > 0
    assert "megalite eager, blocked attention / SDPA (same model):" in out
    from megalite.kernels.attention import _enabled  # the switch is restored after each SDPA step
    assert _enabled
