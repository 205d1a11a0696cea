"""The fleet's shell (docs/fleet.md): `check` with several --base-url and `diff` with more than two
sides hand their outcome here to be published (JUnit per replica, HTML) and printed; the exit code
is the fleet's (0 all agree, 1 otherwise). The logic is detllm/fleet/.
"""

from __future__ import annotations

from pathlib import Path

import typer

from ..runfolder.schema_io import to_json


def emit_fleet(outcome, *, as_json: bool, junit: Path | None = None, html: Path | None = None) -> int:
    from ..render.fleet import render_html, render_junit, render_text
    from ..runfolder.schema_io import atomic_write_text

    if junit is not None:
        atomic_write_text(Path(junit), render_junit(outcome.report))
    if html is not None:
        atomic_write_text(Path(html), render_html(outcome.report))
    if as_json:
        out_dir = None if outcome.out_dir is None else str(outcome.out_dir)
        typer.echo(to_json({"out_dir": out_dir, **outcome.report}))
    else:
        typer.echo(render_text(outcome.report).rstrip("\n"))
        if outcome.out_dir is not None:
            typer.echo(f"fleet folder: {outcome.out_dir}")
    return outcome.exit_code
