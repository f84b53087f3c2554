"""tools/dev/gpu_check.sh, issue 43's prepared GPU call, rehearsed on the CPU: DRY=1 runs every step at toy sizes
and leaves one summary.json with each step's status, seconds and figures; a step past its time is cut, and
recorded as such with no figure it did not print."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.dev.gpu_summary import last_iteration, pytest_counts

REPO_ROOT = Path(__file__).resolve().parents[1]
STEPS = ("gpu_tests", "bench_1b", "pretrain_eager", "pretrain_compile", "kernels", "profile_1b", "moe_loop",
         "moe_grouped", "cp_attention", "pretrain_unfused", "suite")  # in the script's order (its priority)


def gpu_check(out: Path, **env: str) -> subprocess.CompletedProcess:
    """The script with DRY=1 into `out`, the caller's step settings kept out of it."""
    keep = {key: value for key, value in os.environ.items()
            if key not in ("DRY", "OUT", "BUDGET_S", "COMMIT", "WORKERS") and not key.endswith("_S")}
    return subprocess.run(["bash", "tools/dev/gpu_check.sh"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=600, env={**keep, "PYTHON": sys.executable, "DRY": "1", "OUT": str(out), **env})


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    result = gpu_check(out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_a_dry_run_records_the_device_and_every_step_in_order(dry_run):
    _, summary = dry_run
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    if head:
        assert summary["commit"] == head and summary["commit_from"] == "git"
    assert summary["dry"] is True and summary["torch"] and summary["device"].startswith("cpu")
    assert tuple(summary["steps"]) == STEPS
    assert {name: step["status"] for name, step in summary["steps"].items()} == dict.fromkeys(STEPS, "ok")


@pytest.mark.slow
def test_a_dry_run_reads_each_steps_figures_from_its_output(dry_run):
    out, summary = dry_run
    figures = {name: step.get("figures") for name, step in summary["steps"].items()}
    gpu = figures["gpu_tests"]  # no GPU: the gpu-marked tests are collected and skipped
    assert gpu["skipped"] > 0 and gpu["passed"] == gpu["failed"] == gpu["error"] == 0
    assert gpu["gpu_marked"]["ran"] == 0 and gpu["gpu_marked"]["skipped"] == gpu["skipped"]
    assert figures["suite"]["passed"] > 0 and figures["suite"]["failed"] == 0
    bench = figures["bench_1b"]
    assert set(bench["tokens_per_s"]) == {"megalite eager", "HF eager", "minimal eager"}
    assert set(bench["megalite_over"]) == {"HF", "minimal"} and bench["megalite_over"]["HF"]["ratio"] > 0
    for name in ("pretrain_eager", "pretrain_compile", "moe_loop", "moe_grouped", "pretrain_unfused"):
        assert figures[name]["iteration"] == "2/2" and figures[name]["tokens_per_s"] > 0, name
    assert "--compile" in summary["steps"]["pretrain_compile"]["command"]
    assert "--no-gradient-accumulation-fusion" in summary["steps"]["pretrain_unfused"]["command"]
    assert set(summary) >= {"torch", "device", "mixed_gemm", "cp_ring_blocks"}
    assert summary["mixed_gemm"] is None and summary["cp_ring_blocks"] is None  # a CPU has neither
    assert "--moe-grouped-gemm" in summary["steps"]["moe_grouped"]["command"]
    assert {row["kernel"] for row in figures["kernels"]["kernels"]} >= {"rmsnorm", "rotary", "swiglu"}
    assert len(figures["profile_1b"]["megalite_top10"]) == 10
    assert figures["cp_attention"] == {"bytes_equal_closed_form": True}  # no CUDA: its time table says skipped
    assert "profile of" not in (out / "profile_1b.txt").read_text() and "Name" in (out / "profile_1b.txt").read_text()


def test_a_step_past_its_time_is_cut_and_the_rest_skipped_with_the_reason(tmp_path):
    """GPU_TESTS_S=1 cuts the first step; the others, given 0 s, are not started. Nothing is invented: the
    cut step's counts come from what its log printed."""
    zero = {f"{name.upper()}_S": "0" for name in STEPS if name != "gpu_tests"}
    result = gpu_check(tmp_path, GPU_TESTS_S="1", **zero)
    assert result.returncode == 0, result.stdout + result.stderr
    steps = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert steps["gpu_tests"]["status"] == "timed out" and steps["gpu_tests"]["rc"] == 124
    assert steps["gpu_tests"]["figures"]["from"].startswith("the -v log")
    assert steps["gpu_tests"]["figures"]["passed"] == 0
    assert all(steps[name]["status"] == "skipped" and "figures" not in steps[name] for name in STEPS[1:])
    assert "KERNELS_S=0" in steps["kernels"]["note"]


def test_figures_come_only_from_what_the_outputs_printed(tmp_path):
    """A cut-off suite is counted from its -v lines (plain and xdist); an unknown MFU stays absent."""
    (tmp_path / "suite.log").write_text(
        "[gw0] [  1%] PASSED tests/a.py::test_x\n[gw1] [  2%] FAILED tests/a.py::test_y[1-2]\n"
        "tests/c.py::test_w SKIPPED (needs a CUDA GPU)                  [ 10%]\ntests/c.py::test_v ERROR   [ 11%]\n")
    counts = pytest_counts(tmp_path, "suite")
    assert {word: counts[word] for word in ("passed", "failed", "error", "skipped")} == dict.fromkeys(
        ("passed", "failed", "error", "skipped"), 1)
    (tmp_path / "run.log").write_text(
        " iteration        4/       8 | elapsed time per iteration (ms): 9.0 | tokens/s: 7 | MFU: 1.0% |\n"
        " iteration        8/       8 | elapsed time per iteration (ms): 8.5 | tokens/s: 8 | TFLOP/s per device: 0.010"
        " | MFU: unknown | lm loss: 5.5E+00 |\n")
    assert last_iteration(tmp_path, "run") == {"iteration": "8/8", "ms_per_iteration": 8.5, "tokens_per_s": 8.0,
                                               "tflops_per_device": 0.01, "lm_loss": 5.5}
    assert last_iteration(tmp_path, "missing") == {}
