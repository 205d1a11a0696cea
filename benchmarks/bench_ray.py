"""`check --ray` on a local Ray cluster against the same checks one after another on one machine.

Starts a ray.cluster_utils.Cluster of --nodes nodes (1 CPU each, no dashboard, 80 MiB object store),
then, in one run and side by side:
  ray:        `detllm check --ray ADDR --per node` (one task per node, each a fresh worker process:
              import, load, check, pack; the driver unpacks, verifies and writes the fleet folder)
  one by one: the same check (`detllm check`, no Ray) --nodes times, one after another
Each driver is its own process: wall time and its peak RSS (os.wait4). The workers' memory is the
nodes', not the driver's. On a 2-core machine the nodes share the cores: read the difference per task
(ray wall minus the one-by-one wall, over the tasks), not a speed-up.

    .venv/bin/python benchmarks/bench_ray.py [--nodes 3] [--prompts 2] [--tokens 8]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = ["The capital of France is", "Once upon a time", "In 1492, Columbus", "The quick brown fox"]


def timed(argv: list[str]) -> tuple[float, float, int, str]:
    """(wall s, peak RSS MiB, exit code, last line of stdout) of one process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    lines = [ln for ln in out.splitlines() if ln.strip()]
    return time.perf_counter() - t0, usage.ru_maxrss / 1024, proc.returncode, (lines[0] if lines else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args()
    from ray.cluster_utils import Cluster

    check = [sys.executable, "-m", "detllm", "check", "--backend", "hf", "--model", "tiny", "--tier", "2", "--runs", "2",
             "--threads", "1", "--max-new-tokens", str(args.tokens), "--no-progress"]
    for p in PROMPTS[:args.prompts]:
        check += ["--prompt", p]
    print(f"cpus: {os.cpu_count()}, python {sys.version.split()[0]}, load average {os.getloadavg()[0]:.1f}")
    t0 = time.perf_counter()
    kw = dict(num_cpus=1, object_store_memory=80 * 2**20)
    cluster = Cluster(initialize_head=True, head_node_args=dict(include_dashboard=False, **kw))
    try:
        for _ in range(args.nodes - 1):
            cluster.add_node(**kw)
        print(f"cluster of {args.nodes} nodes started in {time.perf_counter() - t0:.1f} s (not counted below)")
        with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
            ray = timed(check + ["--ray", cluster.address, "--per", "node", "--out", str(Path(tmp) / "fleet")])
            each = [timed(check + ["--out", str(Path(tmp) / f"one_{i}")]) for i in range(args.nodes)]
    finally:
        cluster.shutdown()
    seq_wall = sum(w for w, *_ in each)
    print(f"\n{'':>28}{'wall_s':>10}{'driver_rss_mib':>16}  verdict")
    print(f"{f'ray, {args.nodes} tasks at once':>28}{ray[0]:>10.2f}{ray[1]:>16.1f}  {ray[3]} (exit {ray[2]})")
    print(f"{f'{args.nodes} checks one by one':>28}{seq_wall:>10.2f}{max(r for _, r, *_ in each):>16.1f}  "
          f"{', '.join(sorted({v for *_, v in each}))}")
    print(f"one check alone: {seq_wall / args.nodes:.2f} s; ray minus one-by-one: {ray[0] - seq_wall:+.2f} s in all, "
          f"{(ray[0] - seq_wall) / args.nodes:+.2f} s per task (worker start and ray import, pack, unpack and verify, "
          f"against what running at once saves on {os.cpu_count()} shared cores)")

if __name__ == "__main__":
    main()
