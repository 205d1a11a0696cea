"""`check --negative-control` and the sensitivity line: was the check able to fail at all?

Owns the one deliberately non-invariant setting run after a check's own runs (each prompt
re-generated in a batch of fillers, last, so its batch company and padding differ from every
batch the check ran), its comparison with the check's batch-1 records, and the summary of any
drift seen anywhere in a check. Runs inside the runner's determinism context on the same backend.
"""

from __future__ import annotations

from typing import Any

CONTROL_BATCH = 8  # the control's batch size, capped by what the backend was started for (llama.cpp slots)


def control_batches(n_prompts: int, size: int) -> list[list[int]]:
    """Each prompt last in a batch of `size`: fillers (index < 0) first, then the prompt."""
    return [[-(k + 1) for k in range(size - 1)] + [i] for i in range(n_prompts)]


def negative_control(config, backend, caps, prompts, input_ids, filler_ids, records) -> dict[str, Any]:
    """Generate the control and compare it with run 0 at batch 1 (else at the base batch size)."""
    from ..compare.engine import compare, select
    from ..runner import _record, batch_requests

    size = min(CONTROL_BATCH, getattr(backend, "slots", CONTROL_BATCH) or CONTROL_BATCH)
    setting = f"each prompt last in a batch of {size} (fillers first)"
    if caps.batch_invariant:
        return {"ran": False, "setting": None, "differed": None,
                "note": "the backend enforces batch invariance, so batch company is no longer a non-invariant setting; "
                        "no other one can be changed in-process"}
    if size < 2:
        return {"ran": False, "setting": None, "differed": None,
                "note": f"the backend was started for batches of 1 ({config.backend} slots); add --vary-batch to allow a batch control"}
    ref_batch = 1 if any(r["batch_size"] == 1 for r in records) else config.batch_size
    ref = select(records, run=0, batch=ref_batch)
    got = []
    for batch in control_batches(len(prompts.texts), size):
        reqs = batch_requests(prompts, batch, input_ids, filler_ids)
        gens = backend.generate(reqs, config.decoding, seed=config.seed, n_logprobs=config.logprobs, logprobs=caps.logprobs)
        got.append(_record(config, prompts, batch[-1], input_ids[batch[-1]], gens[-1], 0, size, size - 1))
    comp = compare(ref, got, name=f"negative control vs batch {ref_batch}", kind="batch", left_label=f"run_0@batch_{ref_batch}",
                   right_label=f"control@batch_{size}", required=False, check_logprobs=True, atol=0.0)
    drift = comp["drift"]
    lp = drift.get("max_abs_logprob_diff") if drift.get("available") else None
    tokens = sum(1 for d in comp["divergences"] if d["kind"] in ("token", "length"))
    differed = comp["status"] != "PASS"
    return {"ran": True, "setting": setting, "batch_size": size, "differed": differed, "prompts": comp["prompts_compared"],
            "prompts_differed": comp["prompts_diverged"], "token_divergences": tokens, "max_abs_logprob_diff": lp,
            "note": "" if differed else "the control did not differ either: the prompts and tokens were too few to expose variance"}


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


def _logprob_figure(lp: float | None) -> str:
    """What was measured of the logprobs, in words: a 0 is said as "none moved", never printed as a figure."""
    if lp is None:
        return "logprobs not compared"
    if lp == 0.0:
        return "tokens diverged; no logprob moved before them"
    return f"max |dlogprob| {lp:.3g}"


def sensitivity_line(sens: dict[str, Any], control: dict[str, Any] | None) -> list[str]:
    """The report's lines: the sensitivity, and the negative control's verdict when one ran."""
    if sens["drift_observed"]:
        lines = [f"sensitivity: drift observed in {', '.join(sens['where'])} ({_logprob_figure(sens['max_abs_logprob_diff'])})"]
    elif sens["max_abs_logprob_diff"] is None:
        lines = ["sensitivity: no drift observed anywhere (no token moved in any comparison; logprobs not compared)"]
    else:
        lines = ["sensitivity: no drift observed anywhere (no token and no logprob moved in any comparison)"]
    if control is not None:
        if not control["ran"]:
            lines.append(f"negative control: not run: {control['note']}")
        elif control["differed"]:
            lines.append(f"negative control: {control['setting']} differed as it should "
                         f"({control['prompts_differed']}/{control['prompts']} prompts, {_logprob_figure(control['max_abs_logprob_diff'])})")
        else:
            lines.append(f"negative control: {control['setting']} did not differ: the prompts/tokens were too few to expose "
                         "variance, so this verdict says little")
    return lines
