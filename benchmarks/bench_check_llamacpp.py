"""Overhead of `detllm check --backend llamacpp` against the same requests sent straight to llama-server.

Side by side in one process, alternated --repeat times:
  bare:   start llama-server with the argv detllm uses, then POST the /completion bodies detllm
          builds (greedy, n_probs 5): --runs runs at batch 1 (one prompt per call), one run at
          batch 8 (one call with 8 prompts, fillers included); stop the server
  detllm: detllm.check(backend="llamacpp", runs, vary_batch=(1, 8), tier 2): server start, the
          same calls (plus the slot touches that pin prompt i to slot i), trace, seal, compare,
          report
Prints wall and CPU (this process + its children: the server) times and the ratios (_overhead.py).

    .venv/bin/python benchmarks/bench_check_llamacpp.py [--model smollm2-135m] [--runs 5] [--vary-batch 1,8]
        [--max-new-tokens 32] [--repeat 2] [--threads N]
"""

from __future__ import annotations

from _overhead import alternate, arguments, check_fields


def bare(model: str, runs: int, sizes: list[int], tokens: int, threads: int | None) -> None:
    from detllm.backends.llamacpp import LlamaCppBackend, Server, batch_seed, free_port
    from detllm.core.config import Decoding
    from detllm.core.prompts import BUILTIN_PROMPTS, FILLERS
    from detllm.pipeline.runner import plan_batches

    be = LlamaCppBackend(model, slots=max(sizes), threads=threads)  # for its argv and request bodies; its own server is never started
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
    args = arguments(__doc__)
    bare(args.model, 1, args.sizes[:1], 2, args.threads)  # warm the page cache and the binary outside the timings
    alternate("llama.cpp check", lambda: bare(args.model, args.runs, args.sizes, args.max_new_tokens, args.threads),
              check_fields("llamacpp", args), args.repeat, bare_name="bare llama-server")


if __name__ == "__main__":
    main()
