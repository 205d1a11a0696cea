"""Compare two selections of trace records: align by prompt, find divergences, measure drift.

The one comparison engine behind `check` (run vs run, batch vs batch) and `diff`
(folder vs folder). Reads records only, never a backend. Pairs whose payloads are
byte-identical (compare/trace.py) are settled without parsing them.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from typing import Any, Iterable

from .divergence import LABELS, first_divergence, first_token_difference
from .divergence import noise_floor as dtype_noise_floor
from .represent import comparable
from .steps import abs_diff, finite
from .trace import fast_path, payload_shape, same_output, use_fast_path


def label(run_index: int, batch_size: int) -> str:
    return f"run_{run_index}@batch_{batch_size}"


def parse_label(text: str) -> tuple[int, int]:
    """(run_index, batch_size) from a label() string."""
    run, _, batch = text.rpartition("::")[2].partition("@")
    return int(run.removeprefix("run_")), int(batch.removeprefix("batch_"))


def select(records: Iterable[dict[str, Any]], *, run: int | None = None, batch: int | None = None) -> list[dict[str, Any]]:
    return [r for r in records if (run is None or r["run_index"] == run) and (batch is None or r["batch_size"] == batch)]


def align(left: list[dict[str, Any]], right: list[dict[str, Any]]) -> tuple[list[tuple[dict, dict]], list[dict], list[dict]]:
    """Pair records by (prompt_id, occurrence), not by line order.
    Returns (pairs in left order, left-only records, right-only records)."""

    def keyed(recs: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
        seen: dict[str, int] = defaultdict(int)
        out = {}
        for r in sorted(recs, key=lambda r: r["prompt_index"]):
            out[(r["prompt_id"], seen[r["prompt_id"]])] = r
            seen[r["prompt_id"]] += 1
        return out

    lk, rk = keyed(left), keyed(right)
    pairs = [(lk[k], rk[k]) for k in lk if k in rk]
    return pairs, [lk[k] for k in lk if k not in rk], [rk[k] for k in rk if k not in lk]


# ------------------------------------------------------------------ drift


def _kl_topk(ta: list[list[Any]], tb: list[list[Any]]) -> float | None:
    """KL(left || right) of one step's top-k distributions: the left's top-k ids, each side
    renormalised over them; an id below the right's top-k takes the right's k-th logprob
    (an upper bound). None when a value is missing."""
    db = {t[0]: finite(t[1]) for t in tb}
    kth = min((v for v in db.values() if v is not None), default=None)
    p, q = [], []
    for tid, lp in ta:
        x, y = finite(lp), db.get(tid, kth)
        if x is None or y is None:
            return None
        p.append(x)
        q.append(y)
    if not p:
        return None
    # numpy's exp and log, not math's (they round differently in ~5% of cases): compare/fast.py
    # computes the same sums on arrays (kl_rows), and both paths must give the same report
    import numpy as np

    exp, log = np.exp, np.log
    zp, zq = float(log(sum(exp(x) for x in p))), float(log(sum(exp(y) for y in q)))
    return max(0.0, float(sum(exp(x - zp) * ((x - zp) - (y - zq)) for x, y in zip(p, q))))


def _pair_drift(a: dict[str, Any], b: dict[str, Any], identical: bool) -> tuple[dict[str, Any], list[float], int, list[float]] | None:
    """Drift of one aligned prompt over the steps both sides generated from the same
    context: (per-prompt metrics, |dlogprob| per step, steps with top-k on both sides,
    KL per top-k step), or None without logprobs. The per-step values are a list, or a numpy
    array from compare/fast.py (drift() aggregates either).

    max |dlogprob| covers steps where both chose the same token; top-k overlap, argmax
    flips and KL also cover the first divergent step, whose context is still shared."""
    if identical:
        shape = payload_shape(a)  # type: ignore[arg-type]
        if shape is not None:
            n, has_lp, has_top = shape
            if not has_lp:
                return None
            return ({"prompt_index": a["prompt_index"], "steps": n, "max_abs_logprob_diff": 0.0,
                     "mean_topk_overlap": 1.0 if has_top and n else None, "argmax_flips": 0, "tokens_equal": True},
                    [], n if has_top else 0, [])
    if hasattr(a, "payload") and hasattr(b, "payload"):  # compare/fast.py Views: the same on arrays
        from .fast import pair_drift

        return pair_drift(a, b)  # type: ignore[arg-type]
    la, lb = a.get("logprobs"), b.get("logprobs")
    if la is None or lb is None or a["input_ids_sha256"] != b["input_ids_sha256"]:
        return None
    ia, ib = a["token_ids"], b["token_ids"]
    tok = first_token_difference(ia, ib)
    same = min(len(la), len(lb), len(ia) if tok is None else tok)
    shared = same + 1 if tok is not None and tok < min(len(ia), len(ib)) else same
    per_step = [0.0 if x == y else abs_diff(x, y) for x, y in zip(la[:same], lb[:same])]
    ta, tb = a.get("top_logprobs") or [], b.get("top_logprobs") or []
    overlap, counted, flips, kls = 0.0, 0, 0, []
    for i in range(min(shared, len(ta), len(tb))):
        if ta[i] and tb[i]:
            ids_a, ids_b = [t[0] for t in ta[i]], [t[0] for t in tb[i]]
            overlap += len(set(ids_a) & set(ids_b)) / max(len(ids_a), len(ids_b))
            counted += 1
            flips += ids_a[0] != ids_b[0]
            kl = 0.0 if ta[i] == tb[i] else _kl_topk(ta[i], tb[i])
            if kl is not None:
                kls.append(kl)
    finite_steps = [d for d in per_step if d != float("inf")]
    equal = tok is None
    return ({"prompt_index": a["prompt_index"], "steps": shared, "max_abs_logprob_diff": max(finite_steps, default=0.0),
             "mean_topk_overlap": overlap / counted if counted else None, "argmax_flips": flips, "tokens_equal": equal},
            per_step, counted, kls)


_QUANTILES = (50, 90, 99)


def _rank(q: float, n: int) -> int:
    return max(1, math.ceil(q / 100.0 * n))


def _percentile(nonzero: Any, zeros: int, q: float) -> float:
    """Nearest-rank percentile of `zeros` zeros plus the `nonzero` values, sorted (or, an array,
    partitioned at the ranks of _QUANTILES: the same order statistics without a full sort)."""
    rank = _rank(q, zeros + len(nonzero))
    return 0.0 if rank <= zeros else float(nonzero[rank - zeros - 1])


def _order(nonzero: Any, zeros: int) -> Any:
    """nonzero, ready for _percentile: a list sorted, an array partitioned at the ranks it needs."""
    if isinstance(nonzero, list):
        nonzero.sort()
        return nonzero
    n = zeros + len(nonzero)
    at = sorted(i for i in {_rank(q, n) - zeros - 1 for q in _QUANTILES} if 0 <= i < len(nonzero))
    if at:
        nonzero.partition(at)  # in place: each of these positions holds what a sort would put there
    return nonzero


def _quarters(by_position: list[float]) -> list[dict[str, Any]]:
    """How a drift grows: the largest |dlogprob| in each quarter of the generated positions."""
    n = len(by_position)
    cuts = sorted({0, *(round(n * k / 4) for k in (1, 2, 3)), n})
    return [{"from": lo, "to": hi - 1, "max_abs_logprob_diff": max(by_position[lo:hi])} for lo, hi in zip(cuts, cuts[1:]) if hi > lo]


def drift(pairs: list[tuple[dict, dict]], identical: set[int] | None = None, measured: dict[int, Any] | None = None) -> dict[str, Any]:
    """Logprob drift over aligned steps up to each prompt's first token divergence:
    per prompt, overall, and the largest |dlogprob| at each generated-token position;
    distribution measures (same top-1 share, KL of the top-k distributions, percentiles of
    |dlogprob|); and the prompts whose tokens are all equal while their logprobs differ.
    `identical` holds the indexes (into pairs) of byte-identical pairs: they add zeros
    without being walked; `measured` the pairs already measured as arrays (pairs.settle),
    whose KL list may come summed as (count, sum(), max()), computed where it was measured."""
    identical = identical or set()
    measured = measured or {}
    per_prompt, by_position = [], []
    overlap_sum, overlap_n, kl_sum, kl_n, kl_max = 0.0, 0, 0.0, 0, 0.0
    nonzero: list[float] = []
    zeros = 0
    equal_drift: list[tuple[dict[str, Any], list[float]]] = []  # tokens equal, logprobs differ
    arrays = _Steps()  # per-step |dlogprob| the fast path gives as arrays, aggregated with numpy
    for k, (a, b) in enumerate(pairs):
        got = measured[k] if k in measured else _pair_drift(a, b, k in identical)
        if got is None:
            continue
        p, per_step, counted, kls = got
        per_prompt.append(p)
        n_steps = p["steps"] if k in identical else len(per_step)  # an identical pair's steps are all zeros
        if len(by_position) < n_steps:
            by_position.extend([0.0] * (n_steps - len(by_position)))
        if p["max_abs_logprob_diff"] > 0.0 and not isinstance(per_step, list):  # compare/fast.py: an array
            arrays.add(per_step)
            zeros += len(per_step) - arrays.count_nonzero(per_step)
            if p["tokens_equal"]:
                equal_drift.append((p, per_step))
        elif p["max_abs_logprob_diff"] > 0.0:  # else every step is 0.0 and changes no maximum
            for i, d in enumerate(per_step):
                if d > by_position[i] and d != float("inf"):
                    by_position[i] = d
            found = [d for d in per_step if d != 0.0 and d != float("inf")]
            nonzero += found
            zeros += len(per_step) - len(found)
            if p["tokens_equal"]:
                equal_drift.append((p, per_step))
        else:
            zeros += n_steps
        if counted:
            overlap_sum += p["mean_topk_overlap"] * counted
            overlap_n += counted
            n_kl, total, top = kls if isinstance(kls, tuple) else (len(kls), sum(kls), max(kls, default=0.0))
            kl_n += counted if k in identical else n_kl
            kl_sum += total
            kl_max = max(kl_max, top)
    if not per_prompt:
        return {"available": False}
    nonzero = _order(arrays.merge(nonzero, by_position), zeros)
    flips = sum(p["argmax_flips"] for p in per_prompt)
    return {
        "available": True,
        "steps": sum(p["steps"] for p in per_prompt),
        "max_abs_logprob_diff": max(p["max_abs_logprob_diff"] for p in per_prompt),
        "mean_topk_overlap": overlap_sum / overlap_n if overlap_n else None,
        "argmax_flips": flips,
        "same_top1_share": (overlap_n - flips) / overlap_n if overlap_n else None,
        "kl_topk": {"mean": kl_sum / kl_n, "max": kl_max} if kl_n else None,
        "abs_logprob_diff_percentiles": ({f"p{q}": _percentile(nonzero, zeros, q) for q in _QUANTILES}
                                         if zeros + len(nonzero) else None),
        "per_prompt": per_prompt,
        "max_abs_logprob_diff_by_position": by_position,
        "tokens_equal_logprobs_differ": _equal_drift(equal_drift),
    }


def _first_nonzero(steps: Any) -> int:
    if isinstance(steps, list):
        return next(i for i, d in enumerate(steps) if d != 0.0)
    import numpy as np

    return int(np.flatnonzero(steps)[0])


class _Steps:
    """Per-step |dlogprob| arrays (compare/fast.py), aggregated as the list code does: the largest
    finite value at each position, and the nonzero finite values (max and sort are exact, so
    the report is the same to the last bit). numpy is imported only when an array comes."""

    def __init__(self) -> None:
        self.top: Any = None  # the largest value at each position so far (0.0 where none)
        self.found: list[Any] = []  # each array's nonzero finite values

    def add(self, steps: Any) -> None:
        import numpy as np

        finite_steps = np.isfinite(steps)
        if not finite_steps.all():
            steps = np.where(finite_steps, steps, 0.0)  # inf changes no maximum and is not a value
        if self.top is None or len(self.top) < len(steps):
            top = np.zeros(len(steps))
            if self.top is not None:
                top[:len(self.top)] = self.top
            self.top = top
        np.maximum(self.top[:len(steps)], steps, out=self.top[:len(steps)])
        self.found.append(steps[steps != 0.0])

    def count_nonzero(self, steps: Any) -> int:
        """How many of `steps` (the array just added) are nonzero and finite."""
        return len(self.found[-1])

    def merge(self, nonzero: list[float], by_position: list[float]) -> Any:
        """Fold the arrays' maxima into by_position (in place); nonzero plus the arrays' values
        (a numpy array when there were arrays, sorted by the caller)."""
        if self.top is None:
            return nonzero
        import numpy as np

        for i, d in enumerate(self.top.tolist()):
            if d > by_position[i]:
                by_position[i] = d
        return np.concatenate([np.array(nonzero, dtype=np.float64), *self.found])


def _equal_drift(found: list[tuple[dict[str, Any], list[float]]]) -> dict[str, Any] | None:
    """"Tokens equal, logprobs differ": how many prompts, how large, where it starts, how it grows."""
    if not found:
        return None
    starts = [(_first_nonzero(steps), p["prompt_index"]) for p, steps in found]
    first_step, first_prompt = min(starts)
    width = max(len(steps) for _, steps in found)
    by_pos = [0.0] * width  # the largest finite |dlogprob| at each position (all are >= 0)
    arrays = _Steps()
    for _, steps in found:  # one pass over each prompt's steps, not one per position
        if not isinstance(steps, list):
            arrays.add(steps)
            continue
        for i, d in enumerate(steps):
            if d > by_pos[i] and d != float("inf"):
                by_pos[i] = d
    arrays.merge([], by_pos)
    return {"prompts": len(found), "max_abs_logprob_diff": max(p["max_abs_logprob_diff"] for p, _ in found),
            "first": {"prompt_index": first_prompt, "token_index": first_step}, "growth": _quarters(by_pos)}


_drift = drift  # compare() takes a `drift` flag


# ------------------------------------------------------------------ comparison


def compare(
    left: list[dict[str, Any]],
    right: list[dict[str, Any]],
    *,
    name: str,
    kind: str,
    left_label: str,
    right_label: str,
    required: bool,
    check_logprobs: bool,
    atol: float = 0.0,
    noise_floor: float | None = None,
    dtype: str | None = None,
    sampled: bool = False,
    drift: bool = True,
) -> dict[str, Any]:
    """A `comparison` object (schemas/report.schema.json#/$defs/comparison).
    `dtype` is shorthand for noise_floor=divergence.noise_floor(dtype); `sampled`: the
    tokens were sampled (temperature > 0), which changes how a flip is judged.
    `drift=False` skips the drift aggregation, for a caller that needs only the status,
    the divergences and the causes (rederive.py): drift is then {"available": False} and
    the magnitude's label comes from the divergences alone (never tokens_equal_logprobs_differ)."""
    if noise_floor is None and dtype is not None:
        noise_floor = dtype_noise_floor(dtype)
    pairs, left_only, right_only = align(left, right)
    pairs = comparable(pairs)  # like with like: token strings vs ids, unknown input ids (represent.py)
    divs: list[dict[str, Any]] = []
    identical: set[int] = set()
    jobs: list[int] = []  # differing pairs with large payloads read from disk: as arrays when there are a few
    for k, (a, b) in enumerate(pairs):
        if same_output(a, b) and a["input_ids_sha256"] == b["input_ids_sha256"]:
            identical.add(k)
        elif fast_path(a, b):
            jobs.append(k)
    if not use_fast_path(len(jobs)):
        jobs = []
        spare = sys.modules.get(__package__ + ".spare")  # loaded only where a large trace started a spare worker
        if spare is not None:
            spare.drop()
    fast = set(jobs)
    for k, (a, b) in enumerate(pairs):
        if k in identical or k in fast:
            continue
        d = first_divergence(a, b, comparison=name, left_label=left_label, right_label=right_label,
                             check_logprobs=check_logprobs, atol=atol, noise_floor=noise_floor, sampled=sampled)
        if d is not None:
            divs.append(d)
    measured: dict[int, Any] = {}  # pair index -> fast.pair_drift's result, for drift()
    if jobs:  # compare/pairs.py settles them (on two cores when they are many), compare/fast.py reads them
        from .pairs import Spec, settle_pairs

        spec = Spec(name, left_label, right_label, check_logprobs, atol, noise_floor, sampled, drift)
        for k, (viewed, d, pd) in settle_pairs(pairs, jobs, spec).items():
            if d is not None:
                divs.append(d)
            if viewed and drift:
                measured[k] = pd
    divs.sort(key=lambda d: (d["prompt_index"], d["token_index"]))
    diverged = bool(divs) or bool(left_only) or bool(right_only)
    moved = [(a, b) for a, b in pairs if a["prompt_index"] != b["prompt_index"]]
    dr = _drift(pairs, identical, measured) if drift else {"available": False}
    return {
        "name": name,
        "kind": kind,
        "left": left_label,
        "right": right_label,
        "required": required,
        "status": "PASS" if not diverged else ("FAIL" if required else "INFO"),
        "logprobs_compared": check_logprobs,
        "atol": atol,
        "prompts_compared": len(pairs),
        "prompts_diverged": len(divs),
        "prompts": [a["prompt_index"] for a, _ in pairs],  # every aligned prompt, by its left index
        "first_divergence": divs[0] if divs else None,
        "divergences": divs,  # every diverged prompt's first divergence, by prompt index
        "unmatched": {
            "left_only": [r["prompt_index"] for r in left_only],
            "right_only": [r["prompt_index"] for r in right_only],
        },
        # aligned prompts at different positions in the two prompt sets (alignment is by content)
        "prompts_moved": {"count": len(moved), "examples": [
            {"prompt_id": a["prompt_id"], "left_index": a["prompt_index"], "right_index": b["prompt_index"]} for a, b in moved[:5]]},
        "magnitude": comparison_magnitude(divs, dr),
        "drift": dr,
    }


def comparison_magnitude(divs: list[dict[str, Any]], dr: dict[str, Any]) -> dict[str, Any]:
    """The comparison's magnitude label (its first divergence's, or tokens_equal_logprobs_differ
    when only the logprobs moved, or identical) and how many divergences carry each label."""
    counts: dict[str, int] = defaultdict(int)
    for d in divs:
        counts[d["magnitude"]["label"]] += 1
    if divs:
        label = divs[0]["magnitude"]["label"]
    elif dr.get("available") and (dr.get("tokens_equal_logprobs_differ") or dr.get("max_abs_logprob_diff")):
        label = "tokens_equal_logprobs_differ"
    else:
        label = "identical"
    return {"label": label, "counts": dict(counts)}


def report_magnitude(comps: list[dict[str, Any]]) -> dict[str, Any]:
    """A report's magnitude: the label of its first failing comparison (else of the most severe
    comparison), and the labels' counts over every comparison."""
    counts: dict[str, int] = defaultdict(int)
    for c in comps:
        for k, n in c["magnitude"]["counts"].items():
            counts[k] += n
    failing = [c for c in comps if c["status"] == "FAIL"]
    if failing:
        label = failing[0]["magnitude"]["label"]
    else:
        label = min((c["magnitude"]["label"] for c in comps), key=LABELS.index, default="identical")
    return {"label": label, "counts": dict(counts)}
