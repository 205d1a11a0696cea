"""Overhead of `detllm check` (hf backend) against the bare work it wraps, and per-token decode time.

Measured side by side in one process, in this order (model built/cached and torch warmed first):
  bare:   load the model + the same generations through plain transformers `model.generate`
          (greedy, eos stops a row as in detllm): --runs runs at the first batch size, one run at
          each other batch size of --vary-batch, prompts in batches topped up with the same fillers
  detllm: detllm.check(runs, vary_batch, tier 2) — load, runs, trace (logprobs + top-5), seal,
          compare, report
  decode: ms per decoding step of the hf backend's loop vs model.generate on the same batch
          (forced to --max-new-tokens steps), at batch 1 and at each --vary-batch size
Prints each wall time and the ratios. The per-process model cache is cleared before each load.

    .venv/bin/python benchmarks/bench_check.py [--model smollm2-135m] [--runs 5] [--vary-batch 1,8]
        [--max-new-tokens 32] [--repeat 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def _batches(n: int, b: int) -> list[list[int]]:
    from detllm.runner import plan_batches

    return plan_batches(n, b)


def bare(path: str, prompts: list[str], fillers: list[str], runs: int, sizes: list[int], tokens: int) -> float:
    """Seconds for load + the generations `check` performs, through plain transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    schedule = [(b, r) for b in sizes for r in range(runs if b == sizes[0] else 1)]
    with torch.inference_mode():
        for b, _ in schedule:
            for batch in _batches(len(prompts), b):
                texts = [prompts[i] if i >= 0 else fillers[-i - 1] for i in batch]
                enc = tok(texts, return_tensors="pt", padding=True)
                model.generate(**enc, max_new_tokens=tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    return time.perf_counter() - t0


def decode_ms(backend, model, tok, texts: list[str], tokens: int) -> tuple[float, float]:
    """(our loop, model.generate): ms per decoding step on one batch, both forced to `tokens` steps
    (our loop with logprobs + top-5 recorded, as tier 2 does)."""
    import torch

    from detllm.backends.base import Request
    from detllm.config import Decoding

    reqs = [Request(prompt_index=i, input_ids=tuple(tok(t)["input_ids"])) for i, t in enumerate(texts)]
    eos = backend._eos
    backend._eos = lambda: set()  # no row stops early: every step is a full batch step
    try:
        t0 = time.perf_counter()
        backend.generate(reqs, Decoding(max_new_tokens=tokens), seed=0, n_logprobs=5, logprobs=True)
        ours = time.perf_counter() - t0
    finally:
        backend._eos = eos
    enc = tok(texts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        theirs = time.perf_counter() - t0
    return ours / tokens * 1e3, theirs / tokens * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--vary-batch", default="1,8", help="batch sizes, the first is the base (as check's --batch-size)")
    ap.add_argument("--repeat", type=int, default=2, help="bare/detllm pairs, alternated")
    ap.add_argument("--decode-tokens", type=int, default=64)
    args = ap.parse_args()
    sizes = [int(s) for s in args.vary_batch.split(",")]

    import torch
    from transformers import AutoModelForCausalLM

    import detllm
    from detllm.backends import hf
    from detllm.models import resolve_model
    from detllm.prompts import BUILTIN_PROMPTS, FILLERS

    path = str(resolve_model(args.model).path)  # build/cache the model outside every timing
    warm = AutoModelForCausalLM.from_pretrained(path)  # warm torch's kernels and thread pool, and the page cache
    with torch.inference_mode():
        warm(torch.tensor([[1, 2, 3]]))
    del warm
    print(f"model {args.model}, {len(BUILTIN_PROMPTS)} prompts x {args.max_new_tokens} tokens, runs {args.runs} at batch "
          f"{sizes[0]}" + (f" + 1 run at batch {', '.join(map(str, sizes[1:]))}" if sizes[1:] else "")
          + f", torch threads {torch.get_num_threads()}")
    ratios, cpu_ratios = [], []
    for rep in range(args.repeat):
        c0 = time.process_time()  # CPU of every thread of this process: steadier than wall on a shared machine
        t_bare = bare(path, list(BUILTIN_PROMPTS), list(FILLERS), args.runs, sizes, args.max_new_tokens)
        c_bare = time.process_time() - c0
        hf._LOADED.clear()
        with tempfile.TemporaryDirectory() as tmp:
            c0 = time.process_time()
            t0 = time.perf_counter()
            out = detllm.check(backend="hf", model=args.model, runs=args.runs, batch_size=sizes[0],
                               vary_batch=tuple(sizes) if len(sizes) > 1 else (), max_new_tokens=args.max_new_tokens,
                               tier=2, out=Path(tmp) / "check")
            t_ours = time.perf_counter() - t0
            c_ours = time.process_time() - c0
        hf._LOADED.clear()
        ratios.append(t_ours / t_bare)
        cpu_ratios.append(c_ours / c_bare)
        print(f"[{rep + 1}] bare load + generate: {t_bare:.2f} s ({c_bare:.2f} s CPU) | detllm check (tier 2) {t_ours:.2f} s "
              f"({c_ours:.2f} s CPU) [{out.status}] | ratio {t_ours / t_bare:.2f} wall, {c_ours / c_bare:.2f} CPU")
    print(f"check overhead ratio detllm / bare: wall best {min(ratios):.2f}, worst {max(ratios):.2f}; "
          f"CPU best {min(cpu_ratios):.2f}, worst {max(cpu_ratios):.2f}")

    from detllm.backends.hf import HFBackend

    backend = HFBackend(args.model)
    model, tok = backend.model, backend.tokenizer
    texts = list(BUILTIN_PROMPTS) + list(FILLERS)
    for b in sorted({1, *sizes}):
        batch = (texts * ((b // len(texts)) + 1))[:b]
        ours, theirs = decode_ms(backend, model, tok, batch, args.decode_tokens)
        print(f"decode at batch {b}: our hf loop {ours:.1f} ms/step, model.generate {theirs:.1f} ms/step, "
              f"ratio {ours / theirs:.2f} ({args.decode_tokens} steps)")


if __name__ == "__main__":
    main()
