"""Time `detllm verify` on a synthetic 1M-step pack (1,000 prompts x 1,000 tokens, top-5 logprobs).

The pack's small files come from a real fake-backend run; its trace is replaced by synthetic
records and the folder re-sealed, so the manifest and chain are genuine. verify runs as a CLI
subprocess (a fresh interpreter, no torch), on the folder and on the .tar.gz.

    .venv/bin/python benchmarks/bench_verify.py [--prompts 1000] [--tokens 1000] [--top-k 5]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import detllm
from detllm import artifacts
from detllm.hashing import canonical_json, sha256_bytes, sha256_text
from detllm.integrity import seal
from detllm.pack import create_pack


def synthetic_trace(folder: Path, prompts: int, tokens: int, top_k: int) -> tuple[int, list[bytes]]:
    """Write `prompts` records of `tokens` steps each through artifacts.TraceWriter, the runner's own
    path (fast record check + chain digest per record); returns the file size in bytes and the
    writer's digests. Token blocks cycle through 16 random ones to save time."""
    rng = random.Random(0)
    blocks = []
    for _ in range(16):
        ids = [rng.randrange(32000) for _ in range(tokens)]
        lps = [-rng.random() * 5 for _ in range(tokens)]
        tops = [[[t, lp]] + [[rng.randrange(32000), lp - rng.random() - 0.01 * j] for j in range(1, top_k)]
                for t, lp in zip(ids, lps)]
        blocks.append((ids, [f"t{t}" for t in ids], lps, tops))
    input_ids = list(range(8))
    writer = artifacts.TraceWriter(folder)
    for i in range(prompts):
        text = f"synthetic prompt {i}"
        ids, texts, lps, tops = blocks[i % len(blocks)]
        rec = {  # key order and spelling as the runner builds them
            "schema_version": "1", "artifact_type": "trace_record", "run_index": 0, "batch_size": 1,
            "batch_position": 0, "prompt_index": i, "prompt_id": sha256_text(text),
            "prompt_text": text, "input_ids": input_ids, "input_ids_sha256": sha256_bytes(canonical_json(input_ids)),
            "token_ids": ids, "token_texts": texts, "text": "".join(texts),
            "logprobs": lps, "top_logprobs": tops, "finish_reason": "length",
        }
        writer.write(rec)
    return writer.finish().stat().st_size, writer.digests


def time_verify(target: Path, repeats: int) -> float:
    """Best wall time of `detllm verify target` in a fresh interpreter (seconds)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "detllm", "verify", str(target)], capture_output=True, text=True)
        best = min(best, time.perf_counter() - t0)
        if proc.returncode != 0:
            raise SystemExit(f"verify failed ({proc.returncode}): {proc.stderr.strip()}")
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--top-k", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="detllm-bench-verify-") as tmp:
        folder = Path(tmp) / "run"
        detllm.run(backend="fake", out=folder, max_new_tokens=2)
        t0 = time.perf_counter()
        size, digests = synthetic_trace(folder, args.prompts, args.tokens, args.top_k)
        t_write = time.perf_counter() - t0
        t0 = time.perf_counter()
        seal(folder)
        t_seal_disk = time.perf_counter() - t0
        t0 = time.perf_counter()
        seal(folder, record_digests=digests)
        t_seal = time.perf_counter() - t0
        pack = create_pack(folder, Path(tmp) / "run.tar.gz")
        steps = args.prompts * args.tokens
        print(f"synthetic pack: {args.prompts} records x {args.tokens} tokens (top-{args.top_k}) = {steps:,} steps; "
              f"trace.jsonl {size / 1e6:.0f} MB, pack {pack.stat().st_size / 1e6:.0f} MB (written in {t_write:.1f} s)")
        print(f"seal with the writer's digests (what a run does): {t_seal:.2f} s; "
              f"seal re-reading the trace from disk: {t_seal_disk:.2f} s")
        t_dir = time_verify(folder, args.repeats)
        print(f"detllm verify <folder>:  {t_dir:.2f} s  ({steps / t_dir / 1e6:.2f} M steps/s, {size / t_dir / 1e6:.0f} MB/s)")
        t_tar = time_verify(pack, args.repeats)
        print(f"detllm verify <.tar.gz>: {t_tar:.2f} s  (includes safe extraction)")


if __name__ == "__main__":
    main()
