"""CLI start-up: wall time and imported modules of `detllm --help`, `diff`, `verify` and `report`
on small folders (a fake-backend check and a copy with one planted divergence).

Each command runs in a fresh interpreter (`python -m detllm ...`), --repeat times; prints the
best wall time, the number of modules imported, the heaviest top-level packages loaded and
whether any of torch, transformers, vllm or numpy was imported. A bare `python -c pass` is
timed too, as the floor.

    .venv/bin/python benchmarks/bench_startup.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAVY = ("torch", "transformers", "vllm", "numpy", "jsonschema", "rich", "msgspec")

PROBE = """
import sys, time
t0 = time.perf_counter()
sys.argv = ["detllm", *{args!r}]
code = 0
try:
    from detllm.cli import main  # not entry(): it leaves diff, verify and report with os._exit
    main()
except SystemExit as exc:
    code = exc.code or 0
mods = sorted(sys.modules)
sys.stderr.write("\\nPROBE " + repr((code, len(mods), sorted({{m.split('.')[0] for m in mods}}))) + "\\n")
"""


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _wall(cmd: list[str], repeat: int) -> tuple[float, float, subprocess.CompletedProcess]:
    """Best wall time, best CPU time (user + sys: the figure to compare on a loaded machine), last run."""
    best, best_cpu, proc = float("inf"), float("inf"), None
    for _ in range(repeat):
        t, c = time.perf_counter(), _cpu_children()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        best, best_cpu = min(best, time.perf_counter() - t), min(best_cpu, _cpu_children() - c)
    return best, best_cpu, proc


def _modules(args: list[str]) -> tuple[int, int, list[str]]:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(args=args)], capture_output=True, text=True)
    line = next(l for l in proc.stderr.splitlines() if l.startswith("PROBE "))
    code, n, tops = eval(line[6:])  # our own repr, written just above
    return code, n, tops


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    import detllm

    root = Path(tempfile.mkdtemp(prefix="detllm-bench-startup-"))
    try:
        run = root / "run"
        detllm.check(backend="fake", out=run, max_new_tokens=16)
        other = root / "other"
        shutil.copytree(run, other)
        lines = (other / "trace.jsonl").read_text().splitlines()
        rec = json.loads(lines[0])
        rec["token_ids"][3] = rec["token_ids"][3] + 1  # a planted divergence (the copy is not re-sealed)
        (other / "trace.jsonl").write_text("\n".join([json.dumps(rec, separators=(",", ":")), *lines[1:]]) + "\n")
        floor, floor_cpu, _ = _wall([sys.executable, "-c", "pass"], args.repeat)
        print(f"python -c pass: {floor * 1e3:.0f} ms wall, {floor_cpu * 1e3:.0f} ms CPU (the floor)")
        cases = [("--help", ["--help"]), ("diff (equal)", ["diff", str(run), str(run)]),
                 ("diff (1 divergence)", ["diff", str(run), str(other)]), ("verify", ["verify", str(run)]),
                 ("report", ["report", str(run)])]
        for name, argv in cases:
            wall, cpu, proc = _wall([sys.executable, "-m", "detllm", *argv], args.repeat)
            code, n, tops = _modules(argv)
            heavy = [m for m in HEAVY if m in tops]
            print(f"detllm {name:<20} {wall * 1e3:6.0f} ms wall {cpu * 1e3:6.0f} ms CPU  exit {proc.returncode}  {n:4d} modules  "
                  f"loaded of {', '.join(HEAVY)}: {', '.join(heavy) or 'none'}")
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
