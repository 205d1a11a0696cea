"""Time `detllm verify` on a synthetic 1M-step pack (1,000 records x 1,000 tokens, top-5 logprobs).

The pack is a real fake-backend `check --runs 2` over PROMPTS/2 prompts whose trace is then
replaced by synthetic records (2 runs x PROMPTS/2 prompts, run 1 a byte copy of run 0, or with
--drift every logprob of run 1 moved by 1e-7); report.json's verdict (status, category, first
divergence) is re-derived from that trace with the compare code `check` runs, and the folder
re-sealed, so the manifest, the chain and the verdict are genuine: verify's re-derivation
accepts it. verify runs as a CLI subprocess (a fresh interpreter, no torch), on the folder and
on the .tar.gz.

    .venv/bin/python benchmarks/bench_verify.py [--prompts 1000] [--tokens 1000] [--top-k 5] [--drift] [--keep DIR]
    .venv/bin/python benchmarks/bench_verify.py --reuse DIR   # time a pack built with --keep DIR again
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import detllm
from detllm.runfolder import artifacts
from detllm.core.hashing import canonical_json, sha256_bytes, sha256_text
from detllm.runfolder.integrity import seal
from detllm.commands.pack import create_pack


def synthetic_trace(folder: Path, prompts: int, tokens: int, top_k: int, drift: float = 0.0) -> tuple[int, list[bytes]]:
    """Write 2 runs x prompts/2 records of `tokens` steps each through artifacts.TraceWriter, the
    runner's own path (fast record check + chain digest per record); returns the file size in bytes
    and the writer's digests. Token blocks cycle through 16 random ones to save time."""
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
    per_run = prompts // 2
    for run in (0, 1):
        for i in range(per_run):
            text = f"synthetic prompt {i}"
            ids, texts, lps, tops = blocks[i % len(blocks)]
            if run and drift:
                lps = [lp + drift for lp in lps]
                tops = [[[t, lp + drift] for t, lp in step] for step in tops]
            writer.write(artifacts.stamp("trace_record", {  # key order and spelling as the runner builds them
                "run_index": run, "batch_size": 1, "batch_position": 0, "prompt_index": i,
                "prompt_id": sha256_text(text), "prompt_text": text, "input_ids": input_ids,
                "input_ids_sha256": sha256_bytes(canonical_json(input_ids)),
                "token_ids": ids, "token_texts": texts, "text": "".join(texts),
                "logprobs": lps, "top_logprobs": tops, "finish_reason": "length",
            }))
    return writer.finish().stat().st_size, writer.digests


def rederive_report(folder: Path) -> str:
    """report.json's verdict fields recomputed from the synthetic trace (as verify will); returns the status.
    The verdict is made by rederive's own two steps (the tier gated again, then the runner's verdict
    function), so it is verify's answer by construction; after sealing, main() asks verify's public
    entry (rederive_verdict) whether it agrees before anything is timed."""
    from detllm.pipeline import rederive

    rc, applied = (json.loads((folder / name).read_text()) for name in (artifacts.RUN_CONFIG, artifacts.APPLIED))
    report = json.loads((folder / artifacts.REPORT).read_text())
    tier = rederive.expected_tier(rc, applied)
    report.update(rederive.expected_verdict(folder, rc, applied, rc["command"], tier))
    artifacts.write_json(folder, artifacts.REPORT, report)  # validated against its schema, atomically
    return report["status"]


def accepted(folder: Path) -> str:
    """What verify's re-derivation says of the sealed folder (its public entry); exits when it refuses."""
    from detllm.core.errors import DetllmError
    from detllm.pipeline.rederive import rederive_verdict

    try:
        return rederive_verdict(folder)
    except DetllmError as exc:
        raise SystemExit(f"the synthetic pack's verdict does not re-derive: {exc.message}") from exc


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def time_verify(target: Path, repeats: int) -> tuple[float, float]:
    """Best wall time and best CPU time (user + sys) of `detllm verify target` in a fresh interpreter
    (seconds). On a shared, loaded machine the CPU time is the figure to compare."""
    best, best_cpu = float("inf"), float("inf")
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), _cpu_children()
        proc = subprocess.run([sys.executable, "-m", "detllm", "verify", str(target)], capture_output=True, text=True)
        best, best_cpu = min(best, time.perf_counter() - t0), min(best_cpu, _cpu_children() - c0)
        if proc.returncode != 0:
            raise SystemExit(f"verify failed ({proc.returncode}): {proc.stderr.strip()}")
    return best, best_cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--top-k", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--drift", action="store_true", help="run 1 drifted by 1e-7 (a FAIL verdict to re-derive)")
    ap.add_argument("--keep", type=Path, help="build the pack in this (new) folder and keep it")
    ap.add_argument("--reuse", type=Path, help="time the pack an earlier --keep built in this folder (no rebuild)")
    args = ap.parse_args()
    if args.reuse:
        folder, pack = args.reuse / "run", args.reuse / "run.tar.gz"
        manifest = json.loads((folder / artifacts.MANIFEST).read_text())
        size = next(f["size"] for f in manifest["files"] if f["path"] == artifacts.TRACE)
        print(f"reusing {args.reuse}: {manifest['trace']['records']} records, trace.jsonl {size / 1e6:.0f} MB, "
              f"pack {pack.stat().st_size / 1e6:.0f} MB")
        time_both(folder, pack, size, None, args.repeats)
        return
    with (contextlib.nullcontext(str(args.keep)) if args.keep else tempfile.TemporaryDirectory(prefix="detllm-bench-verify-")) as tmp:
        folder = Path(tmp) / "run"
        prompt_list = [f"synthetic prompt {i}" for i in range(args.prompts // 2)]
        detllm.check(backend="fake", out=folder, runs=2, max_new_tokens=2, prompts=prompt_list, tier=2)
        t0 = time.perf_counter()
        size, digests = synthetic_trace(folder, args.prompts, args.tokens, args.top_k, 1e-7 if args.drift else 0.0)
        t_write = time.perf_counter() - t0
        status = rederive_report(folder)
        t0 = time.perf_counter()
        seal(folder)
        t_seal_disk = time.perf_counter() - t0
        t0 = time.perf_counter()
        seal(folder, record_digests=digests)
        t_seal = time.perf_counter() - t0
        said = accepted(folder)
        pack = create_pack(folder, Path(tmp) / "run.tar.gz")
        steps = args.prompts * args.tokens
        print(f"synthetic check pack ({status}): 2 runs x {args.prompts // 2} prompts = {args.prompts} records x {args.tokens} tokens (top-{args.top_k}) = {steps:,} steps; "
              f"trace.jsonl {size / 1e6:.0f} MB, pack {pack.stat().st_size / 1e6:.0f} MB (written in {t_write:.1f} s)")
        print(said)
        print(f"seal with the writer's digests (what a run does): {t_seal:.2f} s; "
              f"seal re-reading the trace from disk: {t_seal_disk:.2f} s")
        time_both(folder, pack, size, steps, args.repeats)


def time_both(folder: Path, pack: Path, size: int, steps: int | None, repeats: int) -> None:
    print(f"load average before timing: {os.getloadavg()[0]:.1f} (2 cores: above ~1 the wall times wait for a core)")
    t_dir, c_dir = time_verify(folder, repeats)
    rate = f"{steps / t_dir / 1e6:.2f} M steps/s, " if steps else ""
    print(f"detllm verify <folder>:  {t_dir:.2f} s wall, {c_dir:.2f} s CPU  ({rate}{size / t_dir / 1e6:.0f} MB/s)")
    t_tar, c_tar = time_verify(pack, repeats)
    print(f"detllm verify <.tar.gz>: {t_tar:.2f} s wall, {c_tar:.2f} s CPU  (includes safe extraction)")
    print(f"load average after timing: {os.getloadavg()[0]:.1f}")

if __name__ == "__main__":
    main()
