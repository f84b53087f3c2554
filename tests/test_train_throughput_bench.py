"""tools/bench/train_throughput.py: the issue's configs, tiny runs of megalite beside its peers (HF's
LlamaForCausalLM and the minimal PyTorch LLaMA), and the minimal model itself."""

import functools
import math

import pytest
import torch

from megalite.config import num_parameters
from megalite.errors import UserError
from tools.bench.train_throughput import (build_config, get_args, hf_llama, hf_loss, main as bench_main,
                                          median_interval, minimal_llama)

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


def test_eager_run_reports_every_side_and_a_ratio_to_each_peer(capsys):
    summary = bench_main(TINY + ["--modes", "eager", "--profile", "3"])
    out = capsys.readouterr().out
    for side in ("megalite", "HF", "minimal"):
        assert f"profile of one iteration of {side} eager" in out
    assert summary["best"] == {"megalite": "megalite eager", "HF": "HF eager", "minimal": "minimal eager"}
    assert summary["ratio"] > 0 and summary["fastest_ratio"] > 0 and summary["mfu"] > 0
    assert summary["peers"]["HF"]["ratio"] == summary["ratio"] and summary["peers"]["minimal"]["paired_ratio"] > 0
    for line in ("megalite eager", "HF eager", "minimal eager", "ratio megalite / HF tokens/s",
                 "ratio megalite / minimal tokens/s", "same-round ratios: ", "same-round ratios megalite / minimal: ",
                 "parameters: megalite 51,392, HF 51,392, minimal 51,392 (equal)", "loss at init (first iteration): "):
        assert line in out
    for name, loss in summary["init_loss"].items():  # every side starts from a small-logit init
        assert abs(loss - math.log(128)) < 0.1, name


def test_peers_pick_the_sides(capsys):
    summary = bench_main(TINY + ["--modes", "eager", "--peers", "minimal"])
    out = capsys.readouterr().out
    assert set(summary["medians"]) == {"megalite eager", "minimal eager"}
    assert summary["ratio"] is None and set(summary["peers"]) == {"minimal"}
    assert "HF" not in out.split("model FLOPs")[1] and "per minimal variant" in out
    summary = bench_main(TINY + ["--modes", "eager", "--peers", "hf"])
    assert set(summary["medians"]) == {"megalite eager", "HF eager"} and summary["ratio"] > 0
    with pytest.raises(UserError, match="--peers 'hf,bogus': give one or more of hf, minimal"):
        get_args(["--peers", "hf,bogus"])


def test_the_minimal_peer_compiled_whole(monkeypatch):
    """`minimal compile`: the model and its loss in one torch.compile graph; traced by Dynamo and AOTAutograd
    here, without Inductor's code generation (slow on a CPU; the bench itself uses Inductor)."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    summary = bench_main(TINY + ["--modes", "eager", "--peers", "minimal", "--hf-modes", "compile"])
    assert set(summary["medians"]) == {"megalite eager", "minimal compile"}
    assert summary["best"]["minimal"] == "minimal compile"
    assert abs(summary["init_loss"]["minimal compile"] - math.log(128)) < 0.1


SMALL_LLAMA_32_1B = ["--config", "preset", "--model", "llama3.2-1b", "--num-layers", "2", "--hidden-size", "64",
                     "--ffn-hidden-size", "96", "--num-attention-heads", "4", "--num-query-groups", "2",
                     "--vocab-size", "100", "--seq-length", "16"]


@pytest.mark.parametrize("argv", [TINY + ["--num-attention-heads", "4"], SMALL_LLAMA_32_1B], ids=["tiny", "llama3.2"])
def test_the_minimal_model_is_megalites_and_hfs_model(argv, one_thread):
    """Same parameter count as megalite (grouped-query attention 4 / 2; for llama3.2-1b a tied output and
    scaled rotary frequencies), and the same loss as HF's LlamaForCausalLM on HF's weights."""
    args = get_args(argv)
    config = build_config(args)
    assert config.query_groups < config.num_attention_heads
    minimal = minimal_llama(config, "cpu", torch.float32)
    assert sum(p.numel() for p in minimal.parameters()) == num_parameters(config)
    torch.manual_seed(0)
    hf = hf_llama(config).eval()
    names = {"embedding.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    for i in range(config.num_layers):
        hf_layer, mine = f"model.layers.{i}.", f"layers.{i}."
        names.update({mine + "attention_norm.weight": hf_layer + "input_layernorm.weight",
                      mine + "mlp_norm.weight": hf_layer + "post_attention_layernorm.weight"})
        names.update({f"{mine}attention.{p}.weight": f"{hf_layer}self_attn.{p}_proj.weight" for p in "qkvo"})
        names.update({f"{mine}mlp.{p}.weight": f"{hf_layer}mlp.{p}_proj.weight" for p in ("gate", "up", "down")})
    with torch.no_grad():  # weights far from init, so that attention, rotary and norms all move the loss
        for weight in hf.parameters():
            if weight.dim() == 1:  # norms
                weight.uniform_(0.5, 1.5)
            else:
                weight.normal_(0.0, 2.0 / weight.shape[-1] ** 0.5)
    theirs = hf.state_dict()
    assert set(names) == set(minimal.state_dict())  # every weight of the minimal model comes from HF's
    minimal.load_state_dict({name: theirs[hf_name] for name, hf_name in names.items()})
    generator = torch.Generator().manual_seed(1)
    data = torch.randint(0, config.real_vocab_size, (2, config.seq_length + 1), generator=generator)
    tokens, labels = data[:, :-1], data[:, 1:]
    positions = torch.arange(config.seq_length).expand(2, -1)
    with torch.no_grad():
        loss = minimal(tokens, labels, positions)
        torch.testing.assert_close(loss, hf_loss(hf, tokens, labels, positions), rtol=1e-5, atol=1e-5)
        assert abs(loss - minimal(tokens, labels, positions.flip(-1))) > 1e-3  # positions matter at these weights


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
    assert set(summary["medians"]) == {"megalite eager", "megalite compile", "HF eager", "minimal eager"}
    assert summary["best"]["HF"] == "HF eager"
    assert summary["init_loss"]["HF eager"] > 0  # without a warm-up: the first measured iteration's loss


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
