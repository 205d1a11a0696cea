"""`detllm training` commands: parse -> call the library (training/) -> render -> exit code."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .shell import Backend, Model, app, guarded


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
    atol: Annotated[float, typer.Option(help="Logprob tolerance (0 = bitwise).")] = 0.0,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Parity folder (default: a new folder under artifacts/).")] = None,
    force: Annotated[bool, typer.Option(help="Replace an earlier parity in --out.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print parity.json instead of the text.")] = False,
) -> None:
    def body() -> int:
        from ..config import parse_options
        from ..schema_io import dumps
        from ..training.parity import parity as run_parity

        outcome = run_parity(backend=backend, model=model, prompts=prompts, max_new_tokens=max_new_tokens, dtype=dtype,
                             engine_dtype=engine_dtype, attn_implementation=attn_implementation, threads=threads, seed=seed,
                             options=parse_options(opt or []), atol=atol, out=out, force=force)
        typer.echo(dumps(outcome.doc) if as_json else outcome.text + f"parity folder: {outcome.out_dir}")
        return outcome.exit_code

    guarded(body)
