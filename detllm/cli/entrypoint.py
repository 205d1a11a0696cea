"""The process entry point around the typer app: main() runs it and exits quietly on a closed
stdout; entry(), the console script, then leaves without the interpreter's teardown when nothing of
ours is left to tear down. Usage errors are the app's group's (usage.py); the commands are registered
by the other modules of this package.
"""

from __future__ import annotations

import atexit
import copy
import gc
import os
import sys
import threading
from typing import Any

import typer

from .families import command_name, register
from .shell import closed_pipe, guarded, held_bodies

# engines whose clean-up runs in finalizers at teardown (shared-memory segments, worker processes, a
# cluster connection), not in atexit: a process that imported one leaves through the teardown
_TEARDOWN_OWNERS = ("vllm", "ray")


def _nothing_left() -> bool:
    """No child process of ours alive, no thread but daemons, no engine that cleans up at teardown:
    what the teardown would do is free memory the kernel frees anyway (~0.6 s after torch and
    transformers, ~0.1 s after a large diff)."""
    if any(name in sys.modules for name in _TEARDOWN_OWNERS):
        return False
    if any(t is not threading.main_thread() and not t.daemon and t.is_alive() for t in threading.enumerate()):
        return False
    me = str(os.getpid())
    try:
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{pid}/stat", "rb") as stat:
                        if stat.read().rsplit(b")", 1)[1].split()[1] == me.encode():
                            return False  # a child (even a zombie not reaped yet): the normal path waits for it
                except (OSError, IndexError):
                    continue
    except OSError:  # no /proc (macOS): not known, so the normal teardown
        return False
    return True


def entry() -> None:
    """The console script and `python -m detllm`: main(), then a quick exit when nothing of ours is
    left (_nothing_left): atexit handlers run and stdout/stderr are flushed, the teardown is skipped."""
    try:
        main()
        code: Any = 0
    except SystemExit as exc:
        code = exc.code
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        sys.stdout.flush()
    except (OSError, ValueError):  # a closed pipe: as main() treats it
        code = closed_pipe()
    atexit._run_exitfuncs()  # what atexit holds runs here once, either way (it is then cleared)
    if not _nothing_left():
        sys.exit(code)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    """The console entry point: the typer app (whose group, usage.Group, turns a usage error into
    one line), and a quiet exit on a closed stdout. run and check leave their body (shell.held_bodies)
    to be run here, after typer and click have returned: tiny's check peaked 0.8 MiB lower."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        with held_bodies() as held:
            try:
                only(args)(args=args, prog_name="detllm")
            except SystemExit:
                if not held:
                    raise
        if held:  # run and check: the body runs now, once the exception above has let go of typer's and click's
            gc.collect()  # frames and command objects (cycles), so the engine never shares the process with them
            try:
                guarded(held[0])
            except typer.Exit as exc:  # guarded's exit code, raised outside click's main
                sys.exit(exc.exit_code)
    except BrokenPipeError:
        sys.exit(closed_pipe())


def only(args: list[str]) -> Any:
    """The app with only the command args name registered, its family alone imported: typer builds
    every registered command's parameters at every start (16 commands, ~40 signatures) and the six
    families import in ~15 ms, ~35 ms of a 0.4 s diff, and a command line runs one. The whole app where
    args name none, or one it does not have (--help, --version, a typo: its help and its suggestions
    list every command)."""
    name = next((a for a in args if not a.startswith("-")), None)
    app = register(name)  # only the family that registers it, when it names a command
    commands = [c for c in app.registered_commands if command_name(c) == name]
    groups = [g for g in app.registered_groups if g.name == name]
    if len(commands) + len(groups) != 1:
        return register()
    lean = copy.copy(app)  # the same app object's settings and root callback; its own two lists
    lean.registered_commands, lean.registered_groups = commands, groups
    return lean
