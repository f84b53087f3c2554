"""`UserError`, whose message is one sentence naming a problem the user can fix and the fix, and
`run_main`, which prints that sentence and exits 1 without a traceback (`--debug` or
MEGALITE_DEBUG=1 shows it)."""

import os
import sys


class UserError(Exception):
    """A bad flag, file or combination the user can fix; the message says how."""


def run_main(main, argv=None):
    """Call `main(argv)`; turn a UserError into `error: <sentence>` on stderr and exit 1."""
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv or os.environ.get("MEGALITE_DEBUG") == "1"
    try:
        return main(argv)
    except UserError as err:
        if debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
