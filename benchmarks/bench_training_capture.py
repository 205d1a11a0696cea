"""What train-check's capture costs per training step: smollm2-135m (fp32), batch 4 x 128 tokens,
AdamW, 2 threads, steps with capture (RNG state and its digest, every gradient's and parameter's
SHA-256 and L2 / max-abs figures, H(B_t), h_t, the record validated and written) and without it,
interleaved on one model, the median of each and their ratio. Target (issue 23): capture <= 10%.

    .venv/bin/python benchmarks/bench_training_capture.py [--pairs 10] [--model smollm2-135m] [--threads 2]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--pairs", type=int, default=10, help="capture-on / capture-off step pairs, alternated (after 2 warm-up pairs)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args()

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
    config = make_config(model_id=args.model, identity=folder_identity(args.model, path).to_json(), steps=2 * args.pairs + 4, seed=0,
                         threads=args.threads, batch_size=args.batch_size, seq_len=args.seq_len, grad_accumulation=1,
                         dtype="float32", checkpoint_every=None, test_options={})
    task = build_task(config, path)
    data = rng.seed_all(0)
    params = sum(p.numel() for p in task.model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        writer = StepsWriter(Path(tmp) / "steps.jsonl")
        _, h = genesis_record(task, config, run=0, seed=0)
        on: list[tuple[float, float]] = []
        off: list[tuple[float, float]] = []
        t = 0
        for i in range(args.pairs + 2):
            for capture in (True, False) if i % 2 == 0 else (False, True):  # alternate which goes first
                w0, c0 = time.perf_counter(), _cpu()
                if capture:
                    step = train_step(task, data, t, capture=True, rng_state=rng.capture(data), h_prev=h)
                    writer.write(step.record)
                    h = step.h
                else:
                    train_step(task, data, t, capture=False)
                wall, cpu = time.perf_counter() - w0, _cpu() - c0
                if i >= 2:
                    (on if capture else off).append((wall, cpu))
                print(f"step {t:3d} capture {'on ' if capture else 'off'}  wall {wall:7.3f} s  cpu {cpu:7.3f} s", flush=True)
                t += 1
        writer.finish()
    won, woff = statistics.median(w for w, _ in on), statistics.median(w for w, _ in off)
    con, coff = statistics.median(c for _, c in on), statistics.median(c for _, c in off)
    print(f"\n{args.model}: {params / 1e6:.1f} M parameters, batch {args.batch_size} x {args.seq_len} tokens, AdamW, "
          f"{args.threads} threads, {args.pairs} steps each, medians:")
    print(f"  wall: capture on {won:.3f} s, off {woff:.3f} s, ratio {won / woff:.3f} (capture costs {100 * (won / woff - 1):+.1f}%)")
    print(f"  cpu:  capture on {con:.3f} s, off {coff:.3f} s, ratio {con / coff:.3f} (capture costs {100 * (con / coff - 1):+.1f}%)")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


if __name__ == "__main__":
    main()
