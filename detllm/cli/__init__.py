"""The typer CLI: parse -> call the library -> render -> exit code. No logic lives here. One module
per command family registers on the one app (shell.py): run (run, check), info (env, report, doctor,
models), compare (diff, diagnose, sweep), packs (verify, replay, pack), locate (locate), training (train-check,
parity), fleet (the N-way commands); entrypoint.py is the console script. Exit codes (errors.EXIT_CODES, `detllm --help`, docs/cli.md): 0 PASS, 1 FAIL, 2 usage error,
3 tier refused in strict mode, 4 backend unavailable, 5 artifact/schema, 6 integrity, 7 replay refused, 8 backend.
"""

from __future__ import annotations

# isort: off
# each command family registers its commands on the app as it is imported: this order is --help's
from . import run, info, compare, packs, locate, training, fleet  # noqa: F401
# isort: on
from .entrypoint import entry, main
from .shell import app

__all__ = ["app", "entry", "main"]
