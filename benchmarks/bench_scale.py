"""How a run scales with the number of prompts: prompts/s of `detllm run` on the fake backend.

Runs `detllm.run(backend="fake", max_new_tokens=8)` (one run at batch size 1, the whole run
path: prompt file, tokenizing, generating, the trace writer with its record check and chain
digests, the report and the seal) on 1k, 10k and 100k distinct prompts and prints prompts/s
for each. A run that scales linearly shows the same rate at every size (issue 11: it once
grew quadratically, 1k prompts 5 s, 2k 11.5 s). The target: >= 2,000 prompts/s at 10k.

    .venv/bin/python benchmarks/bench_scale.py [--sizes 1000,10000,100000] [--tokens 8] [--command run]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import detllm


def prompt_file(folder: Path, n: int) -> Path:
    path = folder / f"prompts-{n}.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"prompt number {i}: tell me about item {i * 7919 % 100003}"}) + "\n")
    return path


def time_run(folder: Path, n: int, tokens: int, command: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one run; on a shared machine the CPU time
    is the better measure of the code (the run is single-threaded)."""
    prompts = prompt_file(folder, n)
    out = folder / f"{command}-{n}"
    t0, c0 = time.perf_counter(), time.process_time()
    outcome = getattr(detllm, command)(backend="fake", prompts=prompts, out=out, max_new_tokens=tokens)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert outcome.report["summary"]["prompts"] == n
    shutil.rmtree(out)
    return elapsed, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,10000,100000", help="comma-separated prompt counts")
    ap.add_argument("--tokens", type=int, default=8, help="max_new_tokens per prompt")
    ap.add_argument("--command", choices=("run", "check"), default="run", help="check repeats each prompt 3 times")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="detllm-bench-scale-") as tmp:
        time_run(Path(tmp), 100, args.tokens, args.command)  # warm-up: imports, schema loading
        print(f"detllm {args.command}, fake backend, {args.tokens} tokens per prompt")
        for n in (int(x) for x in args.sizes.split(",")):
            s, cpu = time_run(Path(tmp), n, args.tokens, args.command)
            print(f"{n:>8} prompts  {s:8.2f} s wall  {n / s:8.0f} prompts/s   {cpu:8.2f} s CPU  {n / cpu:8.0f} prompts/CPU-s",
                  flush=True)


if __name__ == "__main__":
    main()
