"""Fixtures and hooks shared by every test folder.

The suite passes on a machine without a GPU and on one with a CUDA GPU:
- Triton kernels run in Triton's CPU interpreter where there is no GPU (set below), and
  compiled on CUDA tensors where there is one (tests/kernels/conftest.py picks the device);
- CPU worlds (tests/helpers/distributed.py, tools/fork_ranks.py, tools/check_layouts.py) hide the
  GPU from their ranks, so they are CPU worlds on any machine;
- every other test that is not marked `gpu` and not a kernel test sees no GPU either (the
  `cpu_unless_marked_gpu` fixture): an in-process world of one is a CPU world too, so its
  numbers match the CPU references on any machine; what only a GPU shows is in `gpu` tests;
- tests marked `gpu` need CUDA: they are skipped without it ("needs a CUDA GPU"), and the
  summary ends with one line counting how many ran, passed and were skipped.

Tests also start `python tools/x.py` processes, which import megalite and tools as installed
packages: the suite stops at once unless they are installed from this checkout.
"""

import os
import subprocess
import sys

import pytest
import torch

# Triton kernels run in Triton's CPU interpreter on a machine without a GPU. The variable
# is read when a kernel is defined, so it is set here, before any test imports megalite.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The suite runs on two workers (pytest.ini), one per core of a 2-core machine: each keeps to one torch thread,
# as the ranks of its CPU worlds do, instead of both oversubscribing the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
# cuBLAS reads this when its first handle is made; deterministic GEMMs need it (the `deterministic`
# fixture). It changes nothing until torch.use_deterministic_algorithms is on.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_SKIP_REASON = "needs a CUDA GPU"
_gpu_outcomes: dict[str, str] = {}  # node id of a test marked gpu -> passed, failed or skipped


@pytest.fixture
def one_thread():
    """Run the test with one torch thread (fast and deterministic on a shared 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def cpu_unless_marked_gpu(request, monkeypatch):
    """On a GPU machine, hide the GPU from a test not marked `gpu`: megalite (torch.cuda.is_available)
    and any process it starts (CUDA_VISIBLE_DEVICES) then train on the CPU with gloo and fp32, as on a
    CPU-only machine. tests/kernels overrides this: kernel tests run on the GPU where there is one."""
    if torch.cuda.is_available() and request.node.get_closest_marker("gpu") is None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    yield


@pytest.fixture
def deterministic():
    """Deterministic kernels for the test (on a GPU: no atomics in attention or embedding grads), so
    two runs of the same steps are bitwise equal; a warning where an op has no such kernel."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])



@pytest.fixture
def llama_config():
    """llama_config(**overrides) -> a small validated LLaMA-style ModelConfig (tests/helpers/configs.py)."""
    from tests.helpers import configs  # here: megalite is imported after TRITON_INTERPRET is set above
    return configs.llama_config


@pytest.fixture
def gpt2_config():
    """gpt2_config(**overrides) -> a small validated GPT-2-style ModelConfig (tests/helpers/configs.py)."""
    from tests.helpers import configs
    return configs.gpt2_config

# The longest test files, longest first. The suite's two workers each take whole files (pytest.ini's --dist
# loadfile), so these start first: otherwise one of them, started last, runs on alone while the other idles.
LONGEST_FILES = ("tests/test_compositions.py", "tests/test_readme_commands.py", "tests/run/test_resilience.py",
                 "tests/test_parallel_training.py", "tests/data_parallel/test_sharding.py",
                 "tests/test_sharded_training.py", "tests/run/test_exit_signals.py",
                 "tests/data_parallel/test_memory_bench.py", "tests/test_scripts.py")


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu are skipped where CUDA is not available, and tests marked interpreter where
    Triton's CPU interpreter cannot run the kernels (tests/helpers/triton_interpreter.py); the longest files
    go first."""
    rank = {name: index for index, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONGEST_FILES)))
    from tests.helpers import triton_interpreter  # here: it defines a kernel, after TRITON_INTERPRET is set above
    for marker, reason in (("gpu", lambda: None if torch.cuda.is_available() else GPU_SKIP_REASON),
                           ("interpreter", triton_interpreter.problem)):
        marked = [item for item in items if item.get_closest_marker(marker) is not None]
        why = reason() if marked else None
        for item in marked if why else ():
            item.add_marker(pytest.mark.skip(reason=why))


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


def pytest_configure(config):
    """Stop, with the fix, where a process started outside the repository would not import megalite and
    tools from this checkout: not installed (a ModuleNotFoundError in every script test), or installed
    from another checkout (script tests would silently run that one's code)."""
    probe = subprocess.run([sys.executable, "-c", "import megalite, tools; print(megalite.__file__, tools.__file__)"],
                           capture_output=True, text=True, cwd=os.path.dirname(REPO_ROOT))
    found = probe.stdout.split() if probe.returncode == 0 else []
    checkout = os.path.join(os.path.realpath(REPO_ROOT), "")
    if not found or not all(os.path.realpath(path).startswith(checkout) for path in found):
        raise pytest.UsageError(
            f"megalite and tools must be installed from {REPO_ROOT} (found: {' and '.join(found) or 'none'}); "
            "run `pip install -r requirements.txt` there (it installs this checkout with `-e .`)")
