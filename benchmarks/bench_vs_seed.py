"""`detllm check` against the seed tool, detllm 0.1.1 from PyPI in a venv of its own: the same check, the
same model folder, interleaved pairs; median wall, CPU (user + sys) and peak RSS of each, side by side.

The check both run: `check --backend hf --model FOLDER --prompt-file P --tier 1 --runs R --batch-size 1
--max-new-tokens N --out DIR` (0.1.1's README command; detllm takes it as is), on the 4 built-in prompts and
each built-in model's hf folder given by path. Each command is a fresh process; its wall, CPU and peak RSS
(ru_maxrss from wait4: that process and the children it reaped) are its own. One warm-up of each side is not
counted; then pairs alternate which side goes first. --ours-python runs this tree on another venv's packages
(a venv holding only `pip install -c constraints.txt '.[hf]'` is what a user of the hf backend has). With --same-venv the seed's package is also run from
this venv (its detllm/ folder copied out, nothing else): the difference of the tools alone, the packages
each transformers import finds (accelerate, triton, PIL here) being the same. With --api the check also runs through
detllm.check, the Python API, in a process that imports no typer: the command line's share of the peak, by difference
(ours vs that side), and the library's own against 0.1.1 (that side vs 0.1.1); its wall carries the interpreter's
teardown, which the console script skips when nothing of its own is left (cli/entrypoint.py). On a shared machine compare
the CPU medians: wall carries the neighbours' load, printed before and after.

Make the seed venv once (torch first, from the local wheel, so pip resolves no other torch):
    python3 -m venv ~/.cache/detllm/seed-venv
    ~/.cache/detllm/seed-venv/bin/pip install /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
    ~/.cache/detllm/seed-venv/bin/pip install detllm==0.1.1 transformers==<ours> tokenizers==<ours> safetensors==<ours>

    .venv/bin/python benchmarks/bench_vs_seed.py [--models tiny,smollm2-135m] [--pairs 5] [--runs 5]
        [--max-new-tokens 16] [--seed-python PATH] [--same-venv] [--api]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SEED = Path(os.environ.get("DETLLM_SEED_PYTHON") or Path.home() / ".cache/detllm/seed-venv/bin/python")
SEED_MAIN = "import sys; from detllm.cli.main import main; sys.exit(main())"  # 0.1.1's console script
# --api: the same check through detllm.check, the Python API, in a process that never imports typer (argparse reads
# the options, as 0.1.1's own command line does): what the command-line layer adds to the peak, by difference
API_MAIN = """import argparse, sys
ap = argparse.ArgumentParser()
ap.add_argument("command")
for o in ("--backend", "--model", "--prompt-file", "--tier", "--runs", "--batch-size", "--max-new-tokens", "--out"):
    ap.add_argument(o)
ap.add_argument("--no-progress", action="store_true")
a = ap.parse_args()
from detllm.api import check
o = check(backend=a.backend, model=a.model, prompts=a.prompt_file, tier=int(a.tier), runs=int(a.runs),
          batch_size=int(a.batch_size), max_new_tokens=int(a.max_new_tokens), out=a.out)
sys.exit(0 if o.status == "PASS" else 1)
"""


def measure(cmd: list[str], env: dict[str, str], log: Path) -> tuple[float, float, float, int]:
    """(wall s, CPU s, peak RSS MiB, exit code) of one process; its output goes to `log`."""
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=log.parent)
        _, status, ru = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    return wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024, proc.returncode


def verdict(out: Path) -> str:
    """The run folder's status as its own report.json says it (both tools write one)."""
    try:
        report = json.loads((out / "report.json").read_text())
    except (OSError, ValueError):
        return "no report.json"
    return str(report.get("status") or report.get("verdict") or "?")


def waited(out: Path) -> str:
    """How its idle OpenMP threads waited, as the run folder's env.json recorded it (detllm's hf backend
    picks it from the load, core/ompwait.py); 0.1.1 records none."""
    try:
        env = json.loads((out / "env.json").read_text()).get("env_vars") or {}
    except (OSError, ValueError, AttributeError):
        return ""
    seen = [f"{k}={env[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in env]
    return f"  {' '.join(seen)}" if seen else ""


def sides(args: argparse.Namespace, work: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    """{name: (argv prefix, environment)} of each tool."""
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    out = {"detllm (this tree)": ([str(args.ours_python), "-m", "detllm"], {**base, "PYTHONPATH": str(REPO)}),
           "0.1.1 (own venv)": ([str(args.seed_python), "-c", SEED_MAIN], dict(base))}
    if args.api:
        out["detllm API (no typer)"] = ([str(args.ours_python), "-c", API_MAIN], {**base, "PYTHONPATH": str(REPO)})
    if args.same_venv:  # the seed's package alone, on this venv's torch/transformers and everything they import
        where = subprocess.run([str(args.seed_python), "-c", "import detllm, os; print(os.path.dirname(detllm.__file__))"],
                               capture_output=True, text=True, check=True, env=base, cwd=work).stdout.strip()
        shutil.copytree(where, work / "seedpkg" / "detllm")
        out["0.1.1 (this venv)"] = ([sys.executable, "-c", SEED_MAIN], {**base, "PYTHONPATH": str(work / "seedpkg")})
    return out


def bench_model(name: str, args: argparse.Namespace, work: Path, tools: dict) -> None:
    from detllm.models import resolve_model

    folder = resolve_model(name).path  # built/cached outside every timing
    prompts = work / "prompts.jsonl"
    check = ["check", "--backend", "hf", "--model", str(folder), "--prompt-file", str(prompts), "--tier", "1",
             "--runs", str(args.runs), "--batch-size", "1", "--max-new-tokens", str(args.max_new_tokens)]
    got: dict[str, list[tuple[float, float, float]]] = {t: [] for t in tools}
    verdicts: dict[str, set[str]] = {t: set() for t in tools}
    names = list(tools)
    print(f"\n{name} ({folder}): {' '.join(check[:1] + check[3:4])} ... --runs {args.runs} --max-new-tokens {args.max_new_tokens}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    first = 0 if args.warmup else 1
    for i in range(first, args.pairs + 1):  # round 0: warm-up (page cache, bytecode), not counted
        order = names if i % 2 == 0 else names[::-1]
        for t in order:
            out = work / f"{name}-{abs(hash(t))}-{i}"
            argv, env = tools[t]
            extra = ["--no-progress"] if t.startswith("detllm") else []
            wall, cpu, rss, code = measure([*argv, *check, "--out", str(out), *extra], env, work / f"log-{i}.txt")
            if code != 0:
                raise SystemExit(f"{t} exited {code} on {name}: {(work / f'log-{i}.txt').read_text()[-2000:]}")
            verdicts[t].add(verdict(out))
            wait = waited(out)
            shutil.rmtree(out, ignore_errors=True)
            if i > 0:
                got[t].append((wall, cpu, rss))
                print(f"  pair {i} {t:<20} {wall:7.2f} s wall {cpu:6.2f} s CPU {rss:7.1f} MiB peak  "
                      f"(load {os.getloadavg()[0]:.1f}){wait}", flush=True)
    ours, seed = names[0], "0.1.1 (own venv)"
    print(f"{'tool':<20} {'wall median':>11} {'CPU median':>11} {'peak RSS median':>16} {'max':>8}  verdict   (wall range)")
    for t in names:
        w, c, r = (statistics.median(x[k] for x in got[t]) for k in range(3))
        lo, hi = min(x[0] for x in got[t]), max(x[0] for x in got[t])
        print(f"{t:<21} {w:8.2f} s {c:9.2f} s {r:12.1f} MiB {max(x[2] for x in got[t]):8.1f} MiB  "
              f"{'/'.join(sorted(verdicts[t])):<8}  ({lo:.2f}-{hi:.2f} s)")
    for a, b in [(ours, t) for t in names if t != ours and t.startswith("0.1.1")] + [(t, seed) for t in names if t.startswith("detllm API")]:
        pair = [x[0] / y[0] for x, y in zip(got[a], got[b])]
        cpair = [x[1] / y[1] for x, y in zip(got[a], got[b])]
        label = "ours" if a == ours else a
        print(f"{name} {label}/{b}: wall {statistics.median(x[0] for x in got[a]) / statistics.median(x[0] for x in got[b]):.2f}x "
              f"(median of pair ratios {statistics.median(pair):.2f}x), CPU {statistics.median(cpair):.2f}x, "
              f"peak RSS {statistics.median(x[2] for x in got[a]) - statistics.median(x[2] for x in got[b]):+.1f} MiB "
              f"over {len(pair)} pairs")
    print(f"load average after {name}: {os.getloadavg()[0]:.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,smollm2-135m")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--warmup", type=int, choices=(0, 1), default=1, help="1: one uncounted round first")
    ap.add_argument("--seed-python", type=Path, default=DEFAULT_SEED, help="python of the venv holding detllm 0.1.1")
    ap.add_argument("--ours-python", type=Path, default=Path(sys.executable),
                    help="python whose packages this tree runs on (default: this one); e.g. a venv holding only detllm[hf]")
    ap.add_argument("--same-venv", action="store_true", help="also run 0.1.1's package on this venv's libraries")
    ap.add_argument("--api", action="store_true",
                    help="also run the check through detllm.check (no typer): the command-line layer's share, by difference")
    args = ap.parse_args()
    if not args.seed_python.exists():
        print(f"no seed venv at {args.seed_python} (make it as this script's docstring says, or pass --seed-python)",
              file=sys.stderr)
        return 2
    from detllm.core.prompts import BUILTIN_PROMPTS

    with tempfile.TemporaryDirectory(prefix="detllm-bench-seed-") as tmp:
        work = Path(tmp)
        (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in BUILTIN_PROMPTS))
        tools = sides(args, work)
        print(f"this tree on {args.ours_python}, 0.1.1 on {args.seed_python}")
        print(f"{args.pairs} interleaved pairs{' after one warm-up' if args.warmup else ', no warm-up'}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
        for name in args.models.split(","):
            bench_model(name, args, work, tools)
    return 0


if __name__ == "__main__":
    sys.exit(main())
