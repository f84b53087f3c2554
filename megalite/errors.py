"""The one error type for problems a user can fix, and the CLI wrapper that reports it.

A `UserError` message is one sentence that names the problem and the fix (which flag,
which file, which line). Entry points wrap `main` in `run_main`, which prints that
sentence and exits 1 with no traceback; `--debug` (or MEGALITE_DEBUG=1) shows it.
"""

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
