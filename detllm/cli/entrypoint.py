"""The process entry point around the typer app: main() refuses an empty path value before
typer parses, gives CI a one-line usage error, and exits quietly on a closed stdout; entry(),
the console script, then leaves a read-only command without the interpreter's teardown.
The commands themselves are registered by the other modules of this package.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any

import typer

from .shell import app, closed_pipe

# Options whose value is a path: an empty value would silently mean the current folder.
PATH_FLAGS = ("--out", "-o", "--output", "--prompts", "--prompt-file", "--junit", "--html", "--plot", "--sign-key",
              "--pubkey", "--llama-bin", "--in")


def empty_path_argument(args: list[str]) -> str | None:
    """The flag (or "an argument") given an empty value, where an empty string would silently
    mean the current folder; None when there is none."""
    for i, arg in enumerate(args):
        if arg == "":
            prev = args[i - 1] if i else ""
            if prev in PATH_FLAGS:
                return prev
            if not prev.startswith("-"):
                return "an argument"
        for flag in PATH_FLAGS:
            if flag.startswith("--") and arg == flag + "=":
                return flag
    return None


def quiet_usage_errors() -> bool:
    """CI mode (the CI variable set, or stderr not a terminal): a bad option prints the usage
    line and one error line, not typer's framed box."""
    return bool(os.environ.get("CI")) or not sys.stderr.isatty()


def _click_exceptions():
    try:
        from typer._click import exceptions  # typer vendors click from 0.2x on
    except ImportError:  # older typer: click itself
        from click import exceptions
    return exceptions


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
    """The console entry point: the typer app, plus what must happen before it parses
    (empty path values) and around it (CI-mode usage errors, a closed stdout)."""
    args = sys.argv[1:] if argv is None else list(argv)
    flag = empty_path_argument(args)
    if flag is not None:
        typer.echo(f"detllm: error: {flag} is empty; give a path (use . for the current folder)", err=True)
        sys.exit(2)
    exc = _click_exceptions()
    try:
        if not quiet_usage_errors():
            app(args=args, prog_name="detllm")
            return
        try:
            code = app(args=args, prog_name="detllm", standalone_mode=False)
        except exc.UsageError as err:
            usage = err.ctx.get_usage().splitlines()[0] if err.ctx is not None else "Usage: detllm [OPTIONS] COMMAND [ARGS]..."
            typer.echo(f"{usage}\ndetllm: error: {err.format_message()}", err=True)
            sys.exit(err.exit_code)
        except typer.Abort:
            typer.echo("detllm: interrupted", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)
    except BrokenPipeError:
        sys.exit(closed_pipe())
