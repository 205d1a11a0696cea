"""Overhead of `detllm check --backend llamacpp` against the same requests sent straight to llama-server.

Side by side in one process, alternated --repeat times:
  bare:   start llama-server with the argv detllm uses, then POST the /completion bodies detllm
          builds (greedy, n_probs 5): --runs runs at batch 1 (one prompt per call), one run at
          batch 8 (one call with 8 prompts, fillers included); stop the server
  detllm: detllm.check(backend="llamacpp", runs, vary_batch=(1, 8), tier 2): server start, the
          same calls (plus the slot touches that pin prompt i to slot i), trace, seal, compare,
          report
Prints wall and CPU (this process + its children: the server) times and the ratios.

    .venv/bin/python benchmarks/bench_check_llamacpp.py [--model smollm2-135m] [--runs 5] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def bare(model: str, runs: int, sizes: list[int], tokens: int) -> None:
    from detllm.backends.llamacpp import LlamaCppBackend, batch_seed
    from detllm.backends.llamacpp_server import Server, free_port
    from detllm.config import Decoding
    from detllm.prompts import BUILTIN_PROMPTS, FILLERS
    from detllm.runner import plan_batches

    be = LlamaCppBackend(model, slots=max(sizes))  # for its argv and request bodies; its own server is never started
    port = free_port()
    srv = Server(be.argv(port), port, be.options.request_timeout)
    try:
        srv.wait_ready(be.options.startup_timeout)
        ids = [srv.post("/tokenize", {"content": t, "add_special": True})["tokens"] for t in BUILTIN_PROMPTS]
        fill = [srv.post("/tokenize", {"content": t, "add_special": True})["tokens"] for t in FILLERS]
        for b in sizes:
            for _ in range(runs if b == sizes[0] else 1):
                for batch in plan_batches(len(ids), b):
                    prompts = [ids[i] if i >= 0 else fill[-i - 1] for i in batch]
                    body = be._body(prompts, Decoding(max_new_tokens=tokens), batch_seed(0), 5)
                    srv.post("/completion", body if b > 1 else {**body, "prompt": prompts[0]})
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--vary-batch", default="1,8")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    sizes = [int(s) for s in args.vary_batch.split(",")]

    import detllm

    bare(args.model, 1, sizes[:1], 2)  # warm the page cache and the binary outside the timings
    walls, cpus = [], []
    for rep in range(args.repeat):
        t0, c0 = time.perf_counter(), _cpu()
        bare(args.model, args.runs, sizes, args.max_new_tokens)
        t_bare, c_bare = time.perf_counter() - t0, _cpu() - c0
        with tempfile.TemporaryDirectory() as tmp:
            t0, c0 = time.perf_counter(), _cpu()
            out = detllm.check(backend="llamacpp", model=args.model, runs=args.runs, batch_size=sizes[0],
                               vary_batch=tuple(sizes) if len(sizes) > 1 else (), max_new_tokens=args.max_new_tokens,
                               tier=2, out=Path(tmp) / "check")
            t_ours, c_ours = time.perf_counter() - t0, _cpu() - c0
        walls.append(t_ours / t_bare)
        cpus.append(c_ours / c_bare)
        print(f"[{rep + 1}] bare llama-server: {t_bare:.2f} s ({c_bare:.2f} s CPU) | detllm check (tier 2): {t_ours:.2f} s "
              f"({c_ours:.2f} s CPU) [{out.status}] | ratio {walls[-1]:.2f} wall, {cpus[-1]:.2f} CPU")
    print(f"llama.cpp check overhead detllm / bare: wall best {min(walls):.2f}, worst {max(walls):.2f}; "
          f"CPU best {min(cpus):.2f}, worst {max(cpus):.2f}")


if __name__ == "__main__":
    main()
