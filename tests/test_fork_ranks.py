"""tools/fork_ranks.py: a failed rank stops the others and its exit code is the launcher's.

The happy path (every rank trains and matches one process) is tests/test_parallel_training.py."""

import multiprocessing
import os
import signal
import subprocess
import sys
import time

from tools.check_layouts import COMMON
from tools.fork_ranks import REPO_ROOT, _wait, rank_environment


def _exit_with(code: int) -> None:
    sys.exit(code)


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _sleep() -> None:
    time.sleep(120)


def _start(*targets) -> list:
    processes = [multiprocessing.get_context("fork").Process(target=target) for target in targets]
    for process in processes:
        process.start()
    return processes


def test_the_first_failed_rank_stops_the_others_and_gives_its_exit_code():
    sleeper, failed = _start(_sleep, lambda: _exit_with(3))
    start = time.monotonic()
    assert _wait([sleeper, failed]) == 3
    assert time.monotonic() - start < 30 and not sleeper.is_alive()  # stopped, not waited for


def test_a_rank_killed_by_a_signal_reads_as_a_shell_would():
    assert _wait(_start(_sleep, _kill_self)) == 128 + signal.SIGKILL
    assert _wait(_start(lambda: _exit_with(0), lambda: _exit_with(0))) == 0


def test_ranks_get_torchruns_variables_and_bad_flags_stop_the_launcher_with_one_sentence():
    assert rank_environment(1, 4, 29501) == {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
                                             "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0",
                                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29501"}
    result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "fork_ranks.py"),
                             "--nproc-per-node", "2", "--", *COMMON, "--tensor-model-parallel-size", "3"],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 1
    assert "error:" in result.stderr and "Traceback" not in result.stderr
