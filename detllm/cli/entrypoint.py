"""The process entry point around the typer app: main() runs it and exits quietly on a closed
stdout; entry(), the console script, then leaves a read-only command without the interpreter's
teardown. Usage errors are the app's group's (usage.py); the commands are registered by the
other modules of this package.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any

from .shell import app, closed_pipe

# commands that only read artifacts (no engine, no process or thread of ours left once they return):
# they leave without the interpreter's teardown, which after a large diff spends ~0.1 s freeing
# records and unmapping traces that are about to vanish anyway
_READ_ONLY = frozenset({"diff", "verify", "report"})


def entry() -> None:
    """The console script and `python -m detllm`: main(), then, after a read-only command, a quick
    exit: atexit handlers run and stdout/stderr are flushed, the teardown is skipped."""
    quick = bool(sys.argv[1:]) and sys.argv[1] in _READ_ONLY
    try:
        main()
        code: Any = 0
    except SystemExit as exc:
        if not quick:
            raise
        code = exc.code
    if not quick:
        return
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        sys.stdout.flush()
    except (OSError, ValueError):  # a closed pipe: as main() treats it
        code = closed_pipe()
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    """The console entry point: the typer app (whose group, usage.Group, turns a usage error into
    one line), and a quiet exit on a closed stdout."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        app(args=args, prog_name="detllm")
    except BrokenPipeError:
        sys.exit(closed_pipe())
