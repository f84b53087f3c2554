"""Fixtures and hooks shared by every test folder.

The suite passes on a machine without a GPU and on one with a CUDA GPU:
- Triton kernels run in Triton's CPU interpreter where there is no GPU (set below), and
  compiled on CUDA tensors where there is one (tests/kernels/conftest.py picks the device);
- CPU worlds (tests/distributed.py, tools/fork_ranks.py, tools/check_layouts.py) hide the
  GPU from their ranks, so they are CPU worlds on any machine;
- tests marked `gpu` need CUDA: they are skipped without it ("needs a CUDA GPU"), and the
  summary ends with one line counting how many ran, passed and were skipped.
"""

import os

import pytest
import torch

# Triton kernels run in Triton's CPU interpreter on a machine without a GPU. The variable
# is read when a kernel is defined, so it is set here, before any test imports megalite.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# cuBLAS reads this when its first handle is made; deterministic GEMMs need it (the `deterministic`
# fixture). It changes nothing until torch.use_deterministic_algorithms is on.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

GPU_SKIP_REASON = "needs a CUDA GPU"
_gpu_outcomes: dict[str, str] = {}  # node id of a test marked gpu -> passed, failed or skipped


@pytest.fixture
def one_thread():
    """Run the test with one torch thread (fast and deterministic on a shared 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def deterministic():
    """Deterministic kernels for the test (on a GPU: no atomics in attention or embedding grads), so
    two runs of the same steps are bitwise equal; a warning where an op has no such kernel."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu are skipped where CUDA is not available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """Record the outcome of each gpu-marked test (the report's keywords hold its markers' names)."""
    if "gpu" not in report.keywords:
        return
    if report.failed:  # in any phase; a teardown error after a pass is a failure too
        _gpu_outcomes[report.nodeid] = "failed"
    elif report.skipped:
        _gpu_outcomes.setdefault(report.nodeid, "skipped")
    elif report.when == "call":
        _gpu_outcomes.setdefault(report.nodeid, "passed")


def pytest_terminal_summary(terminalreporter):
    """One line: how many gpu-marked tests ran, passed, failed and were skipped, and on what."""
    if not _gpu_outcomes:
        return
    counts = {outcome: sum(1 for value in _gpu_outcomes.values() if value == outcome)
              for outcome in ("passed", "failed", "skipped")}
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA GPU here"
    terminalreporter.write_line(
        f"gpu-marked tests: {counts['passed'] + counts['failed']} ran, {counts['passed']} passed, "
        f"{counts['failed']} failed, {counts['skipped']} skipped ({where})")
