"""`detllm locate` on smollm2-135m (hf, in-process): test-only perturbations named, and what it costs.

One clean run, then for each case a run with `--opt perturb=MODULE:output|weight:REL` (recorded in its
config, so locate's re-run applies it on that side only), a check that the perturbation moved the
logits, and `locate clean perturbed`. Prints per case: named or not, the op named, re-runs per side,
peak captured bytes per side and wall time; then the totals. Optionally the batch-variance case
(check --vary-batch 1,8 --tier 2, locate batch_1 vs batch_8) at the end. `--graft-cost N`: the graft's
extra cost instead: for N cases, locate with --graft off, right (the default) and both, each timed.
`--cost PAIRS`: both costs side by side on batch 1 vs 8 (the capture overhead that locate records, the
graft's extra wall and CPU), PAIRS alternated pairs of --graft off / right, medians, the load average.
`--cost PAIRS --base COMMIT`: the capture overhead before and after instead: `detllm locate` (its defaults,
`--graft off`) in a fresh process per locate, alternated between a worktree of COMMIT and this tree, on one
check folder; per tree the medians of the re-runs with and without capture (cost.rerun_seconds, both sides),
the overhead, and the whole locate's wall and CPU (os.wait4).

    .venv/bin/python benchmarks/bench_locate.py [--model smollm2-135m] [--cases 20] [--ops] [--reference]
        [--batch] [--graft-cost N] [--cost PAIRS [--base COMMIT]] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import detllm
from detllm.locate import locate
from detllm.locate.sides import compared_tier, first_step, load, resolve

PROMPT = ["The capital of France is"]


# hf's module kinds to perturb (bench_locate_vllm.py passes vLLM's)
KINDS = [("input_layernorm", "output"), ("self_attn.o_proj", "output"), ("mlp.act_fn", "output"),
         ("mlp.down_proj", "weight"), ("self_attn.v_proj", "weight"), ("mlp.up_proj", "output"),
         ("post_attention_layernorm", "weight"), ("self_attn.q_proj", "weight"), ("mlp.gate_proj", "weight"),
         ("self_attn", "output")]


def cases(layers: int, n: int, kinds: list[tuple[str, str]] = KINDS) -> list[tuple[str, str]]:
    """n (module, target) pairs spread over the layers: outputs and weights of each kind of module
    ("" is the decoder layer itself)."""
    out = [("model.embed_tokens", "output"), ("model.norm", "output")]
    i = 0
    while len(out) < n:
        kind, target = kinds[i % len(kinds)]
        layer = f"model.layers.{(i * 7) % layers}"
        out.append((f"{layer}.{kind}" if kind else layer, target))
        i += 1
    return out[:n]


def perturbation_rows(run: dict, tmp: Path, specs: list[tuple[str, str]], named: Callable[[str, str], bool],
                      **locate_kw) -> list[dict]:
    """Against the clean run in tmp/clean: per (module, target) a perturbed run, a check that it moved
    the logits, and `locate clean perturbed`; prints a line per case and returns the rows."""
    rows = []
    for n, (module, target) in enumerate(specs):
        spec = f"{module}:{target}:1e-3"
        moved = tmp / f"p{n}"
        detllm.run(**run, out=moved, options={"perturb": spec})
        left, right = load(*resolve(str(tmp / "clean"), str(moved))[:2])
        if first_step(left, right, tier=compared_tier(left, right)) is None:
            print(f"{spec:<58} did not move the logits: skipped")
            continue
        t = time.perf_counter()
        doc = locate(str(tmp / "clean"), str(moved), out=tmp / f"l{n}", **locate_kw).doc
        wall = time.perf_counter() - t
        op = (doc["first_bitwise_op"] or {}).get("module", "-")
        hit = named(op, module)
        cost = doc["cost"]
        rows.append({"spec": spec, "named": hit, "op": op, "reruns": cost["reruns"], "peak_bytes": cost["peak_captured_bytes"],
                     "seconds": wall})
        print(f"{spec:<58} {'NAMED' if hit else 'MISSED':<6} {op:<50} re-runs {cost['reruns']['left']}/{cost['reruns']['right']}"
              f"  peak {max(cost['peak_captured_bytes'].values()) / 2**20:6.2f} MB  {wall:5.2f} s")
    return rows


def summary(rows: list[dict]) -> str:
    """The totals line over the case rows."""
    return (f"\n{sum(r['named'] for r in rows)}/{len(rows)} named; re-runs per side max "
            f"{max(max(r['reruns'].values()) for r in rows)}; peak captured max "
            f"{max(max(r['peak_bytes'].values()) for r in rows) / 2**20:.2f} MB (bound 512 MB); wall per locate median "
            f"{statistics.median(r['seconds'] for r in rows):.2f} s, max {max(r['seconds'] for r in rows):.2f} s")


def graft_cost(run: dict, tmp: Path, specs: list[tuple[str, str]], **locate_kw) -> list[dict]:
    """Per case: locate's wall time with --graft off, right and both (the same perturbed run, engines
    loaded anew each time as a user's locate does), the graft's own seconds and its outcome."""
    rows = []
    for n, (module, target) in enumerate(specs):
        moved = tmp / f"g{n}"
        detllm.run(**run, out=moved, options={"perturb": f"{module}:{target}:1e-3"})
        row: dict = {"spec": f"{module}:{target}:1e-3"}
        for mode in ("off", "right", "both"):
            t = time.perf_counter()
            doc = locate(str(tmp / "clean"), str(moved), out=tmp / f"g{n}{mode}", graft=mode, **locate_kw).doc
            row[mode] = time.perf_counter() - t
            g = doc.get("graft") or {}
            row[f"{mode}_graft_s"] = g.get("seconds", 0.0)
            row[f"{mode}_outcome"] = (g.get("into_right") or {}).get("outcome", "-")
        rows.append(row)
        print(f"{row['spec']:<58} off {row['off']:5.2f} s  right {row['right']:5.2f} s (graft {row['right_graft_s']:.2f} s, "
              f"{row['right_outcome']})  both {row['both']:5.2f} s (graft {row['both_graft_s']:.2f} s)")
    if rows:
        med = {m: statistics.median(r[m] for r in rows) for m in ("off", "right", "both")}
        share = statistics.median(r["right_graft_s"] / (r["right"] - r["right_graft_s"]) for r in rows)  # within one locate
        print(f"\nmedian wall per locate: off {med['off']:.2f} s, right {med['right']:.2f} s "
              f"({100 * (med['right'] / med['off'] - 1):+.0f}%), both {med['both']:.2f} s ({100 * (med['both'] / med['off'] - 1):+.0f}%); "
              f"the graft's own re-run, within the same locate: median +{100 * share:.0f}% over the rest of it")
    return rows


def cost_pairs(model: str, tmp: Path, pairs: int, **locate_kw) -> dict:
    """Both costs in one run, on check --vary-batch 1,8 of `model` (the issue's batch 1 vs 8 case):
    `pairs` alternated pairs of locate --graft off and --graft right (the order swapped each pair),
    each timed in wall and CPU (user + sys of this process); the capture overhead is what each locate
    records in cost.rerun_seconds (its re-runs with capture against the same re-runs without)."""
    import os

    folder = tmp / "cost"
    detllm.check(backend="hf", model=model, max_new_tokens=2, tier=2, runs=2, vary_batch=(1, 8), out=folder)
    load0 = os.getloadavg()
    got: dict[str, list] = {"off": [], "right": []}
    over: list[dict] = []
    for i in range(pairs):
        for mode in (("off", "right") if i % 2 == 0 else ("right", "off")):
            w, c = time.perf_counter(), time.process_time()
            doc = locate(f"{folder}::batch_1", f"{folder}::batch_8", out=tmp / f"c{i}{mode}", force=True, graft=mode,
                         **locate_kw).doc
            got[mode].append((time.perf_counter() - w, time.process_time() - c, (doc.get("graft") or {}).get("seconds")))
            over.append(doc["cost"].get("rerun_seconds") or {})
            print(f"pair {i} graft {mode:<5} wall {got[mode][-1][0]:6.2f} s  cpu {got[mode][-1][1]:6.2f} s  "
                  f"capture overhead {_pct(over[-1], 'wall')} wall, {_pct(over[-1], 'cpu')} cpu")
    med = {m: (statistics.median(r[0] for r in got[m]), statistics.median(r[1] for r in got[m])) for m in got}
    ov = {u: statistics.median(o["overhead"][u] for o in over if o and o["overhead"].get(u) is not None) for u in ("wall", "cpu")}
    res = {"model": model, "pairs": pairs, "load_before": load0, "load_after": os.getloadavg(), "median": med, "capture_overhead": ov,
           "graft_extra": {u: med["right"][i] / med["off"][i] - 1 for i, u in enumerate(("wall", "cpu"))}}
    print(f"\n{model}, batch 1 vs 8, {pairs} alternated pair(s); load average {load0[0]:.1f} before, {res['load_after'][0]:.1f} after")
    print(f"capture overhead (re-runs with capture / without - 1, median of {len(over)} locates): "
          f"{100 * ov['wall']:+.0f}% wall, {100 * ov['cpu']:+.0f}% cpu   (target <= +50%)")
    print(f"graft extra cost (locate --graft right / --graft off - 1, medians): {100 * res['graft_extra']['wall']:+.0f}% wall "
          f"({med['off'][0]:.2f} -> {med['right'][0]:.2f} s), {100 * res['graft_extra']['cpu']:+.0f}% cpu "
          f"({med['off'][1]:.2f} -> {med['right'][1]:.2f} s)   (target <= +25%)")
    own = [g / (w - g) for w, _, g in got["right"] if g]  # within one locate: less exposed to the load between locates
    if own:
        res["graft_within"] = statistics.median(own)
        print(f"the graft's own re-run (graft.seconds, wall) within the same locate: median {100 * res['graft_within']:+.0f}% over "
              f"the rest of it ({', '.join(f'{100 * v:+.0f}%' for v in own)})")
    return res


def cost_vs_base(model: str, tmp: Path, pairs: int, base: str) -> dict:
    """The capture overhead of `base` (a detached worktree) and of this tree, alternated: each locate a
    fresh `python -m detllm locate ... --graft off` with PYTHONPATH=<tree>, on one check folder made here."""
    import os
    import subprocess
    import sys

    here = Path(__file__).resolve().parent.parent
    folder = tmp / "cost"
    detllm.check(backend="hf", model=model, max_new_tokens=2, tier=2, runs=2, vary_batch=(1, 8), out=folder)
    wt = tmp / "base"
    made = subprocess.run(["git", "-C", str(here), "worktree", "add", "--detach", str(wt), base], capture_output=True, text=True)
    if made.returncode != 0:
        raise SystemExit(f"cannot check out {base}: {made.stderr.strip()}")
    trees, got = {"base": wt, "HEAD": here}, {"base": [], "HEAD": []}
    load0 = os.getloadavg()
    try:
        for i in range(pairs + 1):  # pair 0 warms both trees' bytecode and page cache: not counted
            for name in (("base", "HEAD") if i % 2 == 0 else ("HEAD", "base")):
                out = tmp / f"b{i}{name}"
                env = {**os.environ, "PYTHONPATH": str(trees[name])}
                t = time.perf_counter()
                proc = subprocess.Popen([sys.executable, "-m", "detllm", "locate", f"{folder}::batch_1", f"{folder}::batch_8",
                                         "--out", str(out), "--graft", "off"], cwd=trees[name], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                _, status, ru = os.wait4(proc.pid, 0)
                wall, cpu = time.perf_counter() - t, ru.ru_utime + ru.ru_stime
                if status != 0:
                    raise SystemExit(f"{name}: locate exited {status}: {proc.stderr.read().decode()[-2000:]}")
                doc = json.loads((out / "locate.json").read_text())
                rs = doc["cost"]["rerun_seconds"]
                row = {"wall": wall, "cpu": cpu, "op": (doc["first_bitwise_op"] or {}).get("module"),
                       **{k: [rs["left"][k][u] + rs["right"][k][u] for u in (0, 1)] for k in ("with_capture", "without_capture")}}
                row["overhead"] = [row["with_capture"][u] / row["without_capture"][u] - 1 for u in (0, 1)]
                print(f"{'warm-up' if i == 0 else f'pair {i}'} {name:<4} locate wall {wall:6.2f} s cpu {cpu:6.2f} s; re-runs without "
                      f"{row['without_capture'][0]:.2f}/{row['without_capture'][1]:.2f} s, with {row['with_capture'][0]:.2f}/"
                      f"{row['with_capture'][1]:.2f} s (wall/cpu): overhead {100 * row['overhead'][0]:+.0f}% wall, "
                      f"{100 * row['overhead'][1]:+.0f}% cpu; {row['op']}")
                if i:
                    got[name].append(row)
    finally:
        subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force", str(wt)], capture_output=True)
    load1 = os.getloadavg()
    med = {n: {k: [statistics.median(r[k][u] for r in rows) for u in (0, 1)] for k in ("without_capture", "with_capture", "overhead")}
           | {"locate": [statistics.median(r["wall"] for r in rows), statistics.median(r["cpu"] for r in rows)]}
           for n, rows in got.items()}
    print(f"\n{model}, batch 1 vs 8, {pairs} alternated pair(s), base {base} vs this tree; load average {load0[0]:.1f} before, "
          f"{load1[0]:.1f} after (medians; wall / cpu)")
    for n in ("base", "HEAD"):
        m = med[n]
        print(f"{n:<4}  re-runs without capture {m['without_capture'][0]:5.2f} / {m['without_capture'][1]:5.2f} s   with capture "
              f"{m['with_capture'][0]:5.2f} / {m['with_capture'][1]:5.2f} s   overhead {100 * m['overhead'][0]:+4.0f}% / "
              f"{100 * m['overhead'][1]:+4.0f}%   (target <= +50%)   locate {m['locate'][0]:5.2f} / {m['locate'][1]:5.2f} s")
    return {"model": model, "base": base, "pairs": pairs, "load_before": load0, "load_after": load1, "median": med, "runs": got}


def _pct(t: dict, unit: str) -> str:
    v = (t.get("overhead") or {}).get(unit)
    return "-" if v is None else f"{100 * v:+.0f}%"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--cases", type=int, default=20)
    ap.add_argument("--ops", action="store_true", help="descend into aten ops (a second re-run per side)")
    ap.add_argument("--reference", action="store_true", help="evaluate each op in float64 too (the tolerance)")
    ap.add_argument("--batch", action="store_true", help="also the batch-variance case (batch 1 vs 8)")
    ap.add_argument("--graft-cost", type=int, default=0, help="the graft's extra cost on this many cases (instead of the naming run)")
    ap.add_argument("--cost", type=int, default=0, metavar="PAIRS",
                    help="the capture overhead and the graft's extra cost on batch 1 vs 8, PAIRS alternated pairs (instead)")
    ap.add_argument("--base", metavar="COMMIT", help="with --cost: the capture overhead of COMMIT and of this tree, alternated")
    ap.add_argument("--json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_locate_"))
    if args.cost and args.base:
        res = cost_vs_base(args.model, tmp, args.cost, args.base)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2))
        return
    if args.cost:
        res = cost_pairs(args.model, tmp, args.cost)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2))
        return
    run = dict(backend="hf", model=args.model, max_new_tokens=2, tier=2, prompts=PROMPT)
    t0 = time.perf_counter()
    detllm.run(**run, out=tmp / "clean")
    print(f"model {args.model}: clean run {time.perf_counter() - t0:.1f} s (includes the load)")
    from detllm.backends.registry import create_backend
    from detllm.core.config import RunConfig

    layers = create_backend(RunConfig(backend="hf", model=args.model)).model.config.num_hidden_layers
    if args.graft_cost:
        rows = graft_cost(run, tmp, cases(layers, args.graft_cost), ops=args.ops, reference=args.reference)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return
    rows = perturbation_rows(run, tmp, cases(layers, args.cases), lambda op, module: op == module or op.startswith(module + "/"),
                             ops=args.ops, reference=args.reference)
    if rows:
        print(summary(rows) + f" (ops {'on' if args.ops else 'off'}, float64 reference {'on' if args.reference else 'off'})")
    if args.batch:
        folder = tmp / "batch"
        detllm.check(backend="hf", model=args.model, max_new_tokens=2, tier=2, runs=2, vary_batch=(1, 8), out=folder)
        t = time.perf_counter()
        doc = locate(f"{folder}::batch_1", f"{folder}::batch_8", out=tmp / "lb", ops=args.ops, reference=args.reference).doc
        print(f"\nbatch 1 vs 8: {doc['line']} ({time.perf_counter() - t:.1f} s, re-runs {doc['cost'].get('reruns')})")
        rows.append({"batch": doc["line"], "cost": doc["cost"]})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
