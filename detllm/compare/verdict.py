"""Turn the comparisons of a `check` into a report: which are required at the tier,
PASS/FAIL, the ranked causes with evidence, the first divergence.

Causes come from compare/causes/, the same engine `diff` uses, run on the compared
records: within one check folder the configuration is the same for every run, but
what each record says about how it was computed (cached prompt tokens, the server's
batch, a fresh process) can differ, and then it is the cause, not RUN_VARIANCE.
`runner` and `rederive` (verify) both call check_comparisons then check_report with
the same records: one path to the verdict.
"""

from __future__ import annotations

from typing import Any

from ..runfolder.artifacts import stamp
from .causes import Side, explain, merge, merge_batch_sizes
from .engine import compare, label, parse_label, report_magnitude, select


def check_comparisons(records: list[dict[str, Any]], *, base_batch: int, runs: int, batch_sizes: tuple[int, ...],
                      tier: int, atol: float, floor: float | None, fresh: frozenset[int] = frozenset(),
                      sampled: bool = False, drift: bool = True) -> list[dict[str, Any]]:
    """Each repeat against run 0 at the base batch size; each other batch size against batch size 1.
    `fresh`: the repeats that ran in a new process (fresh.py); each comparison says which kind it is.
    `drift=False`: no drift aggregation (engine.compare), for a caller that needs only the verdict."""
    comps = []
    ref = select(records, run=0, batch=base_batch)
    for r in range(1, runs):
        where = " (fresh process)" if r in fresh else ""
        comp = compare(ref, select(records, run=r, batch=base_batch), name=f"run_{r}{where} vs run_0 @ batch {base_batch}",
                       kind="run", left_label=label(0, base_batch), right_label=label(r, base_batch),
                       required=tier >= 1, check_logprobs=tier >= 2, atol=atol, noise_floor=floor, sampled=sampled,
                       drift=drift)
        comp["repeat"] = "fresh-process" if r in fresh else "in-process"
        comps.append(comp)
    if 1 not in batch_sizes:
        return comps  # no --vary-batch: only repeats were run, at one batch size
    one = select(records, run=0, batch=1)
    for b in batch_sizes:
        if b == 1:
            continue
        # tokens must agree across batch sizes from tier 1; logprobs only where tier 3 promises invariance
        comps.append(compare(one, select(records, run=0, batch=b), name=f"batch {b} vs batch 1",
                             kind="batch", left_label=label(0, 1), right_label=label(0, b),
                             required=tier >= 1, check_logprobs=tier >= 3, atol=atol, noise_floor=floor, sampled=sampled,
                             drift=drift))
        if tier == 2:
            info = compare(one, select(records, run=0, batch=b), name=f"batch {b} vs batch 1 (logprobs)",
                           kind="batch", left_label=label(0, 1), right_label=label(0, b),
                           required=False, check_logprobs=True, atol=atol, noise_floor=floor, sampled=sampled,
                           drift=drift)
            if info["status"] != "PASS":
                comps.append(info)
    return comps


def _side(text: str, records: list[dict[str, Any]] | None) -> Side:
    run, batch = parse_label(text)
    chosen = None if records is None else select(records, run=run, batch=batch)
    return Side(label=text, run_index=run, batch_size=batch, records=chosen)


def causes_for(comps: list[dict[str, Any]],
               records: list[dict[str, Any]] | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(causes of the failing comparisons, info from those that differed where the tier
    does not require agreement), merged by code. A passing comparison adds nothing: its
    batch size differs by design. `records`: the compared trace records, whose per-record
    facts (server cache and batch, fresh process) are compared too; None: not at hand."""
    causes, info = [], []
    for c in comps:
        if c["status"] == "PASS":
            continue
        got, extra = explain(c, _side(c["left"], records), _side(c["right"], records))
        causes += got
        info += extra
    causes = merge(causes)
    return causes, _fold(causes, merge(info))


def _fold(causes: list[dict[str, Any]], info: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each code once: an info entry whose code is also a cause (at tier 2 a batch size whose tokens
    FAILed is compared again on logprobs, INFO, and finds BATCH_VARIANCE too) becomes that cause's
    `evidence.not_required`: the comparisons the tier does not require, their diverged prompts and
    first divergence. The rest of the info is returned."""
    by_code = {c["code"]: c for c in causes}
    kept = []
    for entry in info:
        cause, ev = by_code.get(entry["code"]), entry["evidence"]
        if cause is None:
            kept.append(entry)
            continue
        cause["evidence"]["not_required"] = {k: ev[k] for k in ("comparisons", "prompts_diverged", "first") if k in ev}
        merge_batch_sizes(cause["evidence"], ev)
    return kept


def _repeat_kinds(causes: list[dict[str, Any]], comps: list[dict[str, Any]]) -> None:
    """Say which kind of repeat diverged (RUN_VARIANCE), and that a vary-batch size ran once
    (BATCH_VARIANCE: run variance at that size is not ruled out)."""
    by_name = {c["name"]: c for c in comps}
    for cause in causes:
        ev, named = cause["evidence"], [by_name[n] for n in cause["evidence"].get("comparisons", []) if n in by_name]
        if cause["code"] == "RUN_VARIANCE":
            kinds = sorted({c["repeat"] for c in named if "repeat" in c})
            if kinds:
                ev["repeats"] = kinds
        elif cause["code"] == "BATCH_VARIANCE":
            sizes = sorted({parse_label(c["right"])[1] for c in named if c["kind"] == "batch"})
            if sizes:
                ev["not_repeated"] = f"batch or run variance at batch {', '.join(map(str, sizes))} (not repeated)"


def check_report(comps: list[dict[str, Any]], *, tier_requested: int, tier_effective: int, summary: dict[str, Any],
                 scope: str | None = None, control: dict[str, Any] | None = None,
                 records: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """`records`: the trace records `comps` compared (their per-record facts can be causes; the runner
    and verify's re-derivation pass the same). `control`: the --negative-control result (control.py);
    every check report says whether any drift was observed anywhere (`sensitivity`), so a PASS shows
    whether it could have failed."""
    failing = [c for c in comps if c["status"] == "FAIL"]
    causes, info = causes_for(comps, records)
    _repeat_kinds(causes, comps)
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
        "info": info,
        "first_divergence": first,
        "comparisons": comps,
        "summary": summary,
        "magnitude": report_magnitude(comps),
        **({"scope": scope} if scope else {}),
        "sensitivity": sensitivity(comps, control),
        **({"negative_control": control} if control is not None else {}),
    })


def sensitivity(comps: list[dict[str, Any]], control: dict[str, Any] | None) -> dict[str, Any]:
    """Whether any drift was observed anywhere in a check: tokens or logprobs, required or not.
    `max_abs_logprob_diff` is over the steps whose logprobs were compared (up to each prompt's first
    token divergence); null when no comparison compared any, never a 0 that was not measured."""
    where, worst = [], None
    for c in comps:
        dr = c.get("drift") or {}
        lp = dr.get("max_abs_logprob_diff") if dr.get("available") else None
        if lp is not None:
            worst = max(worst or 0.0, lp)
        if c["status"] != "PASS" or (lp or 0.0) > 0.0:
            where.append(c["name"])
    if control and control.get("ran"):
        if control.get("max_abs_logprob_diff") is not None:
            worst = max(worst or 0.0, control["max_abs_logprob_diff"])
        if control["differed"]:
            where.append("negative control")
    return {"drift_observed": bool(where), "max_abs_logprob_diff": worst, "where": where}
