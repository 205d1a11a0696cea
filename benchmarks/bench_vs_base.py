"""Run one benchmark script on a base commit and on this tree, alternated, and print each figure's
medians and their ratio: a regression shows as a ratio in one run, on one machine, under one load.

The base is checked out as a detached `git worktree` (removed afterwards) and its own copy of the script
runs with PYTHONPATH=<that worktree>; this tree's runs with PYTHONPATH=<this tree>. Both sides get compiled
bytecode in their own cache (PYTHONPYCACHEPREFIX), so PYTHONDONTWRITEBYTECODE in the environment does not
turn every run into a compile. The order alternates every pair (base first, then HEAD first) so a load
that drifts during the run weighs on both sides alike. A figure is a script line `NAME: ... X.XX s`
(the first seconds after the colon) and, when the line has one, its `CPU X.XX s`. The arguments after
`--` go to both copies of the script, so they must be ones the base's copy takes too (49a21ad's
bench_diff.py has no --cases). On a shared machine compare the CPU rows: the wall rows carry the load.

    .venv/bin/python benchmarks/bench_vs_base.py 49a21ad bench_diff.py [--pairs 5] -- --repeat 1 [--prompts 1000 --tokens 1000]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
_FIGURE = re.compile(r"^(?P<name>[^:\n]{3,120}):\s+(?:best\s+)?(?P<wall>\d+(?:\.\d+)?) s\b")
_CPU = re.compile(r"CPU(?: \(user \+ sys\))?(?: best)? (?P<cpu>\d+(?:\.\d+)?) s|(?P<cpu2>\d+(?:\.\d+)?) s CPU")
# scripts that make their data once and reuse it when given the same folder (the warm-up run makes it)
KEEP = {"bench_diff.py": "--keep"}


def figures(stdout: str) -> dict[str, float]:
    """{name: seconds} of every figure line; a line's CPU time, when it has one, as 'NAME [CPU]'."""
    out: dict[str, float] = {}
    for line in stdout.splitlines():
        m = _FIGURE.match(line.strip())
        if not m:
            continue
        name = m["name"].strip()
        out[name] = float(m["wall"])
        c = _CPU.search(line, m.end())
        if c:
            out[name + " [CPU]"] = float(c["cpu"] or c["cpu2"])
    return out


def _run(tree: Path, script: str, args: list[str], cache: Path) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONPATH=str(tree), PYTHONPYCACHEPREFIX=str(cache))
    proc = subprocess.run([sys.executable, str(tree / "benchmarks" / script), *args], cwd=tree, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: {script} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return figures(proc.stdout)


def compare(base: Path, head: Path, script: str, args: list[str], pairs: int, work: Path) -> int:
    sides = {"base": base, "HEAD": head}
    extra = {s: ([KEEP[script], str(work / f"data-{s}")] if script in KEEP else []) for s in sides}
    caches = {s: work / f"pycache-{s}" for s in sides}
    print(f"base {base}, HEAD {head}; {script} {' '.join(args)}; {pairs} alternated pairs after one warm-up each; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for s, tree in sides.items():  # warm-up: compiles the bytecode, makes any kept data; not counted
        _run(tree, script, args + extra[s], caches[s])
    got: dict[str, dict[str, list[float]]] = {"base": {}, "HEAD": {}}
    for i in range(pairs):
        for s in (("base", "HEAD") if i % 2 == 0 else ("HEAD", "base")):
            for name, value in _run(sides[s], script, args + extra[s], caches[s]).items():
                got[s].setdefault(name, []).append(value)
    names = [n for n in got["HEAD"] if n in got["base"]]
    if not names:
        print("no figure line (NAME: X.XX s) common to both sides", file=sys.stderr)
        return 1
    width = max(len(n) for n in names)
    print(f"{'figure':<{width}}  {'base median':>11}  {'HEAD median':>11}  HEAD/base  (base range | HEAD range)")
    for n in names:
        b, h = statistics.median(got["base"][n]), statistics.median(got["HEAD"][n])
        spread = " | ".join(f"{min(got[s][n]):.2f}-{max(got[s][n]):.2f}" for s in ("base", "HEAD"))
        print(f"{n:<{width}}  {b:>9.2f} s  {h:>9.2f} s  {h / b if b else float('nan'):>8.2f}x  ({spread})")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", help="the base commit (anything git rev-parse takes)")
    ap.add_argument("script", help="a script in benchmarks/, e.g. bench_diff.py; the base must have it too")
    ap.add_argument("--pairs", type=int, default=5, help="alternated base/HEAD pairs (medians over these)")
    ap.add_argument("--head", type=Path, default=HERE, help="the tree to compare (default: this one)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # after --: the script's own arguments, the same on both sides
    args, script_args = ap.parse_args(argv[:cut]), argv[cut + 1:]
    if not (args.head / "benchmarks" / args.script).is_file():
        print(f"error: no benchmarks/{args.script} in {args.head}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="detllm-bench-vs-base-"))
    base = work / "base"
    try:
        made = subprocess.run(["git", "-C", str(args.head), "worktree", "add", "--detach", str(base), args.base],
                              capture_output=True, text=True)
        if made.returncode != 0:
            print(f"error: cannot check out {args.base}: {made.stderr.strip()}", file=sys.stderr)
            return 2
        if not (base / "benchmarks" / args.script).is_file():
            print(f"error: {args.base} has no benchmarks/{args.script}", file=sys.stderr)
            return 2
        return compare(base, args.head.resolve(), args.script, script_args, args.pairs, work)
    finally:
        subprocess.run(["git", "-C", str(args.head), "worktree", "remove", "--force", str(base)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
