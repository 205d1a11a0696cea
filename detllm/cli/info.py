"""`detllm env`, `detllm report`, `detllm doctor` and `detllm models`: the commands that show what
is already there (this machine's fingerprint, a recorded report rendered, what works here, the
built-in models, one of which `models export` writes out). None of them generates; report
imports no engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..runfolder.artifacts import check_output_file
from ..core.errors import UsageError
from .shell import JUnit, app, guarded

models_app = typer.Typer(help="List built-in offline models, or export one.", invoke_without_command=True)
app.add_typer(models_app, name="models")


@app.command(help="Print this machine's environment fingerprint (no engine is loaded).")
def env(
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole env.json document.")] = False,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write env.json to this file instead.")] = None,
    redact_env: Annotated[bool, typer.Option("--redact-env", help="Hide every recorded variable's value and the hostname (secrets are always hidden).")] = False,
    redact_env_var: Annotated[Optional[list[str]], typer.Option("--redact-env-var", metavar="NAME", help="Hide this variable's value (repeatable).")] = None,
    validate_schema: Annotated[bool, typer.Option("--validate-schema", help="Accepted for compatibility: env.json is always validated.")] = False,
) -> None:
    def body() -> int:
        from ..api import _redaction
        from ..runfolder.env import collect_env
        from ..runfolder.schema_io import atomic_write_text, dumps, validate

        check_output_file(out, "--out")
        doc = collect_env(redaction=_redaction(redact_env, redact_env_var))
        validate(doc, "env")
        if out is not None:
            atomic_write_text(out, dumps(doc) + "\n")
            typer.echo(f"wrote {out} (fingerprint {doc['fingerprint'][:12]})")
            return 0
        if as_json:
            typer.echo(json.dumps(doc, indent=2))
            return 0
        libs = ", ".join(f"{k} {v}" for k, v in doc["libraries"].items() if v)
        isa = ", ".join(k for k, v in doc["cpu"]["isa"].items() if v)
        typer.echo(f"fingerprint {doc['fingerprint']}\npython {doc['python']['version']} on {doc['os']['system']} {doc['os']['machine']}\n"
                   f"cpu {doc['cpu']['model']} ({doc['cpu']['usable_cores']} usable cores; {isa})\nlibraries {libs}")
        return 0

    guarded(body)


@app.command(help="Render a run or diff folder's report.json: txt, json, md, html (one self-contained file) or "
                  "issue (markdown for an engine's bug template); kld: llama-perplexity's --kl-divergence statistics of "
                  "two runs (RUN_DIR RIGHT, or a diff folder). No engine is imported.")
def report(
    run_dir: Annotated[Optional[Path], typer.Argument(help="A detllm run or diff folder, .tar.gz pack, or report.json.")] = None,
    right: Annotated[Optional[str], typer.Argument(help="--format kld: the second run (folder, pack or FOLDER::run_N@batch_B).")] = None,
    report_in: Annotated[Optional[Path], typer.Option("--in", help="The same as RUN_DIR (the seed's spelling).")] = None,
    fmt: Annotated[Optional[str], typer.Option("--format", "-f", help="txt, json, md, html, issue or kld (default: from --out's suffix, else txt).")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the rendering to this file instead of stdout.")] = None,
    junit: JUnit = None,
    reference: Annotated[Optional[str], typer.Option("--reference", metavar="replica_N", help="--format kld of a fleet folder: the replica the others are measured against (default: the majority group's first member).")] = None,
    validate_schema: Annotated[bool, typer.Option("--validate-schema", help="Accepted for compatibility: report.json is always validated.")] = False,
) -> None:
    def body() -> int:
        from ..commands.report import render_path

        if (run_dir is None) == (report_in is None):
            raise UsageError("give the report to render once: RUN_DIR or --in", hint="e.g. detllm report artifacts/check-1")
        check_output_file(out, "--out")
        check_output_file(junit, "--junit")
        text = render_path(run_dir or report_in, fmt, out=out, junit=junit, right=right, reference=reference)
        if out is None:
            typer.echo(text, nl=False)
        return 0

    guarded(body)


@app.command(help="What works on this machine: each backend, the tier it can enforce, and the command that fixes "
                  "what is missing. Never downloads anything.")
def doctor(as_json: Annotated[bool, typer.Option("--json", help="Print the findings as JSON.")] = False) -> None:
    def body() -> int:
        from ..commands.doctor import diagnose_machine, render_doctor

        found = diagnose_machine()
        typer.echo(json.dumps(found, indent=2) if as_json else render_doctor(found), nl=as_json)
        return 0

    guarded(body)


@models_app.callback()
def models(ctx: typer.Context) -> None:
    if ctx.invoked_subcommand is not None:
        return

    def body() -> int:
        from ..models import list_models

        for m in list_models():
            cached = ", ".join(m["cached"]) or "not built yet"
            typer.echo(f"{m['name']:<14} {m['description']}  [formats: {', '.join(m['formats'])}; cached: {cached}]")
        return 0

    guarded(body)


@models_app.command("export", help="Write a built-in model to DIR as a plain HF folder (or GGUF with --format gguf).")
def models_export(
    name: Annotated[str, typer.Argument(help="Built-in model name.")],
    dest: Annotated[Path, typer.Argument(help="Destination folder (new or empty).")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="hf or gguf.")] = "hf",
) -> None:
    def body() -> int:
        from ..models import export_model

        if fmt not in ("hf", "gguf"):
            raise UsageError(f"--format must be hf or gguf, got {fmt!r}")
        typer.echo(f"exported {name} ({fmt}) to {export_model(name, dest, fmt)}")
        return 0

    guarded(body)
