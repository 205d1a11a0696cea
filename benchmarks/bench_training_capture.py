"""What train-check's capture costs per training step: smollm2-135m (fp32), batch 4 x 128 tokens,
AdamW, 2 threads, steps with capture (RNG state and its digest, every gradient's and parameter's
P and L2 / max-abs figures, H(B_t), h_t, the record validated and written) and without it,
interleaved on one model. Each round runs one step without capture and one with each chain version
named (--chain; default both: detllm-train/1 hashes P by SHA-256, /2 by BLAKE3), in a rotated order
(bare first in one round, captured first in the next); what is reported is the median of the
per-round ratios (captured / bare of the same round) with their spread, wall and CPU (user + sys).
Each step also prints the cores the rest of the machine kept busy meanwhile (/proc/stat less this
process) and this process's minor page faults: on 2 cores a neighbour using one core makes a step of
torch's 2-thread OpenMP team up to ~10x slower (its threads spin at each barrier while the other
waits for a core), so the ratios are given again over the quiet rounds alone. Target (issue 36):
capture <= 1.10x a bare step. --profile then takes one captured step apart: P alone, the figures
alone and both per tensor (training/capture.py) over the gradients and the parameters on one thread,
the pass on the step's threads, the rest of the record (H(B_t), R_t, validating and writing it), and
cProfile's functions by own time over one captured step. --grouped adds a mode that captures /2
with the pass written before training/capture.py (P on n pool threads beside the figures grouped on
torch's n threads), so before and after are measured in one alternated run.

    .venv/bin/python benchmarks/bench_training_capture.py [--pairs 10] [--quiet 5] [--model smollm2-135m] [--threads 2] [--chain detllm-train/2] [--grouped] [--profile]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--pairs", type=int, default=10, help="rounds of one step per mode, order rotated (after 2 warm-up rounds)")
    ap.add_argument("--chain", action="append", choices=("detllm-train/1", "detllm-train/2"),
                    help="chain version(s) to capture with (repeatable; default both)")
    ap.add_argument("--quiet", type=int, default=0, metavar="N",
                    help="after --pairs rounds, go on until N rounds were quiet (at most 4 x --pairs rounds in all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--grouped", action="store_true", help="add a mode capturing /2 with the pass written before capture.py")
    ap.add_argument("--profile", action="store_true", help="then take one captured step apart (what its extra time is spent on)")
    args = ap.parse_args()
    chains = args.chain or ["detllm-train/1", "detllm-train/2"]

    import torch

    from detllm.core.hashing import folder_identity
    from detllm.models import builtin_path
    from detllm.training import rng
    from detllm.training.check import make_config
    from detllm.training.loop import StepsWriter
    from detllm.training import steps
    from detllm.training.capture import digests_with_figures
    from detllm.training.steps import genesis_record, train_step
    from detllm.training.task import build_task

    torch.set_num_threads(args.threads)
    path = builtin_path(args.model)
    config = make_config(model_id=args.model, identity=folder_identity(args.model, path).to_json(), steps=(len(chains) + 2) * (4 * args.pairs + 2), seed=0,
                         threads=args.threads, batch_size=args.batch_size, seq_len=args.seq_len, grad_accumulation=1,
                         dtype="float32", checkpoint_every=None, test_options={})
    task = build_task(config, path)
    data = rng.seed_all(0)
    params = sum(p.numel() for p in task.model.parameters())
    modes = [None, *chains, *(["grouped"] if args.grouped else [])]  # None: capture off
    rounds: list[dict[str | None, Step]] = []
    with tempfile.TemporaryDirectory() as tmp:
        captured = [m for m in modes if m is not None]
        writers = {c: StepsWriter(Path(tmp) / f"steps{i}.jsonl") for i, c in enumerate(captured)}
        heads = {c: genesis_record(task, {**config, "chain": _chain(c)}, run=0, seed=0)[1] for c in captured}
        t = 0
        i = 0
        while i < args.pairs + 2 or (sum(_quiet(r) for r in rounds) < args.quiet and i < 4 * args.pairs + 2):
            k = i % len(modes)
            done: dict[str | None, Step] = {}
            for mode in modes[k:] + modes[:k]:  # rotate which goes first: bare first in one round, captured first in the next
                before = _sample()
                if mode is not None:
                    if mode == "grouped":
                        steps.digests_with_figures = _grouped
                    try:
                        step = train_step(task, data, t, capture=True, rng_state=rng.capture(data), h_prev=heads[mode], chain=_chain(mode))
                    finally:
                        steps.digests_with_figures = digests_with_figures
                    writers[mode].write(step.record)
                    heads[mode] = step.h
                else:
                    train_step(task, data, t, capture=False)
                done[mode] = s = _step(before, _sample())
                print(f"step {t:3d} capture {mode or 'off':15s} wall {s.wall:7.3f} s  cpu {s.cpu:7.3f} s  "
                      f"others {s.others:5.2f} cores  steal {s.steal:5.2f}  minor faults {s.faults:6d}{'' if i >= 2 else '  (warm-up)'}",
                      flush=True)
                t += 1
            if i >= 2:
                rounds.append(done)
            i += 1
        for w in writers.values():
            w.finish()
    print(f"\n{args.model}: {params / 1e6:.1f} M parameters, batch {args.batch_size} x {args.seq_len} tokens, AdamW, "
          f"{args.threads} threads, {len(rounds)} rounds after 2 warm-up rounds; load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}:")
    bare = [r[None] for r in rounds]
    print(f"  capture off: median wall {statistics.median(s.wall for s in bare):.3f} s (spread {_spread([s.wall for s in bare])}), "
          f"cpu {statistics.median(s.cpu for s in bare):.3f} s, minor faults {statistics.median(s.faults for s in bare):.0f}")
    quiet = [r for r in rounds if _quiet(r)]
    for c in captured:
        on = [r[c] for r in rounds]
        print(f"  capture on ({c}): median wall {statistics.median(s.wall for s in on):.3f} s, cpu {statistics.median(s.cpu for s in on):.3f} s, "
              f"minor faults {statistics.median(s.faults for s in on):.0f}")
        for label, rs in (("every round", rounds), (f"quiet rounds (others < {QUIET} cores)", quiet)):
            if not rs:
                print(f"    {label}: none")
                continue
            wr, cr = [r[c].wall / r[None].wall for r in rs], [r[c].cpu / r[None].cpu for r in rs]
            print(f"    {label}, {len(rs)}: median of per-round ratios wall {statistics.median(wr):.3f} ({_spread(wr)}), "
                  f"cpu {statistics.median(cr):.3f} ({_spread(cr)})")
    if args.profile:
        profile(task, data, chains[-1], t, args.threads)


def profile(task, data, chain: str, t: int, threads: int, rounds: int = 5) -> None:
    """One captured step's extra work, part by part: CPU medians of `rounds` (ms)."""
    import cProfile
    import io
    import pstats

    import torch

    from detllm.runfolder import schema_io
    from detllm.training import rng
    from detllm.training.capture import _measure, digests_with_figures, tensor_figures
    from detllm.training.digest import rng_digest, tensor_bytes, tensor_digest_bytes, dtype_name, torch_batch_digest
    from detllm.training.loop import StepsWriter
    from detllm.training.steps import named_params, train_step

    train_step(task, data, t, capture=False)  # every parameter has its gradient
    params = named_params(task.model)
    sets = {"gradients": [(n, p.grad) for n, p in params], "parameters": [(n, p.detach()) for n, p in params]}
    size = sum(p.numel() * p.element_size() for _, p in params) / 1e6

    def cpu_ms(fn) -> float:
        fn()
        runs = []
        for _ in range(rounds):
            c0 = _cpu()
            fn()
            runs.append(1e3 * (_cpu() - c0))
        return statistics.median(runs)

    def wall_cpu_ms(fn) -> tuple[float, float]:
        fn()
        runs = []
        for _ in range(rounds):
            w0, c0 = time.perf_counter(), _cpu()
            fn()
            runs.append((1e3 * (time.perf_counter() - w0), 1e3 * (_cpu() - c0)))
        return statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)

    before = torch.get_num_threads()
    print(f"\none captured step taken apart ({chain}, {len(params)} tensors, {size:.0f} MB a pass, CPU medians of {rounds}, ms):")
    for label, named in sets.items():
        torch.set_num_threads(1)
        p_ms = cpu_ms(lambda: [tensor_digest_bytes(n, dtype_name(x), tuple(x.shape), tensor_bytes(x), chain=chain) for n, x in named])
        f_ms = cpu_ms(lambda: [tensor_figures(x) for _, x in named])
        both = cpu_ms(lambda: [_measure(n, x, chain) for n, x in named])
        torch.set_num_threads(threads)
        w, c = wall_cpu_ms(lambda: digests_with_figures(named, chain))
        print(f"  {label:10s} one thread: P {p_ms:6.1f}, figures {f_ms:6.1f}, both per tensor {both:6.1f};"
              f" the pass on {threads} thread(s): wall {w:6.1f}, cpu {c:6.1f}")
    batch = task.next_batch(data)
    state = rng.capture(data)
    print(f"  H(B_t) {cpu_ms(lambda: torch_batch_digest(batch.micro)):.2f}, RNG state and R_t {cpu_ms(lambda: rng_digest(rng.capture(data))):.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        writer = StepsWriter(Path(tmp) / "steps.jsonl")
        prof = cProfile.Profile()
        prof.enable()
        step = train_step(task, data, t + 1, capture=True, rng_state=state, h_prev=b"", chain=chain)
        prof.disable()
        print(f"  the record validated and written {cpu_ms(lambda: writer.write(step.record)):.2f}, "
              f"validated alone {cpu_ms(lambda: schema_io.validate(step.record, 'train_step', where='x')):.2f}")
        writer.finish()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
    print("\ncProfile of one captured step, by own time (the main thread: worker threads show as waiting):")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip() and not line.startswith(("   Ordered", "   List"))))
    torch.set_num_threads(before)


QUIET = 0.1  # cores the rest of the machine may use during both steps of a round for it to count as quiet


@dataclass
class Step:
    wall: float  # s
    cpu: float  # s, this process (user + sys)
    others: float  # cores the rest of the machine kept busy meanwhile (/proc/stat, less this process)
    steal: float  # cores the hypervisor took meanwhile
    faults: int  # this process's minor page faults


def _sample() -> tuple[float, float, int, tuple[float, float]]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), r.ru_utime + r.ru_stime, r.ru_minflt, _machine()


def _machine() -> tuple[float, float]:
    """(busy, steal) CPU-seconds of the whole machine since boot; (0, 0) where /proc/stat is not."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return 0.0, 0.0
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = v
    return (user + nice + system + irq + softirq) / hz, steal / hz


def _step(a, b) -> Step:
    wall, cpu = b[0] - a[0], b[1] - a[1]
    busy, steal = b[3][0] - a[3][0], b[3][1] - a[3][1]
    return Step(wall, cpu, max(0.0, busy - cpu) / wall, steal / wall, b[2] - a[2])


def _quiet(r: dict[Any, Step]) -> bool:
    return all(s.others < QUIET for s in r.values())


def _spread(xs: list[float]) -> str:
    """min, quartiles and max of a few figures."""
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return f"min {min(xs):.3f}, quartiles {q[0]:.3f}-{q[2]:.3f}, max {max(xs):.3f}"


def _chain(mode: str) -> str:
    return "detllm-train/2" if mode == "grouped" else mode


_HASHERS: dict[int, Any] = {}


def _grouped(named, chain):
    """The pass before training/capture.py (commit 31a8502): P on torch's n threads in a pool, beside
    the figures of all the tensors on this thread (one _foreach_norm per dtype group, aminmax each);
    on one thread P of every tensor first, then the figures."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from detllm.training.digest import torch_tensor_digest

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests/ is not installed
    from tests.grouped_pass import grouped_figures

    n = torch.get_num_threads()
    if n < 2:  # one thread: P of every tensor, then the figures, in this thread
        done = {name: torch_tensor_digest(name, t, chain=chain) for name, t in named}
        futures = [(name, _Done(done[name])) for name, _ in named]
    else:
        pool = _HASHERS.get(n) or _HASHERS.setdefault(n, ThreadPoolExecutor(n))
        futures = [(name, pool.submit(torch_tensor_digest, name, t, chain=chain)) for name, t in named]
    figs = grouped_figures([t for _, t in named])  # on this thread, while the pool hashes
    return {name: f.result() for name, f in futures}, figs


class _Done:
    def __init__(self, value: bytes) -> None:
        self.value = value

    def result(self) -> bytes:
        return self.value


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


if __name__ == "__main__":
    main()
