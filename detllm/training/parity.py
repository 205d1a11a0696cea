"""Trainer <-> engine logprob parity (`detllm parity`): the same token sequences scored
teacher-forced by the training model (plain transformers forward in torch, its training dtype,
`model.eval()`, as RL trainers compute old logprobs) and by an inference backend reached through
the Backend interface: its rollout (decode) logprobs and its `score()` (prefill) logprobs.
Owns the comparison, parity.json and its text; never imports an engine module.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from ..runfolder import artifacts
from ..backends.base import Request
from ..backends.registry import create_backend
from ..core.config import Decoding, RunConfig
from ..runfolder.env import detllm_version
from ..runfolder.integrity import seal
from ..core.errors import UsageError
from .pack import TrainingOutcome
from .paritystats import compare_path, verdict_of

PARITY = "parity.json"
TRAIN_DTYPES = ("float32", "bfloat16", "float16")
PATHS = ("decode", "prefill")  # decode: the rollout's own logprobs; prefill: backend.score() teacher-forced


ParityOutcome = TrainingOutcome  # parity.json, its folder and parity.txt; exit 0 on PASS


def trainer_logprobs(model_path: Path, dtype: str, sequences: Sequence[tuple[list[int], list[int]]], *,
                     threads: int | None = None, attn_implementation: str = "sdpa") -> list[list[float]]:
    """log p(target[i] | prompt + target[:i]) from the training model: transformers' forward in
    `dtype`, model.eval() (dropout off), one sequence at a time, logits upcast to float32 before
    log_softmax (as TRL/verl compute old logprobs)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr keeps detllm's own lines

    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=getattr(torch, dtype),
                                                     attn_implementation=attn_implementation)
        model.eval()
        out = []
        with torch.no_grad():
            for prompt, target in sequences:
                seq = torch.tensor([list(prompt) + list(target)], dtype=torch.long)
                logits = model(input_ids=seq, attention_mask=torch.ones_like(seq)).logits[0].float()
                start = len(prompt) - 1  # logits at position p predict token p + 1
                logp = torch.log_softmax(logits[start:start + len(target)], dim=-1)
                out.append(logp.gather(1, torch.tensor(list(target))[:, None])[:, 0].tolist())
        return out
    finally:
        torch.set_num_threads(saved)


def trained_model(base: Path, checkpoint: Path, dest: Path, *, gguf: bool) -> tuple[Path, Path]:
    """A train-check checkpoint's weights as a model folder: `base`'s config and tokenizer with the
    checkpoint's parameters (loaded through checkpoint.load_checkpoint: every file checked by digest
    first). Returns (HF folder, the folder an engine loads: the HF one, or one holding model.gguf)."""
    from safetensors.torch import save_file

    from ..models.gguf import build_tiny_gguf
    from .checkpoint import load_checkpoint

    ckpt = load_checkpoint(checkpoint)
    hf = dest / "hf"
    hf.mkdir(parents=True)
    for item in base.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name != ".complete":
            shutil.copyfile(item, hf / item.name)
    save_file({n: t.contiguous() for n, t in ckpt.params.items()}, str(hf / "model.safetensors"), metadata={"format": "pt"})
    if not gguf:
        return hf, hf
    build_tiny_gguf(hf, dest / "gguf")
    return hf, dest / "gguf"


def _check(dtype: str, engine_dtype: str, max_new_tokens: int, atol: float, out: Path | None, force: bool) -> None:
    if dtype not in TRAIN_DTYPES:
        raise UsageError(f"--dtype (the training dtype) must be one of {', '.join(TRAIN_DTYPES)}, got {dtype!r}")
    if engine_dtype not in TRAIN_DTYPES:
        raise UsageError(f"--engine-dtype must be one of {', '.join(TRAIN_DTYPES)}, got {engine_dtype!r}")
    if not isinstance(atol, (int, float)) or not math.isfinite(atol) or not 0 <= atol <= 1000:
        raise UsageError(f"--atol must be a finite number in [0, 1000], got {atol!r}")
    if out is not None and out.exists() and (not out.is_dir() or (any(out.iterdir()) and not ((out / PARITY).is_file() and force))):
        raise UsageError(f"--out {str(out)!r} is not an empty folder", hint="choose another --out (or --force over an earlier parity)")


def parity(*, backend: str = "hf", model: str = "tiny", prompts: str | Path | None = None, max_new_tokens: int = 16,
           dtype: str = "float32", engine_dtype: str | None = None, threads: int | None = None, seed: int = 0,
           options: tuple[tuple[str, str], ...] = (), attn_implementation: str = "sdpa", checkpoint: str | Path | None = None,
           atol: float = 0.0, out: str | Path | None = None, force: bool = False,
           progress: Callable[[str], None] | None = None) -> ParityOutcome:
    """Roll each prompt out greedily on `backend`, then score prompt + rollout with the trainer
    and compare, token by token, with the engine's decode and prefill logprobs. Writes parity.json
    and parity.txt under `out` (a new folder under artifacts/ when None)."""
    from ..models import resolve_model
    from ..core.prompts import load_prompts

    engine_dtype = engine_dtype or dtype
    out = Path(out) if out is not None else None
    _check(dtype, engine_dtype, max_new_tokens, atol, out, force)
    if attn_implementation not in ("sdpa", "eager"):
        raise UsageError(f"--attn-implementation must be sdpa or eager, got {attn_implementation!r}")
    if checkpoint is not None and not (Path(checkpoint) / "checkpoint.json").is_file():
        raise UsageError(f"--checkpoint {str(checkpoint)!r} is not a train-check checkpoint folder (no checkpoint.json)")
    cfg = RunConfig(backend=backend, model=model, dtype=engine_dtype, seed=seed, tier=2, threads=threads, options=options,
                    decoding=Decoding(max_new_tokens=max_new_tokens))
    cfg.validate()
    texts = load_prompts(prompts).texts
    resolved = resolve_model(model, "hf")
    if resolved.path is None:
        raise UsageError(f"parity needs the model's files on this machine for the trainer side; {model!r} is not a local "
                         "folder or built-in model", hint="pass a built-in model or a local HF folder")
    tmp = Path(tempfile.mkdtemp(prefix="detllm-parity-"))
    try:
        trainer_path, engine_model = resolved.path, model
        if checkpoint is not None:  # the trained weights, on both sides
            trainer_path, engine_path = trained_model(resolved.path, Path(checkpoint), tmp, gguf=backend == "llamacpp")
            engine_model = str(engine_path)
        return _parity(dataclasses.replace(cfg, model=engine_model), texts, trainer_path, model=model, checkpoint=checkpoint, dtype=dtype, attn_implementation=attn_implementation,
                       atol=atol, out=out, say=progress or (lambda _text: None))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _attention(applied: Any) -> dict[str, Any]:
    """What the engine's attention computed in, where it says (llama.cpp: -fa and the KV cache type):
    `dtype` is the weights', and CPU flash attention and an f16 KV cache compute in F16 (review E3)."""
    ran = {a.name: a.value for a in applied or () if a.name in ("flash_attn", "kv_type")}
    if not ran:
        return {}
    f16 = [w for w, on in (("flash attention", ran.get("flash_attn") != "off"), ("an f16 KV cache", ran.get("kv_type") == "f16")) if on]
    return {"attention": {**ran, "note": (f"attention in F16 ({' and '.join(f16)}: llama.cpp computes them in F16 whatever the "
                                          "weights' dtype); --opt kv_type=f32 --opt flash_attn=off for float32 attention")
                          if f16 else "float32 attention (f32 KV cache, flash attention off)"}}


def _parity(cfg: RunConfig, texts: Sequence[str], trainer_path: Path, *, model: str, checkpoint: str | Path | None, dtype: str,
            attn_implementation: str, atol: float, out: Path | None, say: Callable[[str], None]) -> ParityOutcome:
    from .parity_render import render_text

    backend, seed, threads, max_new_tokens, engine_dtype = cfg.backend, cfg.seed, cfg.threads, cfg.decoding.max_new_tokens, cfg.dtype
    t0 = time.monotonic()
    say(f"rolling out {len(texts)} prompts on {backend}")
    with create_backend(cfg) as engine:
        caps = engine.capabilities()
        method = getattr(engine, "score_method", "") if engine.can_score else ""
        seqs, decode, prefill = [], [], []
        excluded: dict[int, str] = {}  # sequence -> why it is not compared
        with engine.determinism(tier=min(2, caps.max_tier), seed=seed, threads=threads) as applied:
            for i, text in enumerate(texts):
                ids = list(engine.tokenize(text))
                if not ids:  # the engine tokenizes the text itself and says not how: no ids to teacher-force
                    raise UsageError(f"backend {backend!r} does not report the token ids it feeds for a prompt, so the trainer "
                                     "cannot score the same sequence", hint="for openai, pass --opt prompt_as=ids")
                gen = engine.generate([Request(i, tuple(ids), text)], cfg.decoding, seed=seed, n_logprobs=1,
                                      logprobs=caps.logprobs)[0]
                told = (gen.evidence or {}).get("completion_tokens")
                if isinstance(told, int) and told > len(gen.token_ids):  # a served endpoint left steps out of its reply
                    excluded[i] = (f"the engine generated {told} tokens and reported {len(gen.token_ids)}: the rollout's token "
                                   "ids are not known, so no one scores the same sequence")
                seqs.append((ids, list(gen.token_ids)))
                decode.append(list(gen.logprobs) if caps.logprobs and gen.logprobs is not None and i not in excluded else None)
                prefill.append(engine.score(ids, list(gen.token_ids)) if engine.can_score and gen.token_ids and i not in excluded
                               else None)
        engine_info = {"backend": backend, "dtype": engine_dtype, "score_method": method, "env": engine.env_info(),
                       **_attention(applied)}
    say("scoring the rollouts with the training model")
    trainer = trainer_logprobs(trainer_path, dtype, seqs, threads=threads, attn_implementation=attn_implementation)
    paths = {}
    for name, got in (("decode", decode), ("prefill", prefill)):
        if all(g is None for g in got):
            why = "the backend returns no logprobs" if name == "decode" else f"backend {backend!r} cannot score a given sequence"
            paths[name] = {"available": False, "reason": why}
        else:
            paths[name] = compare_path(trainer, got, atol=atol)
    verdict = verdict_of(paths)
    import torch

    doc = artifacts.stamp("parity", {
        "detllm_version": detllm_version(), "created_at": artifacts.utc_now(), "model": model, "atol": atol, "seed": seed,
        "checkpoint": None if checkpoint is None else str(checkpoint),
        "trainer": {"dtype": dtype, "mode": "eval", "attn_implementation": attn_implementation, "framework": f"transformers forward, torch {torch.__version__}",
                    "threads": threads if threads is not None else torch.get_num_threads(),
                    "log_softmax": "float32 (logits upcast)", "batch": 1},
        "engine": engine_info, "max_new_tokens": max_new_tokens, "verdict": verdict, "paths": paths,
        "sequences": [{"index": i, "prompt_ids": p, "token_ids": t, "trainer": tr, "decode": d, "prefill": f, "excluded": excluded.get(i)}
                      for i, ((p, t), tr, d, f) in enumerate(zip(seqs, trainer, decode, prefill))],
        "seconds": round(time.monotonic() - t0, 2),
    })
    folder = out if out is not None else artifacts.default_out_dir("parity")
    if folder.is_dir():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    artifacts.write_json(folder, PARITY, doc)
    text = render_text(doc)
    artifacts.atomic_write_text(folder / "parity.txt", text)
    seal(folder)  # verify and pack take it like any folder detllm writes; verify re-derives the figures (results.py)
    return ParityOutcome(doc, folder, text)
