"""`detllm locate` commands: parse -> call the library (locate/) -> render -> exit code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..runfolder.artifacts import check_output_file
from .shell import app, guarded


@app.command(help="From the first step where two runs differ to the first layer and op where their bits part: "
                  "`detllm locate A B` (run folders or FOLDER::batch_B selections) or `detllm locate DIFF_OR_CHECK_FOLDER`. "
                  "Re-runs each side's recorded batch in-process with capture (hf), checks it reproduces its own trace, "
                  "and names the first op whose inputs agree but output differs. Writes locate.json/.txt/.md. "
                  "Exit 0 when written (located or not), 4 for a backend without internals, 7 when the model files changed.")
def locate(
    a: Annotated[str, typer.Argument(metavar="A", help="Left side (FOLDER, FOLDER::run_N@batch_B), or a diff or failing check folder.")],
    b: Annotated[Optional[str], typer.Argument(metavar="B", help="Right side, the same way.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write here (default: the folder both sides come from, resealed; else a new folder under artifacts/).")] = None,
    force: Annotated[bool, typer.Option(help="Write into an existing non-detllm folder.")] = False,
    prompt: Annotated[Optional[int], typer.Option(help="Locate this prompt index (default: the earliest difference).")] = None,
    step: Annotated[Optional[int], typer.Option(help="Capture at this step whatever was recorded there (default: the first step that differs).")] = None,
    layers_only: Annotated[bool, typer.Option("--layers-only", help="Compare layer boundaries only (large models).")] = False,
    max_memory: Annotated[int, typer.Option("--max-memory", help="Bound on captured tensors, MB, both sides together; past it, layer boundaries only.")] = 512,
    no_ops: Annotated[bool, typer.Option("--no-ops", help="Stop at modules: no second re-run to descend into aten ops.")] = False,
    no_reference: Annotated[bool, typer.Option("--no-reference", help="Skip the float64 re-evaluation of each op (faster; no tolerance is judged).")] = False,
    rows: Annotated[str, typer.Option("--rows", help="Per-layer table rows printed: a number, or all (locate.json holds every row).")] = "40",
    module: Annotated[Optional[str], typer.Option("--module", help="Print the table rows of the modules matching this glob, e.g. 'model.layers.1.*'.")] = None,
    html: Annotated[Optional[Path], typer.Option("--html", help="Also write a self-contained HTML page of the finding here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print locate.json instead of the text.")] = False,
    prefill: Annotated[bool, typer.Option("--prefill", help="Prefill vs decode of ONE side (A alone): its recorded decode at the first step s whose "
                                          "prefill of prompt + tokens[:s] gives another logprob, against that prefill's last position.")] = False,
    graft: Annotated[str, typer.Option("--graft", help="The causal test of the located op: re-run the right side with the left's output of that "
                                       "op substituted (right, the default: one extra re-run), the reverse too (both), or none (off).")] = "right",
) -> None:
    def body() -> int:
        from ..core.errors import UsageError
        from ..locate import locate as run_locate
        from ..render.locate import render_text

        check_output_file(html, "--html")
        if rows != "all" and not (rows.isdigit() and int(rows) >= 1):
            raise UsageError(f"--rows is a number of table rows (>= 1) or all, got {rows!r}")
        if max_memory < 1 or max_memory > 1 << 20:
            raise UsageError(f"--max-memory is in MB, from 1 to 1048576, got {max_memory}")
        result = run_locate(a, b, out=out, force=force, prompt=prompt, layers_only=layers_only, max_bytes=max_memory * 2**20,
                            ops=not no_ops, reference=not no_reference, step=step, prefill=prefill,
                            graft=graft)
        if html is not None:
            from ..render.html import page
            from ..render.locate import html_section
            from ..runfolder.schema_io import atomic_write_text

            atomic_write_text(html, page(f"detllm locate: {result.doc['status']}", html_section(result.doc)))
        text = render_text(result.doc, rows=None if rows == "all" else int(rows), module=module)
        typer.echo(json.dumps(result.doc, indent=2) if as_json else text + f"locate folder: {result.out_dir}")
        return result.exit_code

    guarded(body)


def after_diff(a: str, b: str, out_dir: Path | None, *, quiet: bool) -> None:
    """`diff --locate`: locate the diff's two sides, into the diff's folder when it wrote one."""
    from ..locate import locate as run_locate
    from ..render.locate import render_text

    result = run_locate(a, b, out=out_dir)
    if not quiet:  # the diff's verdict, then the locate block, then the folder(s), last
        same = out_dir is not None and Path(out_dir) == Path(result.out_dir)
        typer.echo(render_text(result.doc) + (f"run folder: {out_dir} (the diff and the locate files)" if same else
                                               (f"run folder: {out_dir}\n" if out_dir is not None else "")
                                               + f"locate folder: {result.out_dir}"))
