"""Compare two selections of trace records: align by prompt, find divergences, measure drift.

The one comparison engine behind `check` (run vs run, batch vs batch) and `diff`
(folder vs folder). Reads records only, never a backend. Pairs whose payloads are
byte-identical (compare/trace.py) are settled without parsing them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

from .divergence import first_divergence, first_token_difference
from .divergence import noise_floor as dtype_noise_floor
from .trace import payload_shape, same_output


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


def _pair_drift(a: dict[str, Any], b: dict[str, Any], identical: bool) -> tuple[dict[str, Any], list[float], int] | None:
    """Drift of one aligned prompt over the steps both sides generated from the same
    context: (per-prompt metrics, |dlogprob| per step, steps with top-k on both sides),
    or None without logprobs.

    max |dlogprob| covers steps where both chose the same token; top-k overlap and
    argmax flips also cover the first divergent step, whose context is still shared."""
    if identical:
        shape = payload_shape(a)  # type: ignore[arg-type]
        if shape is not None:
            n, has_lp, has_top = shape
            if not has_lp:
                return None
            return ({"prompt_index": a["prompt_index"], "steps": n, "max_abs_logprob_diff": 0.0,
                     "mean_topk_overlap": 1.0 if has_top and n else None, "argmax_flips": 0}, [0.0] * n,
                    n if has_top else 0)
    la, lb = a.get("logprobs"), b.get("logprobs")
    if la is None or lb is None or a["input_ids_sha256"] != b["input_ids_sha256"]:
        return None
    ia, ib = a["token_ids"], b["token_ids"]
    tok = first_token_difference(ia, ib)
    same = min(len(la), len(lb), len(ia) if tok is None else tok)
    shared = same + 1 if tok is not None and tok < min(len(ia), len(ib)) else same
    per_step = [0.0 if x == y else (abs(float(x) - float(y)) if x is not None and y is not None else float("inf"))
                for x, y in zip(la[:same], lb[:same])]
    ta, tb = a.get("top_logprobs") or [], b.get("top_logprobs") or []
    overlap, counted, flips = 0.0, 0, 0
    for i in range(min(shared, len(ta), len(tb))):
        if ta[i] and tb[i]:
            ids_a, ids_b = [t[0] for t in ta[i]], [t[0] for t in tb[i]]
            overlap += len(set(ids_a) & set(ids_b)) / max(len(ids_a), len(ids_b))
            counted += 1
            flips += ids_a[0] != ids_b[0]
    finite = [d for d in per_step if d != float("inf")]
    return ({"prompt_index": a["prompt_index"], "steps": shared, "max_abs_logprob_diff": max(finite, default=0.0),
             "mean_topk_overlap": overlap / counted if counted else None, "argmax_flips": flips}, per_step, counted)


def drift(pairs: list[tuple[dict, dict]], identical: set[int] | None = None) -> dict[str, Any]:
    """Logprob drift over aligned steps up to each prompt's first token divergence:
    per prompt, overall, and the largest |dlogprob| at each generated-token position.
    `identical` holds the indexes (into pairs) of byte-identical pairs."""
    identical = identical or set()
    per_prompt, by_position = [], []
    overlap_sum, overlap_n = 0.0, 0
    for k, (a, b) in enumerate(pairs):
        got = _pair_drift(a, b, k in identical)
        if got is None:
            continue
        p, per_step, counted = got
        per_prompt.append(p)
        if len(by_position) < len(per_step):
            by_position.extend([0.0] * (len(per_step) - len(by_position)))
        if p["max_abs_logprob_diff"] > 0.0:  # else every step is 0.0 and changes no maximum
            for i, d in enumerate(per_step):
                if d > by_position[i] and d != float("inf"):
                    by_position[i] = d
        if counted:
            overlap_sum += p["mean_topk_overlap"] * counted
            overlap_n += counted
    if not per_prompt:
        return {"available": False}
    return {
        "available": True,
        "steps": sum(p["steps"] for p in per_prompt),
        "max_abs_logprob_diff": max(p["max_abs_logprob_diff"] for p in per_prompt),
        "mean_topk_overlap": overlap_sum / overlap_n if overlap_n else None,
        "argmax_flips": sum(p["argmax_flips"] for p in per_prompt),
        "per_prompt": per_prompt,
        "max_abs_logprob_diff_by_position": by_position,
    }


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
) -> dict[str, Any]:
    """A `comparison` object (schemas/report.schema.json#/$defs/comparison).
    `dtype` is shorthand for noise_floor=divergence.noise_floor(dtype)."""
    if noise_floor is None and dtype is not None:
        noise_floor = dtype_noise_floor(dtype)
    pairs, left_only, right_only = align(left, right)
    divs: list[dict[str, Any]] = []
    identical: set[int] = set()
    for k, (a, b) in enumerate(pairs):
        if same_output(a, b) and a["input_ids_sha256"] == b["input_ids_sha256"]:
            identical.add(k)
            continue
        d = first_divergence(a, b, comparison=name, left_label=left_label, right_label=right_label,
                             check_logprobs=check_logprobs, atol=atol, noise_floor=noise_floor)
        if d is not None:
            divs.append(d)
    divs.sort(key=lambda d: (d["prompt_index"], d["token_index"]))
    diverged = bool(divs) or bool(left_only) or bool(right_only)
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
        "drift": drift(pairs, identical),
    }
