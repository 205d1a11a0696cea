"""Overhead of `detllm check` (hf backend) against the bare work it wraps, and per-token decode time.

Measured side by side in one process, in this order (model built/cached and torch warmed first):
  bare:   load the model + the same generations through plain transformers `model.generate`
          (greedy, eos stops a row as in detllm): --runs runs at the first batch size, one run at
          each other batch size of --vary-batch, prompts in batches topped up with the same fillers
  detllm: detllm.check(runs, vary_batch, tier 2) — load, runs, trace (logprobs + top-5), seal,
          compare, report
  decode: ms per decoding step of the hf backend's loop vs model.generate on the same batch
          (forced to --max-new-tokens steps), at batch 1 and at each --vary-batch size
Prints wall and CPU times and the ratios (_overhead.py). The per-process model cache is cleared before each load.

    .venv/bin/python benchmarks/bench_check.py [--model smollm2-135m] [--runs 5] [--vary-batch 1,8]
        [--max-new-tokens 32] [--repeat 2] [--threads N]
"""

from __future__ import annotations

import time

from _overhead import alternate, arguments, check_fields


def _batches(n: int, b: int) -> list[list[int]]:
    from detllm.pipeline.runner import plan_batches

    return plan_batches(n, b)


def bare(path: str, prompts: list[str], fillers: list[str], runs: int, sizes: list[int], tokens: int) -> None:
    """Load + the generations `check` performs, through plain transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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


def decode_ms(backend, model, tok, texts: list[str], tokens: int) -> tuple[float, float]:
    """(our loop, model.generate): ms per decoding step on one batch, both forced to `tokens` steps
    (our loop with logprobs + top-5 recorded, as tier 2 does)."""
    import torch

    from detllm.backends.base import Request
    from detllm.core.config import Decoding

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
    args = arguments(__doc__, decode_tokens=64)
    sizes = args.sizes

    import torch
    from transformers import AutoModelForCausalLM

    from detllm.backends.hf import backend as hf
    from detllm.models import resolve_model
    from detllm.core.prompts import BUILTIN_PROMPTS, FILLERS

    if args.threads:
        torch.set_num_threads(args.threads)  # for the bare side; detllm sets the same for its runs
    path = str(resolve_model(args.model).path)  # build/cache the model outside every timing
    warm = AutoModelForCausalLM.from_pretrained(path)  # warm torch's kernels and thread pool, and the page cache
    with torch.inference_mode():
        warm(torch.tensor([[1, 2, 3]]))
    del warm
    print(f"torch threads {torch.get_num_threads()}")
    alternate("hf check", lambda: bare(path, list(BUILTIN_PROMPTS), list(FILLERS), args.runs, sizes, args.max_new_tokens),
              check_fields("hf", args), args.repeat, bare_name="bare load + generate", after=hf._LOADED.clear)

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
