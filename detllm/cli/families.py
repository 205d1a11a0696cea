"""Which module of this package registers each command (the families), and importing them: all of
them, in --help's order, for the whole app; one, for the console script's one command (entrypoint.only).
"""

from __future__ import annotations

from typing import Any

from typer.main import get_command_name

from .shell import app

# the families in --help's order, and the family that registers each command (tests/test_cli_families.py
# holds the map to what each module registers)
FAMILIES = ("run", "info", "compare", "packs", "locate", "training")
COMMANDS = {"run": "run", "check": "run", "env": "info", "report": "info", "doctor": "info", "models": "info",
            "diff": "compare", "diagnose": "compare", "sweep": "compare", "verify": "packs", "replay": "packs",
            "pack": "packs", "locate": "locate", "train-check": "training", "train-run": "training", "parity": "training"}


def register(command: str | None = None) -> Any:
    """Import the family that registers `command` (every family when None or not a command) and return
    the app; with every family, the commands stand in --help's order whatever was imported first."""
    family = COMMANDS.get(command) if command is not None else None
    if family is not None:
        _load(family)
        return app
    for name in FAMILIES:
        _load(name)
    app.registered_commands.sort(key=lambda c: FAMILIES.index(c.callback.__module__.rsplit(".", 1)[-1]))
    return app


def command_name(info: Any) -> str:
    """The name a registered command (typer's CommandInfo) is called by on the command line."""
    return info.name or get_command_name(info.callback.__name__)


def names(typer_app: Any) -> list[str]:
    """Every command and command group registered on the app, commands first, in registration order."""
    return [command_name(c) for c in typer_app.registered_commands] + [g.name for g in typer_app.registered_groups]


def _load(family: str) -> None:
    """Import one family's module: it registers its commands on the app (written out, not a string
    import, so the layer contracts see each)."""
    if family == "run":
        from . import run  # noqa: F401
    elif family == "info":
        from . import info  # noqa: F401
    elif family == "compare":
        from . import compare  # noqa: F401
    elif family == "packs":
        from . import packs  # noqa: F401
    elif family == "locate":
        from . import locate  # noqa: F401
    elif family == "training":
        from . import training  # noqa: F401
    else:
        raise ValueError(f"no command family {family!r}")
