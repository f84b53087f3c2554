"""tools/plot_metrics.py and tools/loss_compare.py on metrics files shaped like a run's."""

import json
import math
import struct

import pytest

from megalite.errors import UserError
from tools import loss_compare, plot_metrics

matplotlib_image = pytest.importorskip("matplotlib.image")  # reads the written PNG back


def write_metrics(path, lr: float, iterations: int = 40, log_interval: int = 5, eval_interval: int = 20,
                  scale: float = 1.0) -> None:
    """A metrics file like a run's: training lines every log_interval, validation every eval_interval,
    a test line at the end; the loss decays faster with a larger lr."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for iteration in range(log_interval, iterations + 1, log_interval):
        loss = scale * (4 + 5 * math.exp(-lr * 1000 * iteration / iterations))
        lines.append({"iteration": iteration, "consumed_samples": 8 * iteration, "lm_loss": loss,
                      "lr": lr * (1 - iteration / (2 * iterations)), "grad_norm": 1 + 1 / iteration,
                      "loss_scale": 1.0, "tokens_per_sec": 3000 + 10 * iteration, "tflops_per_device": 0.1,
                      "mfu": None, "iteration_time_ms": 300.0, "mem_peak_bytes": 10 ** 8})
        if iteration % eval_interval == 0:
            lines.append({"iteration": iteration, "split": "valid", "lm_loss": loss + 0.2})
    lines.append({"iteration": iterations, "split": "test", "lm_loss": lines[-1]["lm_loss"] + 0.1})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def png_size(path) -> tuple[int, int]:
    data = open(path, "rb").read(24)
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def has_colour(image, rgb: tuple[int, int, int]) -> bool:
    target = [channel / 255 for channel in rgb]
    return bool((abs(image[:, :, :3] - target).max(axis=2) < 0.02).any())


def test_plot_overlays_two_runs_into_a_png(tmp_path, capsys):
    write_metrics(tmp_path / "lr1e-3" / "metrics.jsonl", 1e-3)
    write_metrics(tmp_path / "other.jsonl", 3e-3)
    out = tmp_path / "plots" / "curves.png"
    plot_metrics.main([str(tmp_path / "lr1e-3"), str(tmp_path / "other.jsonl"), "--out", str(out),
                       "--title", "two runs"])
    assert capsys.readouterr().out.strip() == f"wrote {out}: 2 run(s), 16 training points"
    assert png_size(out) == (1200, 750) and out.stat().st_size > 20_000
    image = matplotlib_image.imread(str(out))
    assert has_colour(image, (0x1F, 0x77, 0xB4)) and has_colour(image, (0xFF, 0x7F, 0x0E))  # C0 and C1: both runs


def test_plot_labels_and_records():
    assert plot_metrics.run_labels(["a", "b"], ["x", "y"]) == ["x", "y"]
    with pytest.raises(UserError, match="--labels gives 1 names for 2 runs"):
        plot_metrics.run_labels(["a", "b"], ["x"])


def test_plot_refuses_what_is_not_a_run(tmp_path):
    with pytest.raises(UserError) as error:
        plot_metrics.main([str(tmp_path), "--out", str(tmp_path / "x.png")])
    assert str(error.value) == (f"{tmp_path} is neither a metrics file nor a run folder holding metrics.jsonl; "
                                f"pass a run's --save folder or its --metrics-file")
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 5, "split": "valid", "lm_loss": 1.0}\n{"oops"\n')
    with pytest.raises(UserError, match="metrics.jsonl line 2 is not a metrics record"):
        plot_metrics.main([str(tmp_path), "--out", str(tmp_path / "x.png")])
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 5, "split": "valid", "lm_loss": 1.0}\n')
    with pytest.raises(UserError, match="holds no training records"):
        plot_metrics.main([str(tmp_path), "--out", str(tmp_path / "x.png")])


def test_loss_compare_exits_non_zero_beyond_the_tolerance(tmp_path, capsys):
    write_metrics(tmp_path / "a.jsonl", 1e-3)
    write_metrics(tmp_path / "b.jsonl", 1e-3, scale=1 + 3e-6)  # every loss 3e-6 higher
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    assert loss_compare.main([a, b, "--rtol", "1e-5", "--quiet"]) == 0
    assert capsys.readouterr().out.startswith("largest relative difference 3.000e-06 over 11 records: within")
    assert loss_compare.main([a, b, "--rtol", "1e-6", "--quiet"]) == 1
    assert "ABOVE --rtol 1e-06" in capsys.readouterr().out
    write_metrics(tmp_path / "short.jsonl", 1e-3, iterations=30)
    with pytest.raises(UserError, match="the two files log different iterations"):
        loss_compare.main([a, str(tmp_path / "short.jsonl")])
