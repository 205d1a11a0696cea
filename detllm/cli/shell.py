"""The shell every command shares: the one typer app, the options several commands take, and
the steps around a command body (guarded: errors to one stderr line and an exit code; emit:
CI outputs, then the verdict or report.json; a progress bar on stderr). It holds no command and
no domain logic.
"""

from __future__ import annotations

import os
import shlex
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Callable, Iterator, Optional

import typer

from ..core.errors import EXIT_CODES, DetllmError, UsageError
from ..runfolder.schema_io import to_json
from .usage import Group

EXIT_HELP = "Exit codes (every command): " + "; ".join(f"{k} {v.split(':')[0]}" for k, v in EXIT_CODES.items()) + "."

app = typer.Typer(
    name="detllm",
    help=f"Is your LLM inference deterministic? Check it, prove it with a repro pack, diff it. {EXIT_HELP}",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=Group,  # usage errors: one line and exit 2 (usage.py)
)


def _version(value: bool) -> None:
    """--version: this detllm's version and the run-folder schema it writes, for a CI log to pin."""
    if value:
        from ..runfolder.env import detllm_version
        from ..core.versions import CURRENT

        typer.echo(f"detllm {detllm_version()} (writes run folders of schema_version {CURRENT})")
        raise typer.Exit(0)


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_version, help="Print the version and exit.")] = False) -> None:
    """Is your LLM inference deterministic? Check it, prove it with a repro pack, diff it."""


# options that several command families take, spelled and explained once
Backend = Annotated[str, typer.Option("--backend", "-b", help="Engine: hf, vllm, llamacpp, openai (a running server: --base-url), fake.")]
Model = Annotated[str, typer.Option("--model", "-m", help="Built-in model (tiny, smollm2-135m), local path, or hub id.")]
JUnit = Annotated[Optional[Path], typer.Option("--junit", help="Also write JUnit XML here (one testcase per prompt) for CI.")]
SignKey = Annotated[Optional[Path], typer.Option("--sign-key", help="Ed25519 PEM private key: sign manifest.json into manifest.sig (needs the cryptography package).")]

EXIT_CLOSED_PIPE = 141  # 128 + SIGPIPE, what any program killed by a closed pipe returns


def fail(err: DetllmError) -> None:
    typer.echo(f"detllm: error: {err.one_line()}", err=True)
    raise typer.Exit(err.exit_code)


_HELD: list[list[Callable[[], int | None]]] = []  # while entrypoint.main parses: where run/check leave their body


@contextmanager
def held_bodies() -> Iterator[list[Callable[[], int | None]]]:
    """While the command line is parsed (entrypoint.main): a body guarded with `detach` is left in the
    list instead of run, for the caller to run once typer and click have returned and their command
    objects are gone (~0.8 MiB of a tiny check's peak RSS); elsewhere (a CliRunner) bodies run inline."""
    held: list[Callable[[], int | None]] = []
    _HELD.append(held)
    try:
        yield held
    finally:
        _HELD.remove(held)


def guarded(fn: Callable[[], int | None], *, detach: bool = False) -> None:
    """Run a command body; DetllmError becomes one stderr line and its exit code, and so does
    an operating-system error on a path the user gave (exit 2): never a traceback. `detach` (run and
    check, which load an engine): while held_bodies() is open, the body is left there to run later."""
    if detach and _HELD:
        _HELD[-1].append(fn)
        raise typer.Exit(0)
    try:
        code = fn()
    except DetllmError as err:
        fail(err)
    except BrokenPipeError:
        raise typer.Exit(closed_pipe())
    except OSError as err:
        where = f": {err.filename}" if err.filename else ""
        fail(UsageError(f"{err.strerror or err}{where}", hint="check the paths given to --out, --junit, --plot and the like"))
    except KeyboardInterrupt:
        typer.echo("detllm: interrupted", err=True)
        raise typer.Exit(130)
    raise typer.Exit(code or 0)


def closed_pipe() -> int:
    """The reader of stdout went away (`detllm report X | head -1`): exit silently. stdout is
    pointed at /dev/null so the interpreter's final flush cannot print an error either."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_CLOSED_PIPE


def _console(stderr: bool = False):
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError  # rich would exit 1, which reads as FAIL; guarded() exits silently instead

    return _Console(stderr=stderr, highlight=False, soft_wrap=True)


def print_verdict(report: dict, out_dir: Path | None, *, folder_line: bool = True) -> None:
    from ..render.text import render_text
    from .plainout import write_plain

    text = render_text(report, shlex.quote(str(out_dir)) if out_dir is not None else "RUN_DIR").splitlines()
    rest = text[1:] + ([f"run folder: {out_dir}"] if out_dir is not None and folder_line else [])
    if write_plain(text[0], rest):  # no terminal: the same bytes without importing rich
        return
    con = _console()
    colour = {"PASS": "green", "FAIL": "red"}.get(report["status"], "yellow")
    con.print(f"[bold {colour}]{text[0]}[/]")
    for line in rest:
        con.print(line, markup=False)


def warn(text: str) -> None:
    typer.echo(f"detllm: warning: {text}", err=True)


def publish(report: dict, junit: Path | None) -> None:
    """CI outputs: JUnit XML when asked for, report.md appended to $GITHUB_STEP_SUMMARY when
    GitHub Actions sets it, and in CI ($CI set) a tier requested but not checked as a warning on
    stderr. The step summary is a side channel: a file that cannot be written is a warning, never
    a change of the verdict's exit code."""
    from ..render.github import append_step_summary, step_summary_target, tier_warning

    if junit is not None:
        from ..render.junit import write_junit  # only when asked: it loads xml.etree (~0.3 MiB in a check)

        write_junit(report, junit)
    try:
        append_step_summary(report)
    except OSError as err:
        warn(f"$GITHUB_STEP_SUMMARY ({step_summary_target()}) cannot be written ({err.strerror or err}): "
             "no step summary; the verdict stands")
    warning = tier_warning(report)
    if warning and os.environ.get("CI", "").lower() not in ("", "0", "false"):  # GitHub, GitLab and most CIs set CI=true
        warn(warning)
    from ..render.engaged import engagement_warning

    if unverified := engagement_warning(report):  # always: a PASS that was not shown is no PASS (strict: exit 3)
        warn(unverified)


def emit(outcome, *, as_json: bool, junit: Path | None = None, folder_line: bool = True) -> int:
    """Publish CI outputs, print report.json (with out_dir, the folder written, first) or the
    verdict, return the exit code. `folder_line` False: the caller prints the folder last (diff --locate)."""
    publish(outcome.report, junit)
    if as_json:
        out_dir = None if outcome.out_dir is None else str(outcome.out_dir)
        typer.echo(to_json({"out_dir": out_dir, **outcome.report}))  # json.dumps(indent=2)'s bytes, faster on a large report
    else:
        print_verdict(outcome.report, outcome.out_dir, folder_line=folder_line)
    return outcome.exit_code


def write_html(outcome, path: Path | None) -> None:
    """--html: the self-contained HTML report of what was just written (render/html.py)."""
    if path is None:
        return
    from ..render.html import render_outcome
    from ..runfolder.schema_io import atomic_write_text

    atomic_write_text(path, render_outcome(outcome.report, outcome.out_dir))


class ProgressBar:
    """Prompt runs done / total (prompts x runs x batch sizes) and tokens/s on stderr, only when
    stderr is a terminal (CI logs stay clean); a rich bar created on first update (imports nothing
    until used), its rate counted from the start of the run."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.bar, self.task, self.t0 = enabled and sys.stderr.isatty(), None, None, 0.0

    def __enter__(self):
        import time

        self.t0 = time.monotonic()  # the first update comes after the first prompt's tokens: they count from here
        return self.update if self.enabled else None

    def update(self, done: int, total: int, tokens: int = 0) -> None:
        import time

        if self.bar is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.bar = Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TextColumn("prompt runs  {task.fields[rate]}"),
                                console=_console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("generating", total=total, rate="")
        elapsed = time.monotonic() - self.t0
        rate = f"{tokens / elapsed:.1f} tokens/s" if elapsed > 0 and tokens else ""
        self.bar.update(self.task, completed=done, rate=rate)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()
