"""The signal policy of every worker process megalite starts: data-loader workers and tokenizing pools.

A SIGINT or SIGTERM meant for the whole job (Ctrl-C, scancel) is the main process's: it saves, then stops its workers.
A worker dying of it would break the loop or leave a pool waiting forever; one ignoring SIGTERM would hang a pool's
terminate(). So a worker ignores SIGINT, and exits on a SIGTERM sent by its main process, or once that process is gone
(docs/reliability.md).
"""

import contextlib
import os
import signal
import threading

STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
PARENT_CHECK_S = 1.0  # how often a worker looks whether its main process is still there


@contextlib.contextmanager
def workers_starting():
    """Around the start of worker processes: they start with the stop signals blocked, so that a signal
    sent before their policy is set is kept for it instead of going to a handler copied from this process.
    This thread gets its signals when the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def leave_stop_signals_to(main_pid: int) -> None:
    """A worker's policy, set first thing in the worker started by process `main_pid` (see the module's
    docstring). Its SIGTERM is taken by a thread that waits for it; without sigtimedwait (macOS), where
    the sender cannot be told apart, a SIGTERM from anyone ends the worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not a handler copied from the main process
    if hasattr(signal, "sigtimedwait"):
        # Blocked in this thread and so in every thread started after it: only the waiting thread takes it.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        threading.Thread(target=_exit_when_told, args=(main_pid, os.getppid()), name="stop-signals",
                         daemon=True).start()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    else:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _exit_when_told(main_pid: int, parent_pid: int) -> None:
    """Wait for a SIGTERM from `main_pid`, or for the parent to be gone (this process then has another);
    then exit at once, with code 0: torch's loader takes any other as its worker failing."""
    while os.getppid() == parent_pid:
        received = signal.sigtimedwait({signal.SIGTERM}, PARENT_CHECK_S)
        if received is not None and received.si_pid == main_pid:
            break
    os._exit(0)
