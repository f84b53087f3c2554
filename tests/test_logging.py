"""megalite/logging.py: the FLOPs formula, the peak table, and the logger's lines and metrics file."""

import json

import pytest
import torch

from megalite.config import ModelConfig, model_config_from_preset, num_parameters
from megalite.logging import (TrainingLogger, find_gpu_peak, flops_per_iteration, gpu_peak_flops,
                              peak_flops)

# ARCHITECTURE.md, "Metrics file": written out here rather than imported, so that the
# test fails if the module's list drifts from the documented one.
TRAINING_KEYS = {"iteration", "consumed_samples", "lm_loss", "lr", "grad_norm", "loss_scale",
                 "tokens_per_sec", "tflops_per_device", "mfu", "iteration_time_ms", "mem_peak_bytes"}
EVALUATION_KEYS = {"iteration", "split", "lm_loss"}
KNOWN_PEAK = (100e12, "test peak")


def gpt_config(**overrides) -> ModelConfig:
    """2 layers, h 64, 4 heads of 16, MHA, GELU MLP of 256, vocab 256."""
    values = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                  seq_length=16, vocab_size=256)
    values.update(overrides)
    return ModelConfig(**values).validate()


def llama_config(**overrides) -> ModelConfig:
    """2 layers, h 64, 4 heads of 16 in 2 groups (GQA), SwiGLU MLP of 96, vocab 256."""
    values = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=96, seq_length=16, vocab_size=256, position_embedding_type="rope",
                  normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                  untie_embeddings_and_output_weights=True)
    values.update(overrides)
    return ModelConfig(**values).validate()


def make_logger(tmp_path=None, lines=None, **overrides) -> TrainingLogger:
    """A logger of a 10-iteration run (batch 4 x 16 tokens) printing into `lines`."""
    values = dict(config=llama_config(), global_batch_size=4, seq_length=16, train_iters=10,
                  log_interval=2, peak=KNOWN_PEAK, progress_bar=False,
                  print_fn=(lines if lines is not None else []).append)
    if tmp_path is not None:
        values["metrics_file"] = tmp_path / "run" / "metrics.jsonl"
    values.update(overrides)
    return TrainingLogger(**values)


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ----------------------------------------------------------------------------- FLOPs


def test_flops_by_hand_mha_gelu():
    # Per layer and token, 2 FLOPs per multiply-add, s = 16, d = 16:
    qkv = 2 * 64 * (4 + 2 * 4) * 16       # 24576: q, k, v for 4 heads
    proj = 2 * 64 * 64                    # 8192
    mlp = 2 * 64 * 256 + 2 * 256 * 64     # 65536: fc1 and fc2, no gate
    attention = 2 * 16 * 4 * 16           # 2048: (QK^T + AV) = 4·s·a·d, halved by the causal mask
    logits = 2 * 64 * 256                 # 32768
    forward_per_token = 2 * (qkv + proj + mlp + attention) + logits
    assert forward_per_token == 233472
    assert flops_per_iteration(gpt_config(), global_batch_size=3, seq_length=16) == 3 * 3 * 16 * 233472


def test_flops_by_hand_gqa_swiglu():
    qkv = 2 * 64 * (4 + 2 * 2) * 16       # 16384: 2 key/value groups instead of 4
    proj = 2 * 64 * 64                    # 8192
    mlp = 2 * 64 * 96 * 2 + 2 * 96 * 64   # 36864: gate and up, then down
    attention = 2 * 16 * 4 * 16           # 2048
    logits = 2 * 64 * 256                 # 32768
    forward_per_token = 2 * (qkv + proj + mlp + attention) + logits
    assert forward_per_token == 159744
    assert flops_per_iteration(llama_config(), global_batch_size=2, seq_length=16) == 3 * 2 * 16 * 159744


def test_flops_use_the_given_seq_length_and_padded_vocab():
    config = llama_config(vocab_size=384, tokenizer_vocab_size=300)
    per_token_32 = flops_per_iteration(config, 1, 32) / 32
    per_token_16 = flops_per_iteration(config, 1, 16) / 16
    assert per_token_32 - per_token_16 == 3 * 2 * (2 * 16 * 4 * 16)  # attention grows with s
    assert per_token_16 - flops_per_iteration(llama_config(), 1, 16) / 16 == 3 * 2 * 64 * (384 - 256)


def test_recompute_counts_only_as_hardware_flops():
    full, selective, none = (llama_config(recompute_granularity=g) for g in ("full", "selective", None))
    model = flops_per_iteration(none, 1, 16)
    assert flops_per_iteration(full, 1, 16) == flops_per_iteration(selective, 1, 16) == model
    layers_forward = 16 * 2 * (16384 + 8192 + 36864 + 2048)
    assert flops_per_iteration(full, 1, 16, include_recompute=True) == model + layers_forward
    assert flops_per_iteration(selective, 1, 16, include_recompute=True) == model + 16 * 2 * 2048


def test_big_model_is_six_n_plus_attention():
    config = model_config_from_preset("llama2-7b")
    seq, tokens = 4096, 4096 * 8
    attention = 6 * config.num_layers * seq * config.hidden_size  # 3 x causal 2·s·a·d, a·d = h
    flops = flops_per_iteration(config, 8, seq)
    # The embedding lookup does no matmul: without it, 6N is exact up to the norm weights.
    matmul_params = num_parameters(config) - config.vocab_size * config.hidden_size
    assert flops == pytest.approx(6 * matmul_params * tokens + attention * tokens, rel=1e-4)
    # The rule of thumb with every parameter is within a few percent for a 7B model.
    assert flops == pytest.approx(6 * num_parameters(config) * tokens + attention * tokens, rel=0.03)


# ----------------------------------------------------------------------------- peaks


@pytest.mark.parametrize("name, dtype, tflops", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.5),
    ("NVIDIA H100 PCIe", torch.bfloat16, 756.0),
    ("NVIDIA H100 NVL", torch.float16, 835.5),
    ("NVIDIA H200", torch.bfloat16, 989.5),
    ("NVIDIA H200 NVL", torch.bfloat16, 835.5),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
    ("NVIDIA A100 80GB PCIe", torch.float32, 19.5),
    ("NVIDIA A10G", torch.bfloat16, 70.0),
    ("NVIDIA A10", torch.bfloat16, 125.0),
    ("NVIDIA L4", torch.bfloat16, 121.0),
    ("NVIDIA L40S", torch.bfloat16, 362.05),
    ("NVIDIA GeForce RTX 4090", torch.bfloat16, 165.2),
    ("Tesla V100-SXM2-16GB", torch.float16, 125.0),
    ("Tesla V100-PCIE-32GB", torch.float16, 112.0),
])
def test_peak_table_lookup_by_device_name(name, dtype, tflops):
    value, source = gpu_peak_flops(name, dtype)
    assert value == pytest.approx(tflops * 1e12)
    assert source.startswith(f"{name}: {tflops:g} TFLOP/s dense ")


def test_fp32_uses_the_tf32_peak_only_when_tf32_is_on():
    assert gpu_peak_flops("NVIDIA A100-SXM4-40GB", torch.float32, tf32=True)[0] == pytest.approx(156e12)
    assert gpu_peak_flops("NVIDIA A100-SXM4-40GB", torch.float32, tf32=False)[0] == pytest.approx(19.5e12)
    assert gpu_peak_flops("Tesla V100-SXM2-16GB", torch.float32, tf32=True)[0] == pytest.approx(15.7e12)


@pytest.mark.parametrize("name, dtype", [
    ("NVIDIA B300 Mystery", torch.bfloat16),       # not in the table
    ("NVIDIA GeForce RTX 4090 D", torch.bfloat16),  # a smaller chip under a listed name
    ("NVIDIA H100", torch.bfloat16),                # which H100 is not said
    ("Tesla V100-SXM2-16GB", torch.bfloat16),       # no bf16 units
])
def test_unknown_peaks_are_none_never_guessed(name, dtype):
    value, source = gpu_peak_flops(name, dtype)
    assert value is None and "MFU unknown" in source


def test_family_words_do_not_match_inside_other_names():
    assert find_gpu_peak("NVIDIA A100-SXM4-80GB").words == ("A100",)
    assert find_gpu_peak("NVIDIA L40").words == ("L40",)
    assert find_gpu_peak("NVIDIA L4").words == ("L4",)


def test_cpu_peak_is_measured_and_says_so():
    value, source = peak_flops("cpu", torch.float32, cpu_matmul_size=64, cpu_seconds=0.01)
    assert value > 0
    assert source.startswith("CPU peak measured by a 64^3 fp32 matmul at startup on ")
    assert "GFLOP/s" in source


# ----------------------------------------------------------------------------- the logger


def test_line_has_megatron_fields_and_shape():
    lines = []
    logger = make_logger(lines=lines, train_iters=1000, global_batch_size=16, log_interval=100)
    for iteration in range(1, 101):
        logger.log_iteration(iteration, iteration * 16, 0.8123, 3e-4, 5.123456, 1.0, 0.812)
    line = "\n".join(lines).splitlines()[-1]
    assert line.startswith(" iteration      100/    1000 | consumed samples:         1600 | "
                           "elapsed time per iteration (ms): 812.3 | tokens/s: ")
    for field in ("tokens/s: ", "TFLOP/s per device: ", "MFU: ", "learning rate: 3.000E-04 |",
                  "global batch size:    16 |", "lm loss: 5.123456E+00 |", "loss scale: 1.0 |",
                  "grad norm: 0.812 |", "number of skipped iterations:   0 |",
                  "number of nan iterations:   0 |"):
        assert field in line, field
    assert line.endswith(" |")


def test_startup_line_names_device_dtype_peak_and_flops():
    lines = []
    make_logger(lines=lines)
    first = "\n".join(lines).splitlines()[0]
    flops = flops_per_iteration(llama_config(), 4, 16)
    for part in ("cpu (", "dtype fp32", "test peak", f"{flops:.4E}", "3 x forward"):
        assert part in first, part


def test_metrics_lines_have_exactly_the_documented_keys(tmp_path):
    with make_logger(tmp_path) as logger:
        for iteration in range(1, 5):
            logger.log_iteration(iteration, iteration * 4, 0.25, 1e-3, 3.0, 1.0, 0.5)
        logger.log_evaluation(4, "validation", 2.5)
        logger.log_evaluation(4, "test", 2.75)
    lines = read_lines(tmp_path / "run" / "metrics.jsonl")  # the parent directory was created
    assert [line["iteration"] for line in lines] == [2, 4, 4, 4]
    for line in lines[:2]:
        assert set(line) == TRAINING_KEYS
        assert isinstance(line["mem_peak_bytes"], int) and line["mem_peak_bytes"] > 0
        assert line["mfu"] == pytest.approx(line["tflops_per_device"] * 1e12 / KNOWN_PEAK[0])
    assert lines[2] == {"iteration": 4, "split": "valid", "lm_loss": 2.5}
    assert lines[3] == {"iteration": 4, "split": "test", "lm_loss": 2.75}
    assert all(set(line) == EVALUATION_KEYS for line in lines[2:])


def test_values_are_averages_over_the_interval():
    config = llama_config()
    logger = make_logger(config=config, global_batch_size=4, log_interval=2, num_devices=2)
    assert logger.log_iteration(1, 4, 0.1, 1e-3, 2.0, 1.0, 0.9) is None  # not due yet
    record = logger.log_iteration(2, 8, 0.3, 2e-3, 4.0, 1.0, 0.7)
    assert record["lm_loss"] == pytest.approx(3.0)
    assert record["iteration_time_ms"] == pytest.approx(200.0)
    assert record["tokens_per_sec"] == pytest.approx(2 * 4 * 16 / 0.4)
    flops_per_device = 2 * flops_per_iteration(config, 4, 16) / 0.4 / 2
    assert record["tflops_per_device"] == pytest.approx(flops_per_device / 1e12)
    assert record["mfu"] == pytest.approx(flops_per_device / KNOWN_PEAK[0])
    assert (record["lr"], record["grad_norm"], record["consumed_samples"]) == (2e-3, 0.7, 8)
    # The next interval starts afresh, and the last iteration always logs.
    assert logger.log_iteration(9, 36, 0.5, 1e-3, 1.0) is None
    last = logger.log_iteration(10, 40, 0.7, 1e-3, 5.0)
    assert (last["lm_loss"], last["iteration_time_ms"]) == (pytest.approx(3.0), pytest.approx(600.0))


def test_mfu_unknown_for_an_unknown_device(tmp_path):
    lines = []
    peak = gpu_peak_flops("Mystery Accelerator 9000", torch.bfloat16)
    with make_logger(tmp_path, lines=lines, peak=peak) as logger:
        record = logger.log_iteration(2, 8, 0.5, 1e-3, 3.0, 1.0, 0.5, force=True)
    assert record["mfu"] is None
    assert "MFU: unknown |" in "\n".join(lines)
    assert "peak per device: unknown" in "\n".join(lines)
    assert read_lines(tmp_path / "run" / "metrics.jsonl")[0]["mfu"] is None


def test_skipped_and_nan_iterations(tmp_path):
    lines = []
    with make_logger(tmp_path, lines=lines, log_interval=3) as logger:
        logger.log_iteration(1, 4, 0.1, 1e-3, 2.0, 65536.0, 0.5)
        logger.log_iteration(2, 8, 0.1, 1e-3, 100.0, 32768.0, None, skipped=True)
        record = logger.log_iteration(3, 12, 0.1, 1e-3, 4.0, 32768.0, 0.5)
        assert record["lm_loss"] == pytest.approx(3.0)  # the skipped iteration's loss stays out
        logger.log_iteration(6, 24, 0.1, 1e-3, float("nan"), 1.0, float("inf"), force=True)
    lines = "\n".join(lines).splitlines()
    assert "number of skipped iterations:   1 |" in lines[1]
    assert "lm loss: NAN |" in lines[2] and "number of nan iterations:   1 |" in lines[2]
    last = read_lines(tmp_path / "run" / "metrics.jsonl")[-1]  # strict JSON: NaN and inf -> null
    assert last["lm_loss"] is None and last["grad_norm"] is None


def test_evaluation_line_is_megatrons():
    lines = []
    logger = make_logger(lines=lines)
    logger.log_evaluation(100, "validation", 4.1)
    rule, line, rule_after = "\n".join(lines).splitlines()[1:4]
    assert line == " validation loss at iteration 100 | lm loss value: 4.100000E+00 | lm loss PPL: 6.034029E+01 |"
    assert rule == rule_after == "-" * len(line)
    assert logger.log_evaluation(100, "test", 1000.0)["lm_loss"] == 1000.0  # PPL overflows to inf
    assert " test loss at iteration 100 | lm loss value: 1.000000E+03 | lm loss PPL: INF |" in "\n".join(lines)
    with pytest.raises(ValueError, match="split"):
        logger.log_evaluation(100, "train", 1.0)


def test_non_logging_rank_writes_nothing(tmp_path, capsys):
    logger = make_logger(tmp_path, is_logging_rank=False, peak=None, print_fn=None)
    assert logger.log_iteration(2, 8, 0.5, 1e-3, 3.0, 1.0, 0.5, force=True) is None
    assert logger.log_evaluation(2, "validation", 3.0) is None
    logger.close()
    assert not (tmp_path / "run").exists()
    assert capsys.readouterr() == ("", "")


def test_resumed_run_drops_lines_past_its_start(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    with make_logger(tmp_path) as logger:
        for iteration in range(1, 7):
            logger.log_iteration(iteration, iteration * 4, 0.1, 1e-3, 3.0)
        logger.log_evaluation(4, "validation", 2.0)
    with open(path, "a") as f:
        f.write('{"iteration": 8, "consum')  # a crash in the middle of a line
    lines = []
    with make_logger(tmp_path, lines=lines, start_iteration=4) as logger:
        logger.log_iteration(6, 24, 0.1, 1e-3, 3.0)
    assert [line["iteration"] for line in read_lines(path)] == [2, 4, 4, 6]
    assert "dropped 2 line(s) after iteration 4" in "\n".join(lines)


def test_sinks_get_every_record():
    records = []
    logger = make_logger()
    logger.add_sink(records.append)
    logger.log_iteration(2, 8, 0.5, 1e-3, 3.0)
    logger.log_evaluation(2, "valid", 2.0)
    assert set(records[0]) == TRAINING_KEYS and set(records[1]) == EVALUATION_KEYS


def test_progress_bar_only_on_request_or_terminal(capsys):
    assert make_logger(progress_bar=None, print_fn=None)._bar is None  # captured stdout is no terminal
    logger = make_logger(progress_bar=True, print_fn=None)
    logger.log_iteration(2, 8, 0.5, 1e-3, 3.0)
    logger.close()
    logger.close()
    out = capsys.readouterr().out
    assert " iteration        2/      10 |" in out
    assert "training" in out  # the bar's description


def test_defaults_without_torch_distributed_and_batch_ramp_up():
    logger = make_logger(is_logging_rank=None, num_devices=None)
    assert logger.is_logging_rank and logger.num_devices == 1
    record = logger.log_iteration(2, 8, 0.5, 1e-3, 3.0, global_batch_size=2)
    assert record["tokens_per_sec"] == pytest.approx(2 * 16 / 0.5)
