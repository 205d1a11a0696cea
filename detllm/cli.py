"""The typer CLI: parse -> call the library -> render -> exit code. No logic lives here.

Exit codes (also in `detllm --help` and docs/cli.md): 0 PASS, 1 FAIL (divergence),
2 usage error, 3 tier refused in strict mode, 4 backend unavailable, 5 artifact or
schema error, 6 integrity error, 7 replay refused (model changed), 8 backend error.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from .artifacts import check_output_file
from .schema_io import to_json
from .errors import EXIT_CODES, DetllmError, UsageError

EXIT_HELP = "Exit codes (every command): " + "; ".join(f"{k} {v.split(':')[0]}" for k, v in EXIT_CODES.items()) + "."

app = typer.Typer(
    name="detllm",
    help=f"Is your LLM inference deterministic? Check it, prove it with a repro pack, diff it. {EXIT_HELP}",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
models_app = typer.Typer(help="List built-in offline models, or export one.", invoke_without_command=True)
app.add_typer(models_app, name="models")


def fail(err: DetllmError) -> None:
    typer.echo(f"detllm: error: {err.one_line()}", err=True)
    raise typer.Exit(err.exit_code)


def guarded(fn: Callable[[], int | None]) -> None:
    """Run a command body; DetllmError becomes one stderr line and its exit code, and so does
    an operating-system error on a path the user gave (exit 2): never a traceback."""
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


def _console(stderr: bool = False):
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError  # rich would exit 1, which reads as FAIL; guarded() exits silently instead

    return _Console(stderr=stderr, highlight=False, soft_wrap=True)


def print_verdict(report: dict, out_dir: Path | None) -> None:
    from .render.text import render_text

    con = _console()
    colour = {"PASS": "green", "FAIL": "red"}.get(report["status"], "yellow")
    text = render_text(report).splitlines()
    con.print(f"[bold {colour}]{text[0]}[/]")
    for line in text[1:]:
        con.print(line, markup=False)
    if out_dir is not None:
        con.print(f"run folder: {out_dir}", markup=False)


def publish(report: dict, junit: Path | None) -> None:
    """CI outputs: JUnit XML when asked for, and report.md appended to $GITHUB_STEP_SUMMARY
    when GitHub Actions sets it."""
    from .render.github import append_step_summary
    from .render.junit import write_junit

    if junit is not None:
        write_junit(report, junit)
    append_step_summary(report)


def emit(outcome, *, as_json: bool, junit: Path | None = None) -> int:
    """Publish CI outputs, print report.json or the verdict, return the exit code."""
    publish(outcome.report, junit)
    if as_json:
        typer.echo(to_json(outcome.report))  # json.dumps(indent=2)'s bytes, faster on a large report
    else:
        print_verdict(outcome.report, outcome.out_dir)
    return outcome.exit_code


# ------------------------------------------------------------------ run / check

Backend = Annotated[str, typer.Option("--backend", "-b", help="Engine: hf, vllm, llamacpp, fake.")]
Model = Annotated[str, typer.Option("--model", "-m", help="Built-in model (tiny, smollm2-135m), local path, or hub id.")]
JUnit = Annotated[Optional[Path], typer.Option("--junit", help="Also write JUnit XML here (one testcase per prompt) for CI.")]
FreshProcess = Annotated[int, typer.Option("--fresh-process", help="check: run this many of the repeats each in a new process (new import, load and settings); the others share run 0's process.")]
FreshProcessHidden = Annotated[int, typer.Option("--fresh-process", hidden=True)]  # run: not offered (RunConfig.validate refuses it)
NegativeControl = Annotated[bool, typer.Option("--negative-control", help="check: also generate each prompt in a batch of fillers (a deliberately non-invariant setting); it must differ, else the verdict says the prompts were too few to expose variance.")]
NegativeControlHidden = Annotated[bool, typer.Option("--negative-control", hidden=True)]  # run: not offered
SignKey = Annotated[Optional[Path], typer.Option("--sign-key", help="Ed25519 PEM private key: sign manifest.json into manifest.sig (needs the cryptography package).")]


def _gen_command(command: str, default_runs: int) -> Callable:
    def cmd(
        backend: Backend = "hf",
        model: Model = "tiny",
        prompts: Annotated[Optional[Path], typer.Option(help="Prompt file: .jsonl ({\"prompt\": ...} per line) or text (one per line).")] = None,
        prompt: Annotated[Optional[list[str]], typer.Option("--prompt", help="A prompt (repeatable); instead of --prompts.")] = None,
        prompt_file: Annotated[Optional[Path], typer.Option("--prompt-file", help="JSONL prompt file ({\"prompt\"|\"text\": ...} or a string per line).")] = None,
        out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Run folder (default: a new folder under artifacts/).")] = None,
        force: Annotated[bool, typer.Option(help="Write into an existing non-detllm folder.")] = False,
        tier: Annotated[int, typer.Option(help="0 artifacts only, 1 token ids repeat, 2 +logprobs equal, 3 +batch invariance.")] = 1,
        mode: Annotated[str, typer.Option(help="strict: refuse a tier the backend cannot enforce; best-effort: downgrade and record.")] = "best-effort",
        runs: Annotated[int, typer.Option(help="Repeats at --batch-size (check needs >= 2).")] = default_runs,
        fresh_process: FreshProcess = 0,
        negative_control: NegativeControl = False,
        batch_size: Annotated[int, typer.Option(help="Batch size of the repeated runs.")] = 1,
        vary_batch: Annotated[Optional[str], typer.Option(help="Extra batch sizes, e.g. 1,2,8; each is compared to batch size 1.")] = None,
        max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per prompt.")] = 16,
        temperature: Annotated[float, typer.Option(help="0 = greedy; > 0 samples with a seeded generator per request.")] = 0.0,
        top_p: Annotated[float, typer.Option(help="Nucleus sampling filter.")] = 1.0,
        top_k: Annotated[int, typer.Option("--top-k", help="Top-k sampling filter (0 = off), as in transformers, vLLM and llama.cpp.")] = 0,
        sample_top_k: Annotated[Optional[int], typer.Option("--sample-top-k", hidden=True, help="Old name of --top-k.")] = None,
        seed: Annotated[int, typer.Option(help="Seed for every RNG and per-request generator.")] = 0,
        logprobs: Annotated[int, typer.Option("--logprobs", help="(id, logprob) pairs recorded per step, best first (OpenAI's top_logprobs).")] = 5,
        dtype: Annotated[str, typer.Option(help="float32, bfloat16, float16 or auto.")] = "float32",
        device: Annotated[str, typer.Option(help="cpu, cuda or auto.")] = "cpu",
        threads: Annotated[Optional[int], typer.Option(help="Intra-op threads (default: the engine's).")] = None,
        atol: Annotated[float, typer.Option(help="Logprob tolerance at tier >= 2 (0 = bitwise).")] = 0.0,
        revision: Annotated[Optional[str], typer.Option(help="Hub revision of --model.")] = None,
        tokenizer_revision: Annotated[Optional[str], typer.Option("--tokenizer-revision", help="Tokenizer revision: the model's snapshot, so the same as --revision.")] = None,
        redact_env: Annotated[bool, typer.Option("--redact-env", help="env.json: hide every recorded variable's value and the hostname (secrets are always hidden).")] = False,
        redact_env_var: Annotated[Optional[list[str]], typer.Option("--redact-env-var", metavar="NAME", help="env.json: hide this variable's value (repeatable).")] = None,
        validate_schema: Annotated[bool, typer.Option("--validate-schema", help="Accepted for compatibility: every artifact is always validated.")] = False,
        html: Annotated[Optional[Path], typer.Option("--html", help="Also write a self-contained HTML report here.")] = None,
        prompt_text: Annotated[bool, typer.Option("--prompt-text/--no-prompt-text", help="Record prompt text and input ids (off: only hashes).")] = True,
        opt: Annotated[Optional[list[str]], typer.Option("--opt", help="Backend option key=value (repeatable); see docs/backends/.")] = None,
        llama_bin: Annotated[Optional[Path], typer.Option("--llama-bin", help="llama.cpp bin folder or llama-server binary (llamacpp; else DETLLM_LLAMA_BIN, PATH, the build cache).")] = None,
        base_url: Annotated[Optional[str], typer.Option("--base-url", help="openai: the server's OpenAI-compatible root, e.g. http://127.0.0.1:8080/v1.")] = None,
        api_key_env: Annotated[Optional[str], typer.Option("--api-key-env", metavar="NAME", help="openai: the environment variable holding the API key (never recorded).")] = None,
        chat: Annotated[bool, typer.Option("--chat", help="openai: /v1/chat/completions with one user message.")] = False,
        concurrency: Annotated[Optional[str], typer.Option("--concurrency", help="openai: requests in flight, e.g. 1,8,32 (its --vary-batch); each level is compared with 1.")] = None,
        cache_probe: Annotated[bool, typer.Option("--cache-probe", help="openai (check): each prompt cold, warm, and after a shared prefix; CACHE_VARIANCE on a difference.")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print report.json instead of the verdict.")] = False,
        progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bar on stderr.")] = True,
        sign_key: SignKey = None,
        junit: JUnit = None,
    ) -> None:
        def body() -> int:
            from . import api
            from .config import Decoding, RunConfig, parse_batch_list, parse_options
            from .prompts import resolve_prompts

            cfg = RunConfig(
                backend=backend, model=model, revision=api.tokenizer_revision_of(revision, tokenizer_revision) if tokenizer_revision else revision,
                dtype=dtype, device=device,
                decoding=Decoding(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k if sample_top_k is None else sample_top_k),
                seed=seed, tier=tier, mode=mode, batch_size=batch_size, vary_batch=concurrency_levels(vary_batch, concurrency, backend),
                runs=runs, fresh_process=fresh_process, negative_control=negative_control, logprobs=logprobs, record_prompt_text=prompt_text, threads=threads, atol=atol,
                options=parse_options((opt or []) + llama_bin_option(llama_bin, backend)
                                      + served_options(backend, base_url, api_key_env, chat, cache_probe, command)),
            )
            check_output_file(junit, "--junit")  # before the run, not after it
            check_output_file(html, "--html")
            cfg.validate(command=command)
            prompt_set = resolve_prompts(prompts, texts=prompt or (), jsonl_file=prompt_file)
            with _progress(progress and not as_json) as bar:
                outcome = getattr(api, command)(cfg, prompts=prompt_set, out=out, force=force, progress=bar, sign_key=sign_key,
                                                redact=redact_env, redact_env_vars=redact_env_var)
            write_html(outcome, html)
            return emit(outcome, as_json=as_json, junit=junit)

        guarded(body)

    if command != "check":
        cmd.__annotations__["fresh_process"] = "FreshProcessHidden"
        cmd.__annotations__["negative_control"] = "NegativeControlHidden"
    return cmd


def write_html(outcome, path: Path | None) -> None:
    """--html: the self-contained HTML report of what was just written (render/html.py)."""
    if path is None:
        return
    from .artifacts import atomic_write_text
    from .render.html import render_outcome

    atomic_write_text(path, render_outcome(outcome.report, outcome.out_dir))


def served_options(backend: str, base_url: str | None, key_env: str | None, chat: bool, cache_probe: bool, command: str) -> list[str]:
    """--base-url, --api-key-env, --chat and --cache-probe are the openai backend's `--opt`s."""
    given = [f for f, v in (("--base-url", base_url), ("--api-key-env", key_env), ("--chat", chat), ("--cache-probe", cache_probe)) if v]
    if given and backend != "openai":
        raise UsageError(f"{given[0]} applies to --backend openai, not {backend!r}")
    if cache_probe and command != "check":
        raise UsageError("--cache-probe is a check: use `detllm check --cache-probe`")
    return ([f"base_url={base_url}"] if base_url else []) + ([f"api_key_env={key_env}"] if key_env else []) \
        + (["chat=true"] if chat else []) + (["cache_probe=true"] if cache_probe else [])


def concurrency_levels(vary_batch: str | None, concurrency: str | None, backend: str) -> tuple[int, ...]:
    """--concurrency is the openai backend's spelling of --vary-batch: a batch is the requests in flight."""
    from .config import parse_batch_list

    if concurrency is None:
        return parse_batch_list(vary_batch)
    if backend != "openai":
        raise UsageError(f"--concurrency applies to --backend openai (requests in flight), not {backend!r}", hint="use --vary-batch")
    if vary_batch is not None:
        raise UsageError("--concurrency and --vary-batch say the same thing: give one")
    try:
        return tuple(int(x) for x in concurrency.split(",") if x.strip())
    except ValueError as exc:
        raise UsageError(f"--concurrency expects comma-separated integers like 1,8,32, got {concurrency!r}") from exc


def llama_bin_option(path: Path | None, backend: str) -> list[str]:
    """--llama-bin is the llamacpp backend's `--opt bin=`, spelled as issue-tracker users expect."""
    if path is None:
        return []
    if backend != "llamacpp":
        raise UsageError(f"--llama-bin applies to --backend llamacpp, not {backend!r}")
    return [f"bin={path}"]


class _progress:
    """Prompts done / total and tokens/s on stderr, only when stderr is a terminal (CI logs stay
    clean); a rich bar created on first update (imports nothing until used)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.bar, self.task, self.t0 = enabled and sys.stderr.isatty(), None, None, 0.0

    def __enter__(self):
        return self.update if self.enabled else None

    def update(self, done: int, total: int, tokens: int = 0) -> None:
        import time

        if self.bar is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.bar = Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TextColumn("prompts  {task.fields[rate]}"),
                                console=_console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("generating", total=total, rate="")
            self.t0 = time.monotonic()
        elapsed = time.monotonic() - self.t0
        rate = f"{tokens / elapsed:.1f} tokens/s" if elapsed > 0 and tokens else ""
        self.bar.update(self.task, completed=done, rate=rate)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


app.command("run", help=f"Generate once per batch size and write a run folder.")(_gen_command("run", 1))
app.command("check", help=f"Repeat runs, vary batch size, compare, and give a verdict CI can act on.")(_gen_command("check", 3))


# ------------------------------------------------------------------ env / report / models

@app.command(help="Print this machine's environment fingerprint (no engine is loaded).")
def env(
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole env.json document.")] = False,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write env.json to this file instead.")] = None,
    redact_env: Annotated[bool, typer.Option("--redact-env", help="Hide every recorded variable's value and the hostname (secrets are always hidden).")] = False,
    redact_env_var: Annotated[Optional[list[str]], typer.Option("--redact-env-var", metavar="NAME", help="Hide this variable's value (repeatable).")] = None,
    validate_schema: Annotated[bool, typer.Option("--validate-schema", help="Accepted for compatibility: env.json is always validated.")] = False,
) -> None:
    def body() -> int:
        from .api import _redaction
        from .artifacts import atomic_write_text, dumps, validate
        from .env import collect_env

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
                  "issue (markdown for an engine's bug template). No engine is imported.")
def report(
    run_dir: Annotated[Optional[Path], typer.Argument(help="A detllm run or diff folder, .tar.gz pack, or report.json.")] = None,
    report_in: Annotated[Optional[Path], typer.Option("--in", help="The same as RUN_DIR (the seed's spelling).")] = None,
    fmt: Annotated[Optional[str], typer.Option("--format", "-f", help="txt, json, md, html or issue (default: from --out's suffix, else txt).")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the rendering to this file instead of stdout.")] = None,
    junit: JUnit = None,
    validate_schema: Annotated[bool, typer.Option("--validate-schema", help="Accepted for compatibility: report.json is always validated.")] = False,
) -> None:
    def body() -> int:
        from .reporting import render_path

        if (run_dir is None) == (report_in is None):
            raise UsageError("give the report to render once: RUN_DIR or --in", hint="e.g. detllm report artifacts/check-1")
        check_output_file(out, "--out")
        check_output_file(junit, "--junit")
        text = render_path(run_dir or report_in, fmt, out=out, junit=junit)
        if out is None:
            typer.echo(text, nl=False)
        return 0

    guarded(body)


@app.command(help="What works on this machine: each backend, the tier it can enforce, and the command that fixes "
                  "what is missing. Never downloads anything.")
def doctor(as_json: Annotated[bool, typer.Option("--json", help="Print the findings as JSON.")] = False) -> None:
    def body() -> int:
        from .doctor import diagnose_machine, render_doctor

        found = diagnose_machine()
        typer.echo(json.dumps(found, indent=2) if as_json else render_doctor(found), nl=not not as_json)
        return 0

    guarded(body)


@models_app.callback()
def models(ctx: typer.Context) -> None:
    if ctx.invoked_subcommand is not None:
        return

    def body() -> int:
        from .models import list_models

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
        from .errors import UsageError
        from .models import export_model

        if fmt not in ("hf", "gguf"):
            raise UsageError(f"--format must be hf or gguf, got {fmt!r}")
        typer.echo(f"exported {name} ({fmt}) to {export_model(name, dest, fmt)}")
        return 0

    guarded(body)


# ------------------------------------------------------------------ diff (docs/causes.md)

@app.command(help="Compare two run folders (or FOLDER::run_N, FOLDER::batch_B, FOLDER::run_N@batch_B selections): "
                  f"first divergent token, ranked causes with evidence, drift. No engine is imported.")
def diff(
    a: Annotated[Optional[str], typer.Argument(metavar="A", help="Left side: FOLDER, FOLDER::run_N@batch_B (default run 0 at its --batch-size) or a trace .jsonl file.")] = None,
    b: Annotated[Optional[str], typer.Argument(metavar="B", help="Right side, the same way.")] = None,
    left: Annotated[Optional[str], typer.Option("--left", help="Left side, instead of A (the seed's spelling).")] = None,
    right: Annotated[Optional[str], typer.Option("--right", help="Right side, instead of B.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write report.json, report.txt, report.md (and diffs/) here.")] = None,
    force: Annotated[bool, typer.Option(help="Write into an existing non-detllm folder.")] = False,
    tier: Annotated[Optional[int], typer.Option(help="1 tokens, 2 + logprobs and top-k, 3 + across batch sizes (default: the lower recorded tier).")] = None,
    atol: Annotated[float, typer.Option(help="Logprob tolerance at tier >= 2 (0 = bitwise).")] = 0.0,
    junit: JUnit = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="PNG of logprob drift by position (needs matplotlib).")] = None,
    html: Annotated[Optional[Path], typer.Option("--html", help="Also write a self-contained HTML report here.")] = None,
    validate_schema: Annotated[bool, typer.Option("--validate-schema", help="Accepted for compatibility: every artifact is always validated.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print report.json instead of the verdict.")] = False,
) -> None:
    def body() -> int:
        from .tracefiles import diff_any, pick_sides

        left_arg, right_arg = pick_sides(a, b, left, right)
        check_output_file(html, "--html")
        outcome = diff_any(left_arg, right_arg, out=out, force=force, atol=atol, tier=tier, junit=junit, plot=plot)
        write_html(outcome, html)
        return emit(outcome, as_json=as_json)  # the library wrote --junit

    guarded(body)


# ------------------------------------------------------------------ diagnose / sweep (docs/diagnose.md)

@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             help="From a FAIL to the knob that causes it: `detllm diagnose RUN_DIR` (a failing check or diff folder) or "
                  "`detllm diagnose CHECK-OPTIONS` (runs that check first, into OUT/baseline). Runs real probes, cheapest "
                  "first, and writes diagnosis.json/.txt/.md. Exit 0 when the diagnosis was written.")
def diagnose(
    ctx: typer.Context,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Diagnosis folder (default: a new folder under artifacts/).")] = None,
    force: Annotated[bool, typer.Option(help="Replace an earlier diagnosis in --out.")] = False,
    budget: Annotated[Optional[str], typer.Option(help="Probe count (12) or time (90s, 5m).")] = None,
    fresh_repeats: Annotated[int, typer.Option(help="Fresh processes per fresh-process probe and confirmation.")] = 3,
    probe: Annotated[Optional[list[str]], typer.Option("--probe", help="Run only these probes (repeatable): a knob (kv_type, threads, batch_invariant...) or ladder, needle, fresh_process, prefill.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print diagnosis.json instead of the text.")] = False,
) -> None:
    def body() -> int:
        from .diagnose import diagnose as run_diagnosis
        from .diagnose.render import render_text

        args = list(ctx.args)
        run_dir = args[0] if len(args) == 1 and not args[0].startswith("-") else None
        if not args:
            raise UsageError("diagnose needs a failing run folder or check's options", hint="e.g. detllm diagnose RUN_DIR")
        say = None if as_json else (lambda text: typer.echo(f"detllm: {text}", err=True))
        result = run_diagnosis(run_dir=run_dir, check_args=None if run_dir else args, out=out, force=force, budget=budget,
                               fresh_repeats=fresh_repeats, progress=say, only=probe)
        typer.echo(json.dumps(result.doc, indent=2) if as_json else render_text(result.doc) + f"diagnosis folder: {result.out_dir}")
        return 0

    guarded(body)


@app.command(help="Run a grid of settings (--axis batch_size=1,2,8 --axis dtype=float32,bfloat16 --axis threads=1,2; any other "
                  "axis name is a backend --opt) with --repeats per cell: each cell labelled stable / fragile / unstable, unique "
                  "outputs per prompt, divergence rate against the first cell with a Wilson 95% interval; sweep.json, a table "
                  "and heatmap.png. Exit 0 when the sweep was written.")
def sweep(
    axis: Annotated[list[str], typer.Option("--axis", help="name=v1,v2 (repeatable).")],
    repeats: Annotated[int, typer.Option(help="Repeats per cell (in one process).")] = 3,
    backend: Backend = "hf",
    model: Model = "tiny",
    prompts: Annotated[Optional[Path], typer.Option(help="Prompt file (.jsonl or text).")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Sweep folder (default: a new folder under artifacts/).")] = None,
    force: Annotated[bool, typer.Option(help="Replace an earlier sweep in --out.")] = False,
    tier: Annotated[int, typer.Option(help="Tier recorded for each cell's runs.")] = 2,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per prompt.")] = 16,
    dtype: Annotated[str, typer.Option(help="dtype of cells without a dtype axis.")] = "float32",
    seed: Annotated[int, typer.Option(help="Seed for every run.")] = 0,
    opt: Annotated[Optional[list[str]], typer.Option("--opt", help="Backend option key=value for every cell (repeatable).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print sweep.json instead of the table.")] = False,
) -> None:
    def body() -> int:
        from .config import Decoding, RunConfig, parse_options
        from .diagnose.sweep import sweep as run_sweep
        from .diagnose.sweep_render import render_text

        cfg = RunConfig(backend=backend, model=model, dtype=dtype, seed=seed, tier=tier,
                        decoding=Decoding(max_new_tokens=max_new_tokens), options=parse_options(opt or []))
        say = None if as_json else (lambda text: typer.echo(f"detllm: {text}", err=True))
        folder, doc = run_sweep(cfg, axis, repeats=repeats, prompts=prompts, out=out, force=force, progress=say)
        typer.echo(json.dumps(doc, indent=2) if as_json else render_text(doc) + f"sweep folder: {folder}")
        return 0

    guarded(body)


# ------------------------------------------------------------------ verify / replay / pack (docs/integrity.md)

@app.command(help="Check a run folder or .tar.gz pack offline: every file against manifest.json, the trace's hash chain, "
                  "every schema and, with --pubkey, the Ed25519 signature. No engine is imported. "
                  "Exit 0 verified, 5 not a pack or schema error, 6 integrity error (names the first changed file or trace line).")
def verify(
    pack: Annotated[Path, typer.Argument(help="A sealed run folder or .tar.gz pack.")],
    pubkey: Annotated[Optional[Path], typer.Option("--pubkey", help="Ed25519 public key (PEM or ssh-ed25519): manifest.sig must verify.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    def body() -> int:
        from .integrity import verify as verify_pack
        from .seedlayout import refuse_seed_layout

        refuse_seed_layout(pack)
        res = verify_pack(pack, pubkey=pubkey)
        typer.echo(json.dumps(res.to_json(), indent=2) if as_json else "\n".join(res.lines()))
        return 0

    guarded(body)


@app.command(help=f"Re-run a pack's recorded config and prompts on this machine, then diff against the pack. "
                  f"Refuses (exit 7) when the local weights differ from the pack's.")
def replay(
    pack: Annotated[Path, typer.Argument(help="A sealed run folder or .tar.gz pack (recorded with prompt text).")],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Folder for the replay (default: a new folder under artifacts/).")] = None,
    force: Annotated[bool, typer.Option(help="Write into an existing non-detllm folder.")] = False,
    allow_model_change: Annotated[bool, typer.Option("--allow-model-change", help="Replay even when the local weights differ from the pack's.")] = False,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Load the model from here instead of the recorded name or path (weights are still checked).")] = None,
    sign_key: SignKey = None,
    pubkey: Annotated[Optional[Path], typer.Option("--pubkey", help="Replay only a pack whose manifest.sig verifies with this Ed25519 public key.")] = None,
    base_url: Annotated[Optional[str], typer.Option("--base-url", help="openai packs: the server to replay against (never taken from the pack).")] = None,
    api_key_env: Annotated[Optional[str], typer.Option("--api-key-env", metavar="NAME", help="openai packs: the variable holding the key (never taken from the pack).")] = None,
    allow_pack_option: Annotated[Optional[list[str]], typer.Option("--allow-pack-option", metavar="NAME", help="Take this code-loading option from the pack (trust_remote_code, attn_implementation, bin); refused or dropped otherwise.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print report.json instead of the verdict.")] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bar on stderr.")] = True,
) -> None:
    def body() -> int:
        from .replay import replay as replay_pack
        from .seedlayout import refuse_seed_layout

        refuse_seed_layout(pack)
        with _progress(progress and not as_json) as bar:
            outcome = replay_pack(pack, out=out, force=force, allow_model_change=allow_model_change, model=model,
                                  sign_key=sign_key, pubkey=pubkey, progress=bar, base_url=base_url, api_key_env=api_key_env,
                                  allow_pack_options=tuple(allow_pack_option or ()))
        return emit(outcome, as_json=as_json)

    guarded(body)


@app.command("pack", help="Verify a sealed run folder and write exactly its sealed files to a reproducible .tar.gz.")
def pack_cmd(
    run_dir: Annotated[Path, typer.Argument(help="A sealed detllm run folder.")],
    dest: Annotated[Path, typer.Option("--output", "-o", help="The pack to write (.tar.gz).")],
    force: Annotated[bool, typer.Option(help="Overwrite an existing pack file.")] = False,
) -> None:
    def body() -> int:
        from .pack import create_pack

        path = create_pack(run_dir, dest, force=force)
        typer.echo(f"packed {run_dir} into {path} ({path.stat().st_size} bytes)")
        return 0

    guarded(body)


# Options whose value is a path: an empty value would silently mean the current folder.
PATH_FLAGS = ("--out", "-o", "--output", "--prompts", "--prompt-file", "--junit", "--html", "--plot", "--sign-key",
              "--pubkey", "--llama-bin", "--in")
EXIT_CLOSED_PIPE = 141  # 128 + SIGPIPE, what any program killed by a closed pipe returns


def closed_pipe() -> int:
    """The reader of stdout went away (`detllm report X | head -1`): exit silently. stdout is
    pointed at /dev/null so the interpreter's final flush cannot print an error either."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_CLOSED_PIPE


def empty_path_argument(args: list[str]) -> str | None:
    """The flag (or "an argument") given an empty value, where an empty string would silently
    mean the current folder; None when there is none."""
    for i, arg in enumerate(args):
        if arg == "":
            prev = args[i - 1] if i else ""
            if prev in PATH_FLAGS:
                return prev
            if not prev.startswith("-"):
                return "an argument"
        for flag in PATH_FLAGS:
            if flag.startswith("--") and arg == flag + "=":
                return flag
    return None


def quiet_usage_errors() -> bool:
    """CI mode (the CI variable set, or stderr not a terminal): a bad option prints the usage
    line and one error line, not typer's framed box."""
    return bool(os.environ.get("CI")) or not sys.stderr.isatty()


def _click_exceptions():
    try:
        from typer._click import exceptions  # typer vendors click from 0.2x on
    except ImportError:  # older typer: click itself
        from click import exceptions
    return exceptions


# commands that only read artifacts (no engine, no process or thread of ours left once they return):
# they leave without the interpreter's teardown, which after a large diff spends ~0.1 s freeing
# records and unmapping traces that are about to vanish anyway
_READ_ONLY = frozenset({"diff", "verify", "report"})


def entry() -> None:
    """The console script and `python -m detllm`: main(), then, after a read-only command, a quick
    exit: atexit handlers run and stdout/stderr are flushed, the teardown is skipped."""
    quick = bool(sys.argv[1:]) and sys.argv[1] in _READ_ONLY
    try:
        main()
        code: Any = 0
    except SystemExit as exc:
        if not quick:
            raise
        code = exc.code
    if not quick:
        return
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        sys.stdout.flush()
    except (OSError, ValueError):  # a closed pipe: as main() treats it
        code = closed_pipe()
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    """The console entry point: the typer app, plus what must happen before it parses
    (empty path values) and around it (CI-mode usage errors, a closed stdout)."""
    args = sys.argv[1:] if argv is None else list(argv)
    flag = empty_path_argument(args)
    if flag is not None:
        typer.echo(f"detllm: error: {flag} is empty; give a path (use . for the current folder)", err=True)
        sys.exit(2)
    exc = _click_exceptions()
    try:
        if not quiet_usage_errors():
            app(args=args, prog_name="detllm")
            return
        try:
            code = app(args=args, prog_name="detllm", standalone_mode=False)
        except exc.UsageError as err:
            usage = err.ctx.get_usage().splitlines()[0] if err.ctx is not None else "Usage: detllm [OPTIONS] COMMAND [ARGS]..."
            typer.echo(f"{usage}\ndetllm: error: {err.format_message()}", err=True)
            sys.exit(err.exit_code)
        except typer.Abort:
            typer.echo("detllm: interrupted", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)
    except BrokenPipeError:
        sys.exit(closed_pipe())
