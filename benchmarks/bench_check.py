"""Overhead of `detllm check --runs 5` against the bare work it wraps.

Measured side by side in one process, in this order:
  bare:   load the tiny model + 5 x model.generate (greedy, same prompts, same tokens)
  detllm: detllm.check(runs=5) — load (cached per process), 5 runs, trace, compare, report
The model is loaded fresh for both (the per-process cache is cleared in between).
Prints the two wall times and their ratio.

    .venv/bin/python benchmarks/bench_check.py [--max-new-tokens 32] [--model tiny]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import detllm
    from detllm.backends import hf
    from detllm.models import resolve_model
    from detllm.prompts import BUILTIN_PROMPTS

    path = resolve_model(args.model).path  # build/cache the model outside both timings
    # warm up torch's kernels and thread pool outside both timings
    warm = AutoModelForCausalLM.from_pretrained(path)
    with torch.inference_mode():
        warm(torch.tensor([[1, 2, 3]]))
    del warm

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        for _ in range(args.runs):
            for text in BUILTIN_PROMPTS:  # batch size 1, like the check below
                enc = tok(text, return_tensors="pt")
                model.generate(**enc, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
                               do_sample=False, pad_token_id=tok.eos_token_id)
    bare = time.perf_counter() - t0
    del model

    hf._LOADED.clear()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        out = detllm.check(backend="hf", model=args.model, runs=args.runs, max_new_tokens=args.max_new_tokens,
                           tier=2, out=Path(tmp) / "check")
        wrapped = time.perf_counter() - t0
    print(f"model {args.model}, {len(BUILTIN_PROMPTS)} prompts x {args.max_new_tokens} tokens x {args.runs} runs, "
          f"torch threads {torch.get_num_threads()}")
    print(f"bare load + {args.runs} x generate: {bare:.2f} s")
    print(f"detllm check --runs {args.runs} (tier 2, logprobs + top-5): {wrapped:.2f} s  [{out.status}]")
    print(f"ratio detllm / bare: {wrapped / bare:.2f}")


if __name__ == "__main__":
    main()
