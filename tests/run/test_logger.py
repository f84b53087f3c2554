"""megalite/run/logger.py and metrics.py: the logger's lines and its metrics file."""

import json

import pytest
import torch

from megalite.run.flops import flops_per_iteration, gpu_peak_flops
from megalite.run.logger import TrainingLogger
from tests.helpers.configs import llama_config

# ARCHITECTURE.md, "Metrics file": written out here rather than imported, so that the
# test fails if the module's list drifts from the documented one.
TRAINING_KEYS = {"iteration", "consumed_samples", "lm_loss", "lr", "grad_norm", "loss_scale",
                 "tokens_per_sec", "tflops_per_device", "mfu", "iteration_time_ms", "mem_peak_bytes"}
EVALUATION_KEYS = {"iteration", "split", "lm_loss"}
KNOWN_PEAK = (100e12, "test peak")
CONFIG = llama_config(num_layers=2)


def make_logger(tmp_path=None, lines=None, **overrides) -> TrainingLogger:
    """A logger of a 10-iteration run (batch 4 x 16 tokens) printing into `lines`."""
    values = dict(config=CONFIG, global_batch_size=4, seq_length=16, train_iters=10,
                  log_interval=2, peak=KNOWN_PEAK, progress_bar=False,
                  print_fn=(lines if lines is not None else []).append)
    if tmp_path is not None:
        values["metrics_file"] = tmp_path / "run" / "metrics.jsonl"
    start_iteration = overrides.pop("start_iteration", 0)
    values.update(overrides)
    return TrainingLogger(**values).start(start_iteration)


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


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
    flops = flops_per_iteration(CONFIG, 4, 16)
    for part in ("cpu (", "dtype fp32", "test peak", f"{flops:.4E}", "3 x forward"):
        assert part in first, part


def test_metrics_lines_have_exactly_the_documented_keys(tmp_path):
    logger = make_logger(tmp_path)
    for iteration in range(1, 5):
        logger.log_iteration(iteration, iteration * 4, 0.25, 1e-3, 3.0, 1.0, 0.5)
    logger.log_evaluation(4, "valid", 2.5)
    logger.log_evaluation(4, "test", 2.75)
    logger.close()
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
    config = CONFIG
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
    logger = make_logger(tmp_path, lines=lines, peak=peak)
    record = logger.log_iteration(2, 8, 0.5, 1e-3, 3.0, 1.0, 0.5)
    logger.close()
    assert record["mfu"] is None
    assert "MFU: unknown |" in "\n".join(lines)
    assert "peak per device: unknown" in "\n".join(lines)
    assert read_lines(tmp_path / "run" / "metrics.jsonl")[0]["mfu"] is None


def test_a_cpu_peak_is_measured_again_at_the_first_log_lines_and_the_best_kept(monkeypatch):
    import megalite.run.logger as logger_module

    flops = flops_per_iteration(CONFIG, 4, 16)  # one iteration's, at 1 s an iteration: the FLOP/s
    measured = iter([flops / 2, flops * 4, flops * 3])  # start-up (cores busy), then the two log lines
    calls = []
    monkeypatch.setattr(logger_module, "peak_flops",
                        lambda device, dtype: calls.append(dtype) or (next(measured), "measured in the test"))
    lines = []
    logger = make_logger(lines=lines, peak=None, log_interval=1)
    mfus = [logger.log_iteration(i, 4 * i, 1.0, 1e-3, 3.0)["mfu"] for i in range(1, 5)]
    assert len(calls) == 3  # start-up and the first 2 log lines (PEAK_REMEASURES), then no more
    assert mfus == [pytest.approx(0.25)] * 4  # the best of the three: 4x the achieved rate
    assert sum("CPU peak re-measured" in line for line in lines) == 1
    assert "MFU: 25.0%" in lines[-1]


def test_mfu_never_reads_above_100_percent():
    flops = flops_per_iteration(CONFIG, 4, 16)
    lines = []
    logger = make_logger(lines=lines, peak=(flops / 2, "a peak too low"), log_interval=1)
    records = [logger.log_iteration(i, 4 * i, seconds, 1e-3, 3.0) for i, seconds in ((1, 1.0), (2, 4.0))]
    assert [r["mfu"] for r in records] == [pytest.approx(1.0), pytest.approx(0.25)]
    assert "MFU: 100.0%" in lines[2] and "peak raised to this interval's" in lines[1]
    assert logger.peak == pytest.approx(flops)


def test_skipped_and_nan_iterations(tmp_path):
    lines = []
    logger = make_logger(tmp_path, lines=lines, log_interval=3)
    logger.log_iteration(1, 4, 0.1, 1e-3, 2.0, 65536.0, 0.5)
    logger.log_iteration(2, 8, 0.1, 1e-3, 100.0, 32768.0, None, skipped=True)
    record = logger.log_iteration(3, 12, 0.1, 1e-3, 4.0, 32768.0, 0.5)
    assert record["lm_loss"] == pytest.approx(3.0)  # the skipped iteration's loss stays out
    logger.log_iteration(6, 24, 0.1, 1e-3, float("nan"), 1.0, float("inf"))
    logger.close()
    lines = "\n".join(lines).splitlines()
    assert "number of skipped iterations:   1 |" in lines[1]
    assert "lm loss: NAN |" in lines[2] and "number of nan iterations:   1 |" in lines[2]
    last = read_lines(tmp_path / "run" / "metrics.jsonl")[-1]  # strict JSON: NaN and inf -> null
    assert last["lm_loss"] is None and last["grad_norm"] is None


def test_evaluation_line_is_megatrons():
    lines = []
    logger = make_logger(lines=lines)
    logger.log_evaluation(100, "valid", 4.1)
    rule, line, rule_after = "\n".join(lines).splitlines()[1:4]
    assert line == " validation loss at iteration 100 | lm loss value: 4.100000E+00 | lm loss PPL: 6.034029E+01 |"
    assert rule == rule_after == "-" * len(line)
    assert logger.log_evaluation(100, "test", 1000.0)["lm_loss"] == 1000.0  # PPL overflows to inf
    assert " test loss at iteration 100 | lm loss value: 1.000000E+03 | lm loss PPL: INF |" in "\n".join(lines)
    with pytest.raises(ValueError, match="split"):
        logger.log_evaluation(100, "train", 1.0)


def test_non_logging_rank_writes_nothing(tmp_path, capsys):
    logger = make_logger(tmp_path, is_logging_rank=False, peak=None, print_fn=None)
    assert logger.log_iteration(2, 8, 0.5, 1e-3, 3.0, 1.0, 0.5) is None
    assert logger.log_evaluation(2, "valid", 3.0) is None
    logger.close()
    assert not (tmp_path / "run").exists()
    assert capsys.readouterr() == ("", "")


def test_resumed_run_drops_lines_past_its_start(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    logger = make_logger(tmp_path)
    for iteration in range(1, 7):
        logger.log_iteration(iteration, iteration * 4, 0.1, 1e-3, 3.0)
    logger.log_evaluation(4, "valid", 2.0)
    logger.close()
    with open(path, "a") as f:
        f.write('{"iteration": 8, "consum')  # a crash in the middle of a line
    lines = []
    logger = make_logger(tmp_path, lines=lines, start_iteration=4)
    logger.log_iteration(6, 24, 0.1, 1e-3, 3.0)
    logger.close()
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
    logger = make_logger()
    assert logger.is_logging_rank and logger.num_devices == 1
    record = logger.log_iteration(2, 8, 0.5, 1e-3, 3.0, global_batch_size=2)
    assert record["tokens_per_sec"] == pytest.approx(2 * 16 / 0.5)
