"""Usage errors in the house form. What typer and click raise while parsing a command line (an
unknown option or command, a value that is not the option's type, a missing argument or value,
an empty path) becomes one line on stderr, `detllm: error: --tier must be an integer in [0, 3],
got 'abc'`, and exit 2, before any command body runs: nothing is written. The app's group class
(Group) does it once for every command, for the console script and CliRunner alike; `--help`
and a bare `detllm` (the help page) are left to typer.
"""

from __future__ import annotations

import re
import sys
from difflib import get_close_matches
from typing import Any

import typer
from typer._click import exceptions as click_errors
from typer._click import types as click_types
from typer._types import TyperChoice
from typer.core import TyperGroup
from typer.exceptions import Abort
from typer.models import TyperPath

# typer 0.28 (pinned below 0.29 in pyproject.toml): its vendored click's parameter types. 0.29 coerces
# through pydantic, ~7 MiB of peak memory and ~80 ms of import that no command uses.

# commands whose numeric options are RunConfig's settings, so their declared ranges (config.Range) apply
RANGED_COMMANDS = ("run", "check", "sweep")


def empty_path_argument(args: list[str], path_flags: set[str]) -> str | None:
    """The flag (or "an argument") given an empty value, where an empty string would silently
    mean the current folder; None when there is none."""
    for i, arg in enumerate(args):
        if arg == "":
            prev = args[i - 1] if i else ""
            if prev in path_flags:
                return prev
            if not prev.startswith("-"):
                return "an argument"
        if arg.endswith("=") and arg[:-1] in path_flags and arg.startswith("--"):
            return arg[:-1]
    return None


def dashed_path_value(args: list[str], path_flags: set[str]) -> tuple[str, str] | None:
    """(flag, value) where a path option took an option as its value (`--html --json` would write
    a file named --json); None when there is none. `./--json` still names such a file."""
    for i, arg in enumerate(args[:-1]):
        if arg == "--":
            return None
        if arg in path_flags and args[i + 1].startswith("--"):
            return arg, args[i + 1]
    for arg in args:
        flag, eq, value = arg.partition("=")
        if eq and flag in path_flags and value.startswith("--"):
            return flag, value
    return None


def path_flags(group: Any) -> set[str]:
    """Every spelling of every option whose value is a path, in every command of the group."""
    flags: set[str] = set()
    for cmd in group.commands.values():
        if getattr(cmd, "commands", None):
            flags |= path_flags(cmd)
        for p in cmd.params:
            if p.param_type_name == "option" and is_path(p):
                flags.update(p.opts)
    return flags


def is_path(param: Any) -> bool:
    """Whether the parameter's value is a path (typer gives a pathlib.Path annotation TyperPath)."""
    return isinstance(param.type, TyperPath)


def value_kind(param: Any) -> type | None:
    """int or float for a numeric parameter (each item's, for a list), None for any other."""
    if isinstance(param.type, click_types.IntParamType):
        return int
    if isinstance(param.type, click_types.FloatParamType):
        return float
    return None


class Group(TyperGroup):
    """The app's top-level group: typer's, with every usage error turned into one line (explain)."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args=args, prog_name=prog_name, complete_var=complete_var, standalone_mode=False, **extra)
        argv = sys.argv[1:] if args is None else list(args)
        flag = empty_path_argument(argv, path_flags(self)) if any(a == "" or a.endswith("=") for a in argv) else None
        if flag is not None:
            typer.echo(f"detllm: error: {flag} is empty; give a path (use . for the current folder)", err=True)
            sys.exit(2)
        dashed = dashed_path_value(argv, path_flags(self)) if any(a.startswith("--") for a in argv) else None
        if dashed is not None:
            flag, value = dashed
            typer.echo(f"detllm: error: {flag} needs a path, got the option {value!r} "
                       f"(give {flag} its path; for a file named {value}, write ./{value})", err=True)
            sys.exit(2)
        try:
            code = super().main(args=argv, prog_name=prog_name, complete_var=complete_var, standalone_mode=False, **extra)
        except click_errors.NoArgsIsHelpError as err:  # `detllm` alone: the help page, as typer prints it
            if err.format_message():  # rich has printed it already; click's plain help has not
                err.show()
            sys.exit(err.exit_code)
        except click_errors.UsageError as err:
            typer.echo(f"detllm: error: {explain(err, self.command_path(argv), argv)}", err=True)
            sys.exit(2)
        except click_errors.ClickException as err:
            typer.echo(f"detllm: error: {_one_line(err.format_message())}", err=True)
            sys.exit(err.exit_code)
        except Abort:  # Ctrl-D at a prompt: as guarded() treats Ctrl-C
            typer.echo("detllm: interrupted", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)

    def command_path(self, argv: list[str]) -> str:
        """'detllm models export': the commands named at the head of argv (for an error click
        raised without its context)."""
        path, cmd = ["detllm"], self
        for token in argv:
            sub = getattr(cmd, "commands", {}).get(token)
            if sub is None:
                break
            path.append(token)
            cmd = sub
        return " ".join(path)


def explain(err: Any, command_path: str = "detllm", argv: list[str] | None = None) -> str:
    """One line (what is wrong, then what to do in parentheses) for a click UsageError; the
    command is the error's own, else command_path; argv (the command line) names the value refused."""
    ctx = err.ctx
    where = ctx.command_path if ctx is not None else command_path  # e.g. "detllm check"
    see = f"see `{where} --help`"
    param = getattr(err, "param", None)
    if isinstance(err, click_errors.MissingParameter) and param is not None:
        about = _first_sentence(getattr(param, "help", None))
        return f"`{where}` needs {_name(param)}{f': {about}' if about else ''} ({see})"
    if isinstance(err, click_errors.BadParameter) and param is not None:
        value = _input_of(err, argv or [])
        if value is _UNKNOWN:
            return f"{_name(param)}: {_one_line(err.message)} ({see})"
        return f"{_name(param)} must be {expected(param, where)}, got {_show(value)}"
    if isinstance(err, click_errors.NoSuchOption):
        hint = f"did you mean {' or '.join(sorted(err.possibilities))}?" if err.possibilities else see
        return f"`{where}` has no option {_safe(err.option_name)} ({hint})"
    if isinstance(err, click_errors.BadOptionUsage):
        if " requires " in err.message:
            return f"{_safe(err.option_name)} needs a value ({see})"
        if "does not take a value" in err.message:
            return f"{_safe(err.option_name)} takes no value ({see})"
    m = re.fullmatch(r"No such command '(.*)'\..*", err.message, re.DOTALL)
    if m is not None and ctx is not None:
        names = [n for n, c in getattr(ctx.command, "commands", {}).items() if not c.hidden]
        close = get_close_matches(m.group(1), names)
        return f"`{where}` has no command {_show(m.group(1))} " + \
            (f"(did you mean {' or '.join(map(repr, close))}?)" if close else f"({see})")
    m = re.fullmatch(r"Got unexpected extra argument\(s\) \((.*)\)", err.message, re.DOTALL)
    if m is not None:
        return f"unexpected extra argument {_show(m.group(1))} to `{where}` ({see})"
    return f"{_one_line(err.format_message())} ({see})"


def expected(param: Any, where: str) -> str:
    """What a value of this parameter must be: 'an integer in [1, 4096]', 'a number', 'one of a, b'."""
    if isinstance(param.type, TyperChoice):
        return "one of " + ", ".join(str(getattr(c, "value", c)) for c in param.type.choices)
    kind = {int: "an integer", float: "a number"}.get(value_kind(param), f"a {param.type.name}")
    rng = _declared_ranges().get(param.opts[0]) if where.split()[-1] in RANGED_COMMANDS else None
    return f"{kind} in {rng}" if rng else kind


def _declared_ranges() -> dict[str, str]:
    """The ranges RunConfig and Decoding declare (docs/cli.md's table), by CLI flag; --tier's is TIERS."""
    import dataclasses

    from ..core.config import TIERS, Decoding, RunConfig, cli_flag, ints

    ranges = {cli_flag(f.name): f.metadata["range"].text()
              for cls in (Decoding, RunConfig) for f in dataclasses.fields(cls) if "range" in f.metadata}
    ranges["--tier"] = ints(min(TIERS), max(TIERS)).text()
    return ranges


_UNKNOWN = object()


def _input_of(err: Any, argv: list[str]) -> Any:
    """The value of the option the user gave that its type refuses (click's error carries only a
    message): each value argv gives the option (`--x v`, `--x=v`), converted again; _UNKNOWN
    when none is refused (an argument, a value from elsewhere)."""
    param = err.param
    if param.param_type_name != "option":
        return _UNKNOWN
    given = []
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        for opt in param.opts:
            if arg == opt and i + 1 < len(argv):
                given.append(argv[i + 1])
            elif opt.startswith("--") and arg.startswith(opt + "="):
                given.append(arg[len(opt) + 1:])
    for value in given:
        try:
            param.type.convert(value, param, err.ctx)
        except click_errors.BadParameter:
            return value
    return _UNKNOWN


def _name(param: Any) -> str:
    """--long-flag for an option, its METAVAR for an argument."""
    if param.param_type_name == "option":
        return max(param.opts, key=len)
    return param.metavar or param.name.upper()


def _first_sentence(text: str | None) -> str:
    """'a sealed run folder' from a help text 'A sealed run folder. More...' (an acronym keeps its case)."""
    first = (text or "").strip().split(". ")[0].rstrip(".")
    return first[:1].lower() + first[1:] if re.match(r"[A-Z][a-z]*(?=[\s,:;-]|$)", first) else first


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else _safe(str(value))


def _safe(text: str) -> str:
    return text if text.isprintable() else repr(text)


def _one_line(text: str) -> str:
    return " ".join(text.split()).rstrip(".")


__all__ = ["Group", "dashed_path_value", "empty_path_argument", "expected", "explain", "is_path", "path_flags", "value_kind"]
