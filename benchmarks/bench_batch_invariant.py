"""Cost of `hf --opt batch_invariant=true` against plain hf, side by side in one process.

For each batch size: prefill + greedy decode of TOKENS tokens on smollm2-135m through the hf
backend's own loop, three ways, interleaved and repeated (best of REPEAT): plain hf, the
batch-invariant mode, and sequential batch-1 plain generation (the trivial batch-invariant way,
which the mode must beat at batch >= 4). Then an op-level breakdown (torch.profiler, self CPU
time by ATen op) of one plain and one invariant run at --profile-batch. Goal: <= 1.3x at batch 8.
First, the probe's own cost (invariant.coverage, paid once per model, device, attention and thread
count): the blocked linear at every row offset of both blocks, and the rest, by process CPU time.

    .venv/bin/python benchmarks/bench_batch_invariant.py [--model smollm2-135m] [--tokens 64]
        [--batches 1,8,16] [--repeat 2] [--threads 1] [--clock wall|cpu] [--profile-batch 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

from detllm.backends.hf import invariant as hf_invariant
from detllm.backends.base import Request
from detllm.backends.hf import HFBackend, HFOptions
from detllm.core.config import Decoding
from detllm.core.prompts import BUILTIN_PROMPTS, FILLERS

TEXTS = (*BUILTIN_PROMPTS, *FILLERS, "In the harbour town the lamps were lit one by one as the boats came home " * 2)


def _requests(backend: HFBackend, n: int) -> list[Request]:
    return [Request(i, tuple(backend.tokenize(TEXTS[i % len(TEXTS)])), TEXTS[i % len(TEXTS)]) for i in range(n)]


def _timed(fn, clock) -> tuple[float, int]:
    t0 = clock()
    gens = fn()
    return clock() - t0, sum(len(g.token_ids) for g in gens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable figures on a shared machine)")
    ap.add_argument("--profile-batch", type=int, default=8, help="0: no op-level breakdown")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this process's CPU time (with --threads 1, stable on a machine others load too)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    backend = HFBackend(args.model, options=HFOptions(batch_invariant=True))
    probe = _probe_cost(torch, backend)
    ops = backend._invariant_ops()
    assert not hf_invariant.uncovered(ops), hf_invariant.uncovered(ops)
    decoding = Decoding(max_new_tokens=args.tokens)

    def gen(reqs):
        return backend.generate(reqs, decoding, seed=0, n_logprobs=5, logprobs=True)

    def mode():
        return hf_invariant.installed(backend.model, backend.options.attn_implementation)

    ways = {
        "plain": lambda reqs: (contextlib.nullcontext(), lambda: gen(reqs)),
        "invariant": lambda reqs: (mode(), lambda: gen(reqs)),
        "sequential": lambda reqs: (contextlib.nullcontext(), lambda: [g for r in reqs for g in gen([r])]),
    }
    gen(_requests(backend, 2))  # warm up kernels and allocator
    rows = []
    print(f"{args.model}, {args.tokens} new tokens, {args.threads} thread(s), {args.clock} clock, best of {args.repeat}")
    print(f"{'batch':>5} {'plain s':>8} {'invariant s':>11} {'ratio':>6} {'sequential s':>12} {'inv/seq':>7} {'tokens':>7}")
    for batch in [int(b) for b in args.batches.split(",")]:
        reqs = _requests(backend, batch)
        best = {w: float("inf") for w in ways}
        tokens = {}
        for _ in range(args.repeat):
            for name, make in ways.items():
                ctx, fn = make(reqs)
                with ctx:
                    secs, tokens[name] = _timed(fn, time.process_time if args.clock == "cpu" else time.perf_counter)
                best[name] = min(best[name], secs)
        row = {"batch": batch, **{f"{w}_s": round(best[w], 3) for w in ways}, "tokens": tokens,
               "ratio_invariant_vs_plain": round(best["invariant"] / best["plain"], 3),
               "ratio_invariant_vs_sequential": round(best["invariant"] / best["sequential"], 3)}
        rows.append(row)
        print(f"{batch:>5} {best['plain']:>8.2f} {best['invariant']:>11.2f} {row['ratio_invariant_vs_plain']:>5.2f}x "
              f"{best['sequential']:>12.2f} {row['ratio_invariant_vs_sequential']:>6.2f}x {tokens['invariant']:>7}")
    breakdown = _profile(backend, gen, mode, args.profile_batch) if args.profile_batch else {}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "tokens": args.tokens, "threads": args.threads, "clock": args.clock, "probe": probe, "rows": rows,
                       "ops": breakdown, "blocks": {"decode": hf_invariant.DECODE_BLOCK, "prefill": hf_invariant.PREFILL_BLOCK}}, fh, indent=1)


def _probe_cost(torch, backend: HFBackend) -> dict:
    """CPU seconds of the tier-3 probe, cold (best of 2): the whole coverage() and its linear part,
    and the linear part without the every-offset pass (what the probe cost before it covered every offset)."""
    model, device = backend.model, backend.device
    every = hf_invariant._every_offset

    def cpu(fn) -> float:
        best = float("inf")
        for _ in range(2):
            t0 = time.process_time()
            with torch.inference_mode():
                fn()
            best = min(best, time.process_time() - t0)
        return round(best, 3)

    out = {"coverage_s": cpu(lambda: hf_invariant._coverage(model, backend.options.attn_implementation, device)),
           "linear_s": cpu(lambda: hf_invariant._probe_linears(torch, model, device))}
    hf_invariant._every_offset = lambda *a, **k: None
    try:
        out["linear_without_every_offset_s"] = cpu(lambda: hf_invariant._probe_linears(torch, model, device))
    finally:
        hf_invariant._every_offset = every
    print(f"probe (cold, CPU s): coverage {out['coverage_s']}, of which linear {out['linear_s']} "
          f"(without the every-offset pass {out['linear_without_every_offset_s']})")
    return out


def _profile(backend, gen, mode, batch: int) -> dict:
    """Self CPU time per ATen op (ms), plain and invariant, for one generation at `batch`."""
    from torch.profiler import ProfilerActivity, profile

    reqs = _requests(backend, batch)
    out = {}
    for name, ctx in (("plain", contextlib.nullcontext), ("invariant", mode)):
        with ctx(), profile(activities=[ProfilerActivity.CPU]) as prof:
            gen(reqs)
        stats = prof.key_averages()
        out[name] = {e.key: round(e.self_cpu_time_total / 1000, 1) for e in stats}
        out[name]["(total)"] = round(sum(e.self_cpu_time_total for e in stats) / 1000, 1)
    print(f"\nop-level breakdown at batch {batch} (self CPU ms, top 14; profiler on: absolute figures are inflated)")
    keys = sorted(set(out["plain"]) | set(out["invariant"]), key=lambda k: -max(out["plain"].get(k, 0), out["invariant"].get(k, 0)))
    for k in keys[:14]:
        print(f"  {k:<32} plain {out['plain'].get(k, 0):>9.1f}   invariant {out['invariant'].get(k, 0):>9.1f}")
    return out


if __name__ == "__main__":
    main()
