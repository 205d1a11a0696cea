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
from types import SimpleNamespace
from difflib import get_close_matches
from typing import Any, get_args, get_origin

import typer
from typer.core import TyperGroup

try:  # typer vendors click from 0.2x on, with Abort moved to typer.exceptions
    from typer._click import exceptions as click_errors
    from typer.exceptions import Abort
except ImportError:  # older typer: click itself
    from click import exceptions as click_errors
    from click.exceptions import Abort

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
            if p.param_type_name == "option" and p.type_descriptor.is_path:
                flags.update(p.opts)
    return flags


def bare_flags(group: Any) -> None:
    """A flag takes no value, so its help shows no type: typer's plain help already leaves it out,
    its rich help printed `--json <bool>`. Every flag of every command, --help included, shows none."""
    names = (group.context_settings or {}).get("help_option_names", ["--help"])
    for cmd in [group, *group.commands.values()]:
        if cmd is not group and getattr(cmd, "commands", None):
            bare_flags(cmd)
            continue
        helper = cmd.get_help_option(SimpleNamespace(help_option_names=names))  # what get_help_option reads of a context
        for p in [*cmd.params, helper]:
            if p is not None and getattr(p, "is_flag", False):
                p.display_type_rich = _no_type


def _no_type(ctx: Any = None) -> None:
    return None


class Group(TyperGroup):
    """The app's top-level group: typer's, with every usage error turned into one line (explain)."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args=args, prog_name=prog_name, complete_var=complete_var, standalone_mode=False, **extra)
        argv = sys.argv[1:] if args is None else list(args)
        bare_flags(self)
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
            typer.echo(f"detllm: error: {explain(err, self.command_path(argv))}", err=True)
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


def explain(err: Any, command_path: str = "detllm") -> str:
    """One line (what is wrong, then what to do in parentheses) for a click UsageError; the
    command is the error's own, else command_path."""
    ctx = err.ctx
    where = ctx.command_path if ctx is not None else command_path  # e.g. "detllm check"
    see = f"see `{where} --help`"
    param = getattr(err, "param", None)
    if isinstance(err, click_errors.MissingParameter) and param is not None:
        about = _first_sentence(getattr(param, "help", None))
        return f"`{where}` needs {_name(param)}{f': {about}' if about else ''} ({see})"
    if isinstance(err, click_errors.BadParameter) and param is not None:
        value = _input_of(err)
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
    desc = param.type_descriptor
    if desc.is_choice:
        return "one of " + ", ".join(str(getattr(c, "value", c)) for c in desc.choices or ())
    annotation = desc.annotation
    if get_origin(annotation) is list:
        (annotation,) = get_args(annotation)
    kind = {int: "an integer", float: "a number"}.get(annotation, f"a {getattr(annotation, '__name__', 'value')}")
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


def _input_of(err: Any) -> Any:
    """The value the user gave, from the pydantic error typer's coercion raised; _UNKNOWN without one."""
    cause = err.__cause__
    try:
        return cause.errors()[0]["input"]
    except (AttributeError, IndexError, KeyError, TypeError):
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


__all__ = ["Group", "bare_flags", "dashed_path_value", "empty_path_argument", "expected", "explain", "path_flags"]
