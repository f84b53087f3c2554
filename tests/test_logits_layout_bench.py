"""tools/bench/logits_layout.py: both layouts timed, and the padded one is what megalite writes."""

import torch

from megalite.config import ModelConfig
from megalite.cpu_allocator import set_row_padding
from megalite.model.gpt import GPTModel
from tools.bench.logits_layout import main as bench_main, time_gemms


def test_both_layouts_are_timed_for_every_gemm():
    times = time_gemms(tokens=8, hidden=4, vocab=1024, rounds=3)  # 4 KiB rows: padded
    assert {layout for _, layout in times} == {"contiguous", "padded"}
    assert len(times) == 6 and all(len(seconds) == 3 and min(seconds) > 0 for seconds in times.values())


def test_config_a_prints_the_ratios(capsys):
    summary = bench_main(["--config", "A", "--rounds", "1", "--threads", "1"])
    out = capsys.readouterr().out
    assert "rows 32768 bytes apart, padded to 32832" in out
    assert set(summary) == {"forward x W^T", "input grad G W", "weight grad G^T x", "all three", "fused"}
    assert all(ratio > 0 for ratio in summary.values())


def test_the_switch_the_bench_turns_changes_the_models_logits_layout():
    config = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, seq_length=16,
                         vocab_size=1024, untie_embeddings_and_output_weights=True).validate()
    model = GPTModel(config, seed=0)
    hidden = torch.randn(16, 2, 64)
    assert model.output_layer(hidden).stride() == (2 * 1040, 1040, 1)
    set_row_padding(False)
    try:
        assert model.output_layer(hidden).is_contiguous()
    finally:
        set_row_padding(True)
