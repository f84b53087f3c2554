"""`UserError`, whose message is one sentence naming a problem the user can fix and the fix, and
`run_main`, which prints that sentence and exits 1 without a traceback (`--debug` or
MEGALITE_DEBUG=1 shows it). Under a launcher (torchrun) the sentence is printed once, by the lowest
living rank: rank 0, or the lowest survivor when a `PeerLostError` says that lower ranks died."""

import os
import signal
import sys
import time

# How long a rank other than the lowest living one waits before printing its own error: the lowest usually fails
# alike and first, and the launcher then stops the rest, so one rank prints the sentence and torchrun names it.
OTHER_RANKS_WAIT_S = 3.0
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # as a shell reports a process ended by Ctrl-C


class UserError(Exception):
    """A bad flag, file or combination the user can fix; the message says how."""


class PeerLostError(UserError):
    """A collective failed because other ranks died or hang: `lost_ranks`, those found dead or suspended (only
    ranks on this host can be checked), cannot print the error themselves."""

    def __init__(self, message: str, lost_ranks=()):
        super().__init__(message)
        self.lost_ranks = frozenset(lost_ranks)


def run_main(main, argv=None):
    """Call `main(argv)`; turn a UserError into `error: <sentence>` on stderr and exit 1, and a Ctrl-C
    (KeyboardInterrupt, whose message may say what was lost) into `interrupted` and exit 130."""
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv or os.environ.get("MEGALITE_DEBUG") == "1"
    try:
        return main(argv)
    except UserError as err:
        if debug:
            raise
        _print_once(f"error: {err}", getattr(err, "lost_ranks", ()))
        sys.exit(1)
    except KeyboardInterrupt as err:
        if debug:
            raise
        _print_once(f"interrupted{f': {err}' if str(err) else ''}")
        sys.exit(INTERRUPTED_EXIT_CODE)


def _print_once(line: str, lost_ranks=()) -> None:
    """Print `line` on stderr, once per launched world: the lowest living rank (RANK set by torchrun; every
    rank below it in `lost_ranks`) at once; another rank only if it is still running after OTHER_RANKS_WAIT_S,
    when its error was its own. A signal ends the wait."""
    rank = int(os.environ.get("RANK", "0"))
    if not set(range(rank)) <= set(lost_ranks):
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)  # the launcher's stop ends the process quietly
        time.sleep(OTHER_RANKS_WAIT_S)
        line = f"rank {rank}: {line}"
    print(line, file=sys.stderr, flush=True)
