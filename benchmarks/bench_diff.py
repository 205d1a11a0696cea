"""Time `detllm diff` (the CLI, in a subprocess) on a synthetic pair of run folders.

Each folder holds PROMPTS records of TOKENS generated tokens with top-K logprobs, as
the runner writes them; the right folder is a copy of the left with one divergence
planted (prompt PROMPTS/2, token TOKENS*7/10), and in the second pair every logprob of
the right side also drifted by 1e-7 (no record byte-identical). Each case runs as
shipped (compare/pairs.py's worker on the second core) and in one process, alternated.
Target on a 2-core machine: < 2 s.

    .venv/bin/python benchmarks/bench_diff.py [--prompts 1000] [--tokens 1000] [--top-k 5] [--repeat 3] [--cases 6]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from detllm.runfolder import artifacts
from detllm.runfolder.env import collect_env
from detllm.core.hashing import canonical_json, sha256_bytes, sha256_text


def _config(prompts: int, tokens: int, top_k: int) -> dict:
    return artifacts.stamp("run_config", {
        "detllm_version": "bench", "command": "run", "created_at": artifacts.utc_now(),
        "config": {"backend": "fake", "model": "bench", "revision": None, "dtype": "float32", "device": "cpu",
                   "decoding": {"max_new_tokens": tokens, "temperature": 0.0, "top_p": 1.0, "top_k": 0},
                   "seed": 0, "tier": 2, "mode": "best-effort", "batch_size": 1, "vary_batch": [], "runs": 1,
                   "logprobs": top_k, "record_prompt_text": True, "threads": None, "atol": 0.0, "options": {}},
        "backend_options": {},
        "model": {"id": "bench", "path": None, "revision": None, "format": "fake",
                  "weights": [{"file": "bench.weights", "sha256": "0" * 64, "size": 0}],
                  "weights_sha256": "1" * 64, "tokenizer_sha256": "2" * 64, "quantization": None},
        "prompts": {"source": "bench", "count": prompts, "sha256": "3" * 64},
    })


def _applied() -> dict:
    return artifacts.stamp("determinism_applied", {
        "backend": "fake", "tier_requested": 2, "tier_effective": 2, "mode": "best-effort", "downgraded": False,
        "downgrade_reason": None, "settings": [],
        "capabilities": {"max_tier": 2, "logprobs": True, "sampling": True, "batch_invariant": False, "notes": []},
    })


def _record(i: int, tokens: int, top_k: int, rng: random.Random) -> dict:
    text = f"benchmark prompt number {i}"
    ids = [rng.randrange(50_000) for _ in range(tokens)]
    lps = [-rng.random() * 3 for _ in range(tokens)]
    tops = [[[t, lp]] + [[rng.randrange(50_000), lp - 0.25 * (k + 1)] for k in range(top_k - 1)] for t, lp in zip(ids, lps)]
    input_ids = [rng.randrange(50_000) for _ in range(12)]
    texts = [f" w{t}" for t in ids]
    return artifacts.stamp("trace_record", {
        "run_index": 0, "batch_size": 1, "batch_position": 0, "prompt_index": i, "prompt_id": sha256_text(text),
        "prompt_text": text, "input_ids": input_ids, "input_ids_sha256": sha256_bytes(canonical_json(input_ids)),
        "token_ids": ids, "token_texts": texts, "text": "".join(texts), "logprobs": lps, "top_logprobs": tops,
        "finish_reason": "length",
    })


def _line(rec: dict) -> str:
    return json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n"  # as TraceWriter writes it


def make_pair(root: Path, prompts: int, tokens: int, top_k: int, drift: float = 0.0) -> tuple[Path, Path, tuple[int, int]]:
    """Two folders equal but for the planted flip; with `drift`, every right-side logprob also moves
    by that much (batch or engine drift), so no record is byte-identical to its partner."""
    left, right = root / "left", root / "right"
    planted = (prompts // 2, tokens * 7 // 10)
    for folder in (left, right):
        folder.mkdir(parents=True, exist_ok=True)
        artifacts.write_json(folder, artifacts.RUN_CONFIG, _config(prompts, tokens, top_k))
        artifacts.write_json(folder, artifacts.ENV, collect_env({"name": "fake", "version": "bench"}))
        artifacts.write_json(folder, artifacts.APPLIED, _applied())
    rng = random.Random(0)
    with open(left / artifacts.TRACE, "w", encoding="utf-8") as fl, open(right / artifacts.TRACE, "w", encoding="utf-8") as fr:
        for i in range(prompts):
            rec = _record(i, tokens, top_k, rng)
            line = _line(rec)
            fl.write(line)
            if i == planted[0]:
                p = planted[1]
                rec["token_ids"][p] = rec["top_logprobs"][p][1][0]  # the runner-up wins: a flipped near tie
                rec["token_texts"][p] = f" w{rec['token_ids'][p]}"
                rec["text"] = "".join(rec["token_texts"])
                line = _line(rec)
            if drift:
                rec["logprobs"] = [lp + drift for lp in rec["logprobs"]]
                rec["top_logprobs"] = [[[t, lp + drift] for t, lp in step] for step in rec["top_logprobs"]]
                line = _line(rec)
            fr.write(line)
    return left, right, planted


CPU: list[float] = []  # CPU seconds (user + sys) of each timed command: on a shared, loaded machine the
# wall time says more about the neighbours than about detllm


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _time(cmd: list[str], repeat: int) -> tuple[list[float], subprocess.CompletedProcess]:
    times, proc = [], None
    CPU.clear()
    for _ in range(repeat):
        t, c = time.perf_counter(), _cpu_children()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        times.append(time.perf_counter() - t)
        CPU.append(_cpu_children() - c)
    return times, proc


def _cpu() -> str:
    return f"; CPU (user + sys) best {min(CPU):.2f} s"


# `detllm diff` in one process: compare/pairs.py's worker never starts (the two-core split measured against it)
ONE_PROCESS = ("import sys; from detllm.compare import pairs, trace; pairs.WORKER_MIN_BYTES = trace._WARM_MIN_BYTES = 1 << 62; "
               "from detllm.cli import entry; sys.argv[0] = 'detllm'; entry()")


def _pair_folders(root: Path, args: argparse.Namespace, drift: float) -> tuple[Path, Path, tuple[int, int]]:
    """The pair under root/(planted|drifted), generated unless an earlier --keep run left it there."""
    where = root / ("drifted" if drift else "planted")
    planted = (args.prompts // 2, args.tokens * 7 // 10)
    stamp = where / f"{args.prompts}x{args.tokens}x{args.top_k}"
    if stamp.exists():
        return where / "left", where / "right", planted
    shutil.rmtree(where, ignore_errors=True)
    t = time.perf_counter()
    left, right, planted = make_pair(where, args.prompts, args.tokens, args.top_k, drift=drift)
    stamp.touch()
    print(f"generated 2 x {args.prompts} prompts x {args.tokens} tokens x top-{args.top_k} "
          f"({(left / artifacts.TRACE).stat().st_size / 1e6:.0f} MB per trace{', every logprob drifted by 1e-7' if drift else ''}) "
          f"in {time.perf_counter() - t:.1f} s; planted divergence at {planted}")
    return left, right, planted


def _case(name: str, argv: list[str], repeat: int, expect: tuple[int, int] | None) -> None:
    """Two cores (as shipped) and one process, alternated; best and median wall, best CPU, the ratio."""
    walls: dict[str, list[float]] = {"two cores": [], "one process": []}
    cpus: dict[str, list[float]] = {"two cores": [], "one process": []}
    found = None
    for _ in range(repeat):
        for mode, cmd in (("two cores", [sys.executable, "-m", "detllm", *argv]),
                          ("one process", [sys.executable, "-c", ONE_PROCESS, *argv])):
            times, proc = _time(cmd, 1)
            if proc.returncode not in (0, 1):
                raise SystemExit(f"{name}: exit {proc.returncode}: {proc.stderr[-2000:]}")
            walls[mode] += times
            cpus[mode] += CPU
            if "--json" in argv:
                d = json.loads(proc.stdout)["first_divergence"]
                found = (d["prompt_index"], d["token_index"], d["kind"]) if d else None
    if expect is not None:
        assert found is not None and found[:2] == expect, (found, expect)
    two, one = walls["two cores"], walls["one process"]
    print(f"{name}: best {min(two):.2f} s (median {statistics.median(two):.2f}, CPU {min(cpus['two cores']):.2f} s) | "
          f"one process {min(one):.2f} s (CPU {min(cpus['one process']):.2f} s) | one / two {min(one) / min(two):.2f}x"
          + (f"; first divergence {found}" if found else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--top-k", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cases", type=int, default=6, help="time only the first N of the 6 cases (1: the planted flip alone)")
    ap.add_argument("--keep", type=Path, help="generate into this folder and keep it (a later run reuses it)")
    args = ap.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="detllm-bench-diff-"))
    try:
        left, right, planted = _pair_folders(root, args, 0.0)
        cases = [("diff, one planted flip", ["diff", str(left), str(right), "--json"], planted),
                 ("diff --out (writes report.json/.txt/.md)",
                  ["diff", str(left), str(right), "--out", str(root / "diff"), "--force"], None)]
        for name, argv, expect in cases[:args.cases]:
            _case(name, argv, args.repeat, expect)
        if args.cases <= len(cases):
            return 0
        # the other extreme: every logprob drifted by 1e-7 (batch or engine numerics), no record byte-identical
        left, right, _ = _pair_folders(root, args, 1e-7)
        drifted = [(f"diff {' '.join(extra)}, every record drifted", ["diff", str(left), str(right), "--json", *extra],
                    planted if "--atol" in extra or extra[1] == "1" else (0, 0))
                   for extra in (["--tier", "1"], ["--tier", "2"], ["--tier", "2", "--atol", "1e-6"])]
        drifted.append(("diff --tier 2 --out, every record drifted (a 2.5 MB report.json, validated)",
                        ["diff", str(left), str(right), "--tier", "2", "--out", str(root / "diff_drifted"), "--force"], None))
        for name, argv, expect in drifted[:args.cases - len(cases)]:
            _case(name, argv, args.repeat, expect)
        return 0
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
