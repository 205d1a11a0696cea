"""What train-check's capture costs per training step: smollm2-135m (fp32), batch 4 x 128 tokens,
AdamW, 2 threads, steps with capture (RNG state and its digest, every gradient's and parameter's
P and L2 / max-abs figures, H(B_t), h_t, the record validated and written) and without it,
interleaved on one model, the median of each and their ratio, wall and CPU (user + sys). Each
round runs one step without capture and one with each chain version named (--chain; default
both: detllm-train/1 hashes P by SHA-256, /2 by BLAKE3), in a rotated order. Target (issue 36):
capture <= 1.10x a bare step.

    .venv/bin/python benchmarks/bench_training_capture.py [--pairs 10] [--model smollm2-135m] [--threads 2] [--chain detllm-train/2]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--pairs", type=int, default=10, help="rounds of one step per mode, order rotated (after 2 warm-up rounds)")
    ap.add_argument("--chain", action="append", choices=("detllm-train/1", "detllm-train/2"),
                    help="chain version(s) to capture with (repeatable; default both)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args()
    chains = args.chain or ["detllm-train/1", "detllm-train/2"]

    import torch

    from detllm.core.hashing import folder_identity
    from detllm.models import builtin_path
    from detllm.training import rng
    from detllm.training.check import make_config
    from detllm.training.loop import StepsWriter
    from detllm.training.steps import genesis_record, train_step
    from detllm.training.task import build_task

    torch.set_num_threads(args.threads)
    path = builtin_path(args.model)
    config = make_config(model_id=args.model, identity=folder_identity(args.model, path).to_json(), steps=(len(chains) + 1) * (args.pairs + 2), seed=0,
                         threads=args.threads, batch_size=args.batch_size, seq_len=args.seq_len, grad_accumulation=1,
                         dtype="float32", checkpoint_every=None, test_options={})
    task = build_task(config, path)
    data = rng.seed_all(0)
    params = sum(p.numel() for p in task.model.parameters())
    modes = [None, *chains]  # None: capture off
    runs: dict[str | None, list[tuple[float, float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        writers = {c: StepsWriter(Path(tmp) / f"steps{i}.jsonl") for i, c in enumerate(chains)}
        heads = {c: genesis_record(task, {**config, "chain": c}, run=0, seed=0)[1] for c in chains}
        t = 0
        for i in range(args.pairs + 2):
            k = i % len(modes)
            for mode in modes[k:] + modes[:k]:  # rotate which goes first
                w0, c0 = time.perf_counter(), _cpu()
                if mode is not None:
                    step = train_step(task, data, t, capture=True, rng_state=rng.capture(data), h_prev=heads[mode], chain=mode)
                    writers[mode].write(step.record)
                    heads[mode] = step.h
                else:
                    train_step(task, data, t, capture=False)
                wall, cpu = time.perf_counter() - w0, _cpu() - c0
                if i >= 2:
                    runs[mode].append((wall, cpu))
                print(f"step {t:3d} capture {mode or 'off':15s} wall {wall:7.3f} s  cpu {cpu:7.3f} s", flush=True)
                t += 1
        for w in writers.values():
            w.finish()
    med = {m: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for m, v in runs.items()}
    print(f"\n{args.model}: {params / 1e6:.1f} M parameters, batch {args.batch_size} x {args.seq_len} tokens, AdamW, "
          f"{args.threads} threads, {args.pairs} steps each, medians; load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}:")
    woff, coff = med[None]
    print(f"  capture off:                   wall {woff:.3f} s, cpu {coff:.3f} s")
    for c in chains:
        won, con = med[c]
        print(f"  capture on ({c}): wall {won:.3f} s, ratio {won / woff:.3f} ({100 * (won / woff - 1):+.1f}%); "
              f"cpu {con:.3f} s, ratio {con / coff:.3f} ({100 * (con / coff - 1):+.1f}%)")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


if __name__ == "__main__":
    main()
