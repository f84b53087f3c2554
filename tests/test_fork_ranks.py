"""tools/fork_ranks.py: a failed rank stops the others and its exit code is the launcher's.

The happy path (every rank trains and matches one process) is tests/test_parallel_training.py."""

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time

from tools.check_layouts import COMMON
from tools.fault_campaign import child_pids, wait_for
from tools.fork_ranks import REPO_ROOT, _ephemeral_low, _wait, free_port, rank_environment

ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def _fork_ranks(*flags: str) -> list[str]:
    """The command that forks 2 ranks of pretrain_gpt.py with the tiny model's flags and `flags`."""
    return [sys.executable, os.path.join(REPO_ROOT, "tools", "fork_ranks.py"), "--nproc-per-node", "2", "--",
            *COMMON, *flags]


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
    result = subprocess.run(_fork_ranks("--tensor-model-parallel-size", "3"), capture_output=True, text=True,
                            timeout=120, env=ONE_THREAD)
    assert result.returncode == 1
    assert "error:" in result.stderr and "Traceback" not in result.stderr


def _gone(pid: int) -> bool:
    """No such process, or a zombie: it has exited."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_signal_to_the_launcher_reaches_every_rank_and_no_rank_outlives_it(tmp_path):
    for signum in (signal.SIGTERM, signal.SIGKILL):  # forwarded; the kernel's parent-death signal
        metrics = tmp_path / f"{signum}.jsonl"
        launcher = subprocess.Popen(_fork_ranks("--train-iters", "100000", "--metrics-file", str(metrics)),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ONE_THREAD)
        try:
            assert wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, [launcher],
                            timeout=60, poll=0.1)  # training
            ranks = child_pids(launcher.pid)
            assert len(ranks) == 2
            os.kill(launcher.pid, signum)
            assert launcher.wait(timeout=60) == (128 + signal.SIGTERM if signum == signal.SIGTERM else -signum)
            assert wait_for(lambda: all(_gone(pid) for pid in ranks), [], timeout=60, poll=0.1)
        finally:
            if launcher.poll() is None:
                launcher.kill()


def test_a_rendezvous_port_is_free_and_outside_the_range_outgoing_connections_take():
    """A port from the ephemeral range can be taken by another world's gloo connection before the rendezvous
    binds it (EADDRINUSE in a busy suite); ports below it are only ever taken by a listener."""
    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # drawn, not the same port for every world
    for port in ports:
        assert low <= 2048 or port < low, (port, low)  # a range from 2048 down leaves no room: the kernel's port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            listener.bind(("127.0.0.1", port))
