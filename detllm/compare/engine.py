"""Compare two selections of trace records: align by prompt, find divergences, measure drift.

The one comparison engine behind `check` (run vs run, batch vs batch) and `diff`
(folder vs folder). Reads records only, never a backend.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

from .divergence import first_divergence


def label(run_index: int, batch_size: int) -> str:
    return f"run_{run_index}@batch_{batch_size}"


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


def drift(pairs: list[tuple[dict, dict]], divergences: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Logprob drift over aligned steps before each prompt's first token divergence."""
    max_abs, steps, flips, overlap_sum, overlap_n = 0.0, 0, 0, 0.0, 0
    per_prompt = []
    have = False
    for a, b in pairs:
        la, lb = a.get("logprobs"), b.get("logprobs")
        if la is None or lb is None:
            continue
        have = True
        d = divergences.get(a["prompt_index"])
        stop = d["token_index"] if d is not None and d["kind"] in ("token", "length", "input_ids") else min(len(la), len(lb))
        stop = min(stop, len(la), len(lb))
        p_max = 0.0
        ta, tb = a.get("top_logprobs") or [], b.get("top_logprobs") or []
        for i in range(stop):
            if la[i] is not None and lb[i] is not None:
                p_max = max(p_max, abs(float(la[i]) - float(lb[i])))
            if i < len(ta) and i < len(tb) and ta[i] and tb[i]:
                ia, ib = [t[0] for t in ta[i]], [t[0] for t in tb[i]]
                overlap_sum += len(set(ia) & set(ib)) / max(len(ia), len(ib))
                overlap_n += 1
                flips += ia[0] != ib[0]
        steps += stop
        max_abs = max(max_abs, p_max)
        per_prompt.append({"prompt_index": a["prompt_index"], "steps": stop, "max_abs_logprob_diff": p_max})
    if not have:
        return {"available": False}
    return {
        "available": True,
        "steps": steps,
        "max_abs_logprob_diff": max_abs,
        "mean_topk_overlap": overlap_sum / overlap_n if overlap_n else None,
        "argmax_flips": flips,
        "per_prompt": per_prompt,
    }


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
    dtype: str | None = None,
) -> dict[str, Any]:
    """A `comparison` object (schemas/report.schema.json#/$defs/comparison)."""
    pairs, left_only, right_only = align(left, right)
    divs: dict[int, dict[str, Any]] = {}
    for a, b in pairs:
        d = first_divergence(a, b, comparison=name, left_label=left_label, right_label=right_label,
                             check_logprobs=check_logprobs, atol=atol, dtype=dtype)
        if d is not None:
            divs[a["prompt_index"]] = d
    ordered = sorted(divs.values(), key=lambda d: (d["prompt_index"], d["token_index"]))
    diverged = bool(ordered) or bool(left_only) or bool(right_only)
    status = "PASS" if not diverged else ("FAIL" if required else "INFO")
    out = {
        "name": name,
        "kind": kind,
        "left": left_label,
        "right": right_label,
        "required": required,
        "status": status,
        "prompts_compared": len(pairs),
        "prompts_diverged": len(ordered),
        "first_divergence": ordered[0] if ordered else None,
        "divergences": ordered,  # every diverged prompt's first divergence
        "unmatched": {
            "left_only": [r["prompt_index"] for r in left_only],
            "right_only": [r["prompt_index"] for r in right_only],
        },
        "drift": drift(pairs, divs),
    }
    return out
