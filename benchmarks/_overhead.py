"""The measuring loop shared by the check-overhead benchmarks (bench_check*.py): alternate the bare work
and `detllm check`, time each (wall and CPU), print one line per pair and the ratios.

Owns timing, CPU accounting and printing; each script owns what "bare" and "detllm" do. CPU is this
process's user + system time over all its threads plus that of its children that have ended (a
llama-server it stopped), read with getrusage: steadier than wall on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


def arguments(doc: str, **defaults: Any) -> argparse.Namespace:
    """The options every check-overhead script takes (defaults: smollm2-135m, 5 runs at batch 1 + one at
    batch 8, 32 new tokens, 2 alternated pairs), `defaults` overriding them; .sizes holds --vary-batch."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--vary-batch", default="1,8", help="batch sizes, the first is the base (as check's --batch-size)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2, help="bare/detllm pairs, alternated")
    ap.add_argument("--threads", type=int, default=None,
                    help="compute threads on both sides (torch intra-op, llama-server -t); default: the engine's. On a "
                         "shared machine 1 thread keeps a busy neighbour from stalling a thread team at every op")
    for name, value in defaults.items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = ap.parse_args()
    args.sizes = [int(s) for s in args.vary_batch.split(",")]
    return args


def check_fields(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    """detllm.check's arguments for the check every script measures: tier 2, --runs at the first batch
    size, one run at each other size."""
    return dict(backend=backend, model=args.model, runs=args.runs, batch_size=args.sizes[0],
                vary_batch=tuple(args.sizes[1:]), max_new_tokens=args.max_new_tokens, tier=2, threads=args.threads)


def check(fields: dict[str, Any]) -> str:
    """Run detllm.check(**fields) into a temporary folder; its status."""
    import detllm

    with tempfile.TemporaryDirectory() as tmp:
        return detllm.check(**fields, out=Path(tmp) / "check").status


def cpu_seconds() -> float:
    """User + system CPU of this process (every thread) and of its reaped children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@dataclass(frozen=True)
class Timing:
    wall: float  # seconds
    cpu: float  # CPU seconds (cpu_seconds)

    def __str__(self) -> str:
        return f"{self.wall:.2f} s ({self.cpu:.2f} s CPU)"


def timed(fn: Callable[[], object]) -> tuple[Timing, object]:
    """(wall and CPU of one call, its return value)."""
    t0, c0 = time.perf_counter(), cpu_seconds()
    value = fn()
    return Timing(time.perf_counter() - t0, cpu_seconds() - c0), value


def load() -> str:
    """The machine's load averages (1, 5, 15 min), to print next to the figures."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def alternate(label: str, bare: Callable[[], object], fields: dict[str, Any], repeat: int,
              bare_name: str = "bare", after: Callable[[], None] | None = None) -> list[tuple[Timing, Timing]]:
    """Run bare() then check(fields) `repeat` times, print each pair and the ratios check / bare.
    after(), untimed, runs after each of them (clear a model cache, stop an engine)."""
    pairs = []
    print(f"{fields['model']}, {fields['backend']}: runs {fields['runs']} at batch {fields['batch_size']}"
          + "".join(f" + 1 at batch {b}" for b in fields["vary_batch"]) + f", {fields['max_new_tokens']} new tokens, "
          f"threads {fields['threads'] or 'engine default'}")
    print(f"load average before: {load()} (cores: {os.cpu_count()})")
    for rep in range(repeat):
        t_bare, _ = timed(bare)
        if after:
            after()
        t_ours, status = timed(lambda: check(fields))
        if after:
            after()
        pairs.append((t_bare, t_ours))
        print(f"[{rep + 1}] {bare_name}: {t_bare} | detllm check (tier 2): {t_ours} [{status}] | "
              f"ratio {t_ours.wall / t_bare.wall:.2f} wall, {t_ours.cpu / t_bare.cpu:.2f} CPU | load {load()}", flush=True)
    walls = [o.wall / b.wall for b, o in pairs]
    cpus = [o.cpu / b.cpu for b, o in pairs]
    print(f"{label} overhead detllm / {bare_name}: wall best {min(walls):.2f}, worst {max(walls):.2f}; "
          f"CPU best {min(cpus):.2f}, worst {max(cpus):.2f}")
    return pairs
