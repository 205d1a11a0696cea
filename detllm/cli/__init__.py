"""The typer CLI: parse -> call the library -> render -> exit code. No logic lives here. One module
per command family registers on the one app (shell.py): run (run, check), info (env, report, doctor,
models), compare (diff, diagnose, sweep), packs (verify, replay, pack), locate (locate), training (train-check,
train-run, parity); fleet and cluster hold what run's commands call for N replicas; entrypoint.py is the
console script, which imports only the family of the command it runs (COMMANDS). `detllm.cli.app` is the
whole app, every family registered. Exit codes (errors.EXIT_CODES, `detllm --help`, docs/cli.md): 0 PASS,
1 FAIL, 2 usage error, 3 tier refused in strict mode, 4 backend unavailable, 5 artifact/schema, 6 integrity,
7 replay refused, 8 backend.
"""

from __future__ import annotations

from typing import Any

from .entrypoint import entry, main
from .families import COMMANDS, FAMILIES, register


def __getattr__(name: str) -> Any:
    if name == "app":
        return register()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["COMMANDS", "FAMILIES", "app", "entry", "main", "register"]
