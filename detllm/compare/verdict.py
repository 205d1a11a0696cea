"""Turn the comparisons of a `check` into a report: which are required at the tier,
PASS/FAIL, the ranked causes with evidence, the first divergence.

Within one check folder nothing recorded differs between runs, so a failing
repeat is RUN_VARIANCE and a failing batch size is BATCH_VARIANCE.
"""

from __future__ import annotations

from typing import Any

from ..artifacts import stamp
from .engine import compare, label, select


def check_comparisons(records: list[dict[str, Any]], *, base_batch: int, runs: int, batch_sizes: tuple[int, ...],
                      tier: int, atol: float, dtype: str | None) -> list[dict[str, Any]]:
    """Each repeat against run 0 at the base batch size; each other batch size against batch size 1."""
    comps = []
    ref = select(records, run=0, batch=base_batch)
    for r in range(1, runs):
        comps.append(compare(ref, select(records, run=r, batch=base_batch), name=f"run_{r} vs run_0 @ batch {base_batch}",
                             kind="run", left_label=label(0, base_batch), right_label=label(r, base_batch),
                             required=tier >= 1, check_logprobs=tier >= 2, atol=atol, dtype=dtype))
    one = select(records, run=0, batch=1)
    for b in batch_sizes:
        if b == 1:
            continue
        # tokens must agree across batch sizes from tier 1; logprobs only where tier 3 promises invariance
        comps.append(compare(one, select(records, run=0, batch=b), name=f"batch {b} vs batch 1",
                             kind="batch", left_label=label(0, 1), right_label=label(0, b),
                             required=tier >= 1, check_logprobs=tier >= 3, atol=atol, dtype=dtype))
        if tier == 2:
            info = compare(one, select(records, run=0, batch=b), name=f"batch {b} vs batch 1 (logprobs)",
                           kind="batch", left_label=label(0, 1), right_label=label(0, b),
                           required=False, check_logprobs=True, atol=atol, dtype=dtype)
            if info["status"] != "PASS":
                comps.append(info)
    return comps


def causes_for(comps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    causes = []
    for kind, code in (("run", "RUN_VARIANCE"), ("batch", "BATCH_VARIANCE")):
        failing = [c for c in comps if c["kind"] == kind and c["status"] == "FAIL"]
        if failing:
            d = failing[0]["first_divergence"]
            evidence: dict[str, Any] = {
                "comparisons": [c["name"] for c in failing],
                "prompts_diverged": sum(c["prompts_diverged"] for c in failing),
                "first": None if d is None else {"prompt_index": d["prompt_index"], "token_index": d["token_index"],
                                                 "kind": d["kind"], "near_tie": d["near_tie"]},
            }
            if code == "RUN_VARIANCE":
                evidence["recorded_differences"] = "none: same process, config, model, environment and batch size"
            else:
                evidence["batch_sizes"] = sorted({int(c["right"].rsplit("_", 1)[1]) for c in failing} | {1})
            causes.append({"code": code, "evidence": evidence})
    return causes


def check_report(comps: list[dict[str, Any]], *, tier_requested: int, tier_effective: int, summary: dict[str, Any]) -> dict[str, Any]:
    failing = [c for c in comps if c["status"] == "FAIL"]
    causes = causes_for(comps)
    if tier_effective == 0:
        status, category = "RECORDED", "RECORDED"
    elif failing:
        status, category = "FAIL", causes[0]["code"]
    else:
        status, category = "PASS", "PASS"
    first = failing[0]["first_divergence"] if failing else None
    return stamp("report", {
        "command": "check",
        "status": status,
        "category": category,
        "tier": {"requested": tier_requested, "effective": tier_effective},
        "causes": causes,
        "first_divergence": first,
        "comparisons": comps,
        "summary": summary,
    })
