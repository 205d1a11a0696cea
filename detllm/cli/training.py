"""`detllm training` commands: parse -> call the library (training/) -> render -> exit code."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..core.errors import UsageError
from .shell import Backend, Model, SignKey, app, guarded

JUnit = Annotated[Optional[Path], typer.Option("--junit", help="Also write JUnit XML here for CI: train-check one testcase per repeat "
                                                "against run 0, parity one per path (decode, prefill) against the trainer.")]


@app.command("train-check", help="Run K training steps (the built-in task: --model with attention dropout 0.1 on a small shipped "
                                   "text, AdamW) as run 0, --repeats in this process and --fresh-process in new processes, and compare "
                                   "them bit for bit at every step: gradients (after backward, before optimizer.step()), parameters, "
                                   "loss, RNG state, batch. Writes a sealed training pack (docs/training.md) and its checkpoints beside "
                                   "it. Exit 0 PASS, 1 FAIL (the first divergent step and parameter named).")
def train_check(
    model: Model = "tiny",
    steps: Annotated[int, typer.Option("--steps", help="Training steps K.")] = 8,
    seed: Annotated[int, typer.Option(help="The seed of every RNG (Python, NumPy, torch, data order).")] = 0,
    threads: Annotated[Optional[int], typer.Option(help="torch intra-op threads in every run (default: torch's).")] = None,
    repeats: Annotated[int, typer.Option(help="Repeats in this process, after run 0.")] = 1,
    fresh_process: Annotated[int, typer.Option("--fresh-process", help="Repeats each in a new process.")] = 1,
    batch_size: Annotated[int, typer.Option(help="Sequences per step.")] = 4,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 32,
    grad_accumulation: Annotated[int, typer.Option(help="Micro-batches per step (divides --batch-size).")] = 1,
    dtype: Annotated[str, typer.Option(help="Training dtype: float32, bfloat16, float16, float64.")] = "float32",
    checkpoint_every: Annotated[Optional[int], typer.Option(help="Checkpoint every N steps (and at the last); 0: only before the first "
                                                            "and after the last. Default: the smallest N whose checkpoints stay under "
                                                            "max(2 checkpoints, 2 GB) (every step for tiny); the size is printed first.")] = None,
    checkpoints: Annotated[Optional[Path], typer.Option(help="Checkpoint folder (default: OUT.checkpoints beside the pack).")] = None,
    test_option: Annotated[Optional[list[str]], typer.Option("--test-option", help="TEST ONLY, recorded in the pack: change run 1 on purpose, "
                                                             "repeat_seed=SEED or grad_add=STEP:PARAMETER:VALUE.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Training pack folder (default: a new folder under artifacts/).")] = None,
    force: Annotated[bool, typer.Option(help="Write into an existing non-detllm folder.")] = False,
    sign_key: SignKey = None,
    script: Annotated[Optional[str], typer.Option("--script", metavar="PATH.py[:make]", help="Train your own setup instead of the built-in task: "
                                                  "a function returning model, optimizer, batches, loss_fn[, scheduler[, scaler]] "
                                                  "(docs/training.md); --model, --batch-size and --seq-len then do not apply.")] = None,
    axis: Annotated[Optional[list[str]], typer.Option("--axis", help="name=v1,v2 as sweep's (repeatable): threads, grad_accumulation, "
                                                      "dtype. Runs the base (first values) twice and each other value with only that "
                                                      "axis changed; says which change the bits, at which step and parameter; axes.json.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print train_report.json instead of the verdict.")] = False,
    junit: JUnit = None,
) -> None:
    def body() -> int:
        from ..runfolder.artifacts import check_output_file
        from ..runfolder.schema_io import dumps
        from ..training.check import parse_test_options
        from ..training.check import train_check as run_train_check

        if axis:
            from ..training.axes import axes_from_args

            if script is not None or test_option or junit is not None:
                raise UsageError("--axis runs the built-in task without test options or JUnit; leave out --script, --test-option and --junit")
            return emit_training(axes_from_args(model=model, steps=steps, seed=seed, batch_size=batch_size, seq_len=seq_len,
                                                dtype=dtype, threads=threads, grad_accumulation=grad_accumulation, specs=axis,
                                                out=out, force=force), as_json)

        check_output_file(junit, "--junit")
        outcome = run_train_check(model=model, steps=steps, seed=seed, out=out, threads=threads, repeats=repeats,
                                  fresh_process=fresh_process, batch_size=batch_size, seq_len=seq_len,
                                  grad_accumulation=grad_accumulation, dtype=dtype, checkpoint_every="auto" if checkpoint_every is None else checkpoint_every or None,
                                  checkpoints=checkpoints, test_options=parse_test_options(test_option), force=force, sign_key=sign_key,
                                  script=script, say=lambda line: typer.echo(line, err=True))
        if junit is not None:
            from ..training.junit import train_report_junit, write

            write(train_report_junit(outcome.report), junit)
        typer.echo(dumps({"out_dir": str(outcome.out_dir), **outcome.report}) if as_json else outcome.text().rstrip("\n"))
        return outcome.exit_code

    guarded(body)


@app.command("train-run", help="Record one training run alone (as `run` is to `check`): train-check's run 0 with no repeat, "
                                 "written as a sealed training pack (verdict RECORDED) with its checkpoints beside it, to compare with "
                                 "another node's by `detllm diff A B`. Exit 0 when recorded.")
def train_run(
    model: Model = "tiny",
    steps: Annotated[int, typer.Option("--steps", help="Training steps K.")] = 8,
    seed: Annotated[int, typer.Option(help="The seed of every RNG (Python, NumPy, torch, data order).")] = 0,
    threads: Annotated[Optional[int], typer.Option(help="torch intra-op threads (default: torch's).")] = None,
    batch_size: Annotated[int, typer.Option(help="Sequences per step.")] = 4,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 32,
    grad_accumulation: Annotated[int, typer.Option(help="Micro-batches per step (divides --batch-size).")] = 1,
    dtype: Annotated[str, typer.Option(help="Training dtype: float32, bfloat16, float16, float64.")] = "float32",
    checkpoint_every: Annotated[Optional[int], typer.Option(help="As train-check's (default: by size, printed first).")] = None,
    checkpoints: Annotated[Optional[Path], typer.Option(help="Checkpoint folder (default: OUT.checkpoints beside the pack).")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Training pack folder (default: a new folder under artifacts/).")] = None,
    force: Annotated[bool, typer.Option(help="Write into an existing non-detllm folder.")] = False,
    sign_key: SignKey = None,
    script: Annotated[Optional[str], typer.Option("--script", metavar="PATH.py[:make]", help="Train your own setup, as train-check's.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print train_report.json instead of the verdict.")] = False,
) -> None:
    def body() -> int:
        from ..runfolder.schema_io import dumps
        from ..training.check import train_run as run_one

        outcome = run_one(model=model, steps=steps, seed=seed, out=out, threads=threads, batch_size=batch_size, seq_len=seq_len,
                          grad_accumulation=grad_accumulation, dtype=dtype,
                          checkpoint_every="auto" if checkpoint_every is None else checkpoint_every or None,
                          checkpoints=checkpoints, force=force, sign_key=sign_key, script=script,
                          say=lambda line: typer.echo(line, err=True))
        typer.echo(dumps({"out_dir": str(outcome.out_dir), **outcome.report}) if as_json else outcome.text().rstrip("\n"))
        return outcome.exit_code

    guarded(body)


@app.command(help="Trainer <-> engine logprob parity: roll prompts out on --backend, then score the same tokens teacher-forced "
                  "with the training model (transformers forward, --dtype, model.eval()) and compare per token with the engine's "
                  "rollout (decode) and score() (prefill) logprobs: first differing position, max |Δ|, bitwise equality. "
                  "Writes parity.json and parity.txt. Exit 0 when every compared path agrees within --atol (0: bitwise), 1 otherwise.")
def parity(
    backend: Backend = "hf",
    model: Model = "tiny",
    prompts: Annotated[Optional[Path], typer.Option(help="Prompt file (.jsonl or text); default: the built-in prompts.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Rollout tokens per prompt.")] = 16,
    dtype: Annotated[str, typer.Option(help="The training dtype of the trainer side: float32, bfloat16, float16.")] = "float32",
    engine_dtype: Annotated[Optional[str], typer.Option(help="The engine's dtype (default: --dtype).")] = None,
    attn_implementation: Annotated[str, typer.Option(help="The trainer's attention: sdpa (transformers' default) or eager.")] = "sdpa",
    threads: Annotated[Optional[int], typer.Option(help="Intra-op threads for both sides (default: unchanged).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the rollout.")] = 0,
    opt: Annotated[Optional[list[str]], typer.Option("--opt", help="Backend option key=value (repeatable).")] = None,
    base_url: Annotated[Optional[str], typer.Option("--base-url", metavar="URL", help="openai: the server's OpenAI-compatible root, "
                                                    "e.g. http://127.0.0.1:8080/v1 (as check's).")] = None,
    atol: Annotated[float, typer.Option(help="Logprob tolerance (0 = bitwise).")] = 0.0,
    checkpoint: Annotated[Optional[Path], typer.Option("--checkpoint", help="A train-check checkpoint folder (boundary_<b>): score its "
                                                       "trained weights on both sides (checked by digest; a GGUF is built for llamacpp).")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Parity folder (default: a new folder under artifacts/).")] = None,
    force: Annotated[bool, typer.Option(help="Replace an earlier parity in --out.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print parity.json instead of the text.")] = False,
    junit: JUnit = None,
) -> None:
    def body() -> int:
        from ..core.config import parse_options
        from ..runfolder.artifacts import check_output_file
        from ..runfolder.schema_io import dumps
        from ..training.parity import parity as run_parity
        from .run import served_options

        check_output_file(junit, "--junit")
        options = parse_options([*served_options(backend, base_url, None, False, False, "parity"), *(opt or [])])
        outcome = run_parity(backend=backend, model=model, prompts=prompts, max_new_tokens=max_new_tokens, dtype=dtype,
                             engine_dtype=engine_dtype, attn_implementation=attn_implementation, threads=threads, seed=seed,
                             options=options, atol=atol, out=out, force=force, checkpoint=checkpoint)
        if junit is not None:
            from ..training.junit import parity_junit, write

            write(parity_junit(outcome.doc), junit)
        typer.echo(dumps(outcome.doc) if as_json else outcome.text + f"parity folder: {outcome.out_dir}")
        return outcome.exit_code

    guarded(body)


def emit_training(outcome, as_json: bool) -> int:
    """Print a training command's outcome (replay or diff of training packs): its document with
    --json, else its text and folder; return its exit code."""
    from ..runfolder.schema_io import dumps

    folder = f"folder: {outcome.out_dir}" if outcome.out_dir is not None else ""
    typer.echo(dumps(outcome.doc) if as_json else outcome.text + folder)
    return outcome.exit_code
