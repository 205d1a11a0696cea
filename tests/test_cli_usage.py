"""Usage errors from the option parser (cli/usage.py): for every typed option and argument of every
command, a wrong type, a missing value or argument, an unknown option or command is one line in the
house form on stderr, exit 2, and nothing written. The commands are read from the app itself, so a
new option is covered the day it is added."""

from __future__ import annotations

import enum
import os
from pathlib import Path
from typing import Annotated

import pytest
import typer
from typer.testing import CliRunner

from detllm.cli import app
from detllm.cli.usage import is_path, value_kind

ROOT = typer.main.get_command(app)


def _commands(group=ROOT, path=()):
    for name, cmd in group.commands.items():
        if getattr(cmd, "commands", None):
            yield from _commands(cmd, (*path, name))
        if cmd.callback is not None:
            yield (*path, name), cmd


COMMANDS = list(_commands())


def _numeric():
    for path, cmd in COMMANDS:
        for p in cmd.params:
            if p.param_type_name == "option" and not p.is_flag and value_kind(p) in (int, float):
                yield path, max(p.opts, key=len), value_kind(p)


def _takes_value():
    for path, cmd in COMMANDS:
        for p in cmd.params:
            if p.param_type_name == "option" and not p.is_flag and not p.hidden:
                yield path, max(p.opts, key=len)


def _required():
    """(command, the missing parameter's name, the command line that gives every other required one)."""
    for path, cmd in COMMANDS:
        needed = [p for p in cmd.params if p.required]
        for i, p in enumerate(needed):  # arguments fill in order: the ones before p are given, p and later ones not
            name = max(p.opts, key=len) if p.param_type_name == "option" else (p.metavar or p.name.upper())
            others = [a for j, q in enumerate(needed) if q is not p and (q.param_type_name == "option" or j < i)
                      for a in (["placeholder"] if q.param_type_name == "argument" else [q.opts[0], "placeholder"])]
            yield path, name, others


def _paths():
    for path, cmd in COMMANDS:
        for p in cmd.params:
            if p.param_type_name == "option" and is_path(p):
                yield from ((path, flag) for flag in p.opts)


NUMERIC, TAKES_VALUE, REQUIRED, PATHS = list(_numeric()), list(_takes_value()), list(_required()), list(_paths())


@pytest.fixture
def invoke(tmp_path):
    """CliRunner in an empty current folder; after each call the folder must still be empty."""
    runner = CliRunner()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    calls = []

    def run(*args):
        r = runner.invoke(app, [str(a) for a in args])
        calls.append(args)
        assert list(tmp_path.iterdir()) == [], f"{args} wrote {list(tmp_path.iterdir())}"
        return r

    yield run
    os.chdir(cwd)


def one_line(r) -> str:
    """The single stderr line of a usage error; no typer usage line, box or pydantic wording."""
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert r.stdout == "", r.stdout
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("detllm: error: "), r.stderr
    assert "Usage:" not in r.stderr and "Input should" not in r.stderr and "Traceback" not in r.stderr
    return lines[0].removeprefix("detllm: error: ")


def test_the_app_has_what_these_tests_walk():
    """The walk finds the commands and options it is meant to cover (an empty walk would pass anything)."""
    names = {" ".join(p) for p, _ in COMMANDS}
    assert {"run", "check", "diff", "diagnose", "sweep", "verify", "replay", "pack", "env", "report", "doctor",
            "models export"} <= names
    assert (("check",), "--tier", int) in NUMERIC and (("check",), "--temperature", float) in NUMERIC
    assert (("diff",), "--atol", float) in NUMERIC and (("sweep",), "--repeats", int) in NUMERIC
    assert {(("verify",), "PACK"), (("pack",), "--output"), (("sweep",), "--axis")} <= {r[:2] for r in REQUIRED}
    assert {(("check",), "--out"), (("check",), "-o"), (("pack",), "--output"), (("report",), "--in"),
            (("verify",), "--pubkey")} <= set(PATHS)


@pytest.mark.parametrize("path,flag,kind", NUMERIC, ids=[f"{' '.join(p)} {f}" for p, f, _ in NUMERIC])
def test_a_value_of_the_wrong_type_is_one_line(invoke, path, flag, kind):
    said = one_line(invoke(*path, flag, "abc"))
    noun = "an integer" if kind is int else "a number"
    assert said.startswith(f"{flag} must be {noun}") and said.endswith(", got 'abc'"), said


@pytest.mark.parametrize("args,line", [
    (["check", "--tier", "abc"], "--tier must be an integer in [0, 3], got 'abc'"),
    (["run", "--batch-size", "2.5"], "--batch-size must be an integer in [1, 4096], got '2.5'"),
    (["check", "--temperature", "hot"], "--temperature must be a number in [0, 100], got 'hot'"),
    (["check", "--top-p", "most"], "--top-p must be a number in (0, 1], got 'most'"),
    (["sweep", "--axis", "batch_size=1,2", "--seed", "x"], "--seed must be an integer in [0, 4294967295], got 'x'"),
    (["diff", "a", "b", "--tier", "two"], "--tier must be an integer, got 'two'"),
    (["check", "--tier", "1\n2"], "--tier must be an integer in [0, 3], got '1\\n2'"),
])
def test_the_line_names_the_flag_its_type_and_range(invoke, args, line):
    assert one_line(invoke(*args)) == line


@pytest.mark.parametrize("path,flag", TAKES_VALUE, ids=[f"{' '.join(p)} {f}" for p, f in TAKES_VALUE])
def test_an_option_without_its_value_is_one_line(invoke, path, flag):
    assert one_line(invoke(*path, flag)) == f"{flag} needs a value (see `detllm {' '.join(path)} --help`)"


@pytest.mark.parametrize("path,name,others", REQUIRED, ids=[f"{' '.join(p)} {n}" for p, n, _ in REQUIRED])
def test_a_missing_argument_is_one_line(invoke, path, name, others):
    said = one_line(invoke(*path, *others))
    assert said.startswith(f"`detllm {' '.join(path)}` needs {name}: ")
    assert said.endswith(f"(see `detllm {' '.join(path)} --help`)"), said


PARSED = [p for p, cmd in COMMANDS if not cmd.context_settings.get("ignore_unknown_options")]  # diagnose passes check's options on to check


@pytest.mark.parametrize("path", PARSED, ids=[" ".join(p) for p in PARSED])
def test_an_unknown_option_is_one_line(invoke, path):
    assert one_line(invoke(*path, "--no-such-flag")).startswith(f"`detllm {' '.join(path)}` has no option --no-such-flag (")


def test_unknown_options_commands_and_extra_arguments(invoke):
    assert one_line(invoke("check", "--bakend", "hf")) == "`detllm check` has no option --bakend (did you mean --backend?)"
    assert one_line(invoke("check", "-z")) == "`detllm check` has no option -z (see `detllm check --help`)"
    assert one_line(invoke("chek")) == "`detllm` has no command 'chek' (did you mean 'check'?)"
    assert one_line(invoke("models", "exprt")) == "`detllm models` has no command 'exprt' (did you mean 'export'?)"
    assert one_line(invoke("check", "stray")) == "unexpected extra argument 'stray' to `detllm check` (see `detllm check --help`)"
    assert one_line(invoke("check", "--json=yes")) == "--json takes no value (see `detllm check --help`)"
    assert one_line(invoke("verify")) == ("`detllm verify` needs PACK: a sealed run folder or .tar.gz pack "
                                          "(see `detllm verify --help`)")


@pytest.mark.parametrize("path,flag", PATHS, ids=[f"{' '.join(p)} {f}" for p, f in PATHS])
def test_an_empty_path_is_one_line_for_every_path_option(invoke, path, flag):
    """An empty path would silently mean the current folder. The rule sits in the app's group and
    reads the path options from the commands, so CliRunner meets it too and a new one is covered."""
    assert one_line(invoke(*path, flag, "")) == f"{flag} is empty; give a path (use . for the current folder)"
    if flag.startswith("--"):
        assert one_line(invoke(*path, f"{flag}=")) == f"{flag} is empty; give a path (use . for the current folder)"


@pytest.mark.parametrize("args", [["report", ""], ["verify", ""], ["models", "export", "tiny", ""]])
def test_an_empty_path_argument_is_one_line(invoke, args):
    assert one_line(invoke(*args)) == "an argument is empty; give a path (use . for the current folder)"


class Colour(str, enum.Enum):
    red = "red"
    green = "green"


def test_a_choice_option_names_its_choices(tmp_path):
    """detllm's own app has no choice-typed option today; the rule is the group's, so a typer app
    with the same group class shows what a new choice option will print."""
    from detllm.cli.usage import Group

    demo = typer.Typer(cls=Group, add_completion=False)

    @demo.command()
    def paint(colour: Annotated[Colour, typer.Option("--colour")] = Colour.red, out: Path = Path("x")) -> None:
        out.write_text(colour.value)

    @demo.command()
    def other() -> None:
        pass

    r = CliRunner().invoke(demo, ["paint", "--colour", "blue", "--out", str(tmp_path / "x")])
    assert one_line(r) == "--colour must be one of red, green, got 'blue'"
    assert not (tmp_path / "x").exists()


def test_help_is_still_typers():
    r = CliRunner().invoke(app, ["check", "--help"])
    assert r.exit_code == 0 and "Usage: detllm check [OPTIONS]" in r.stdout and "--tier" in r.stdout
