"""`check --negative-control`: was the check able to fail at all?

Owns the one deliberately non-invariant setting run after a check's own runs (each prompt
re-generated in a batch of fillers, last, so its batch company and padding differ from every
batch the check ran) and its comparison with the check's batch-1 records. Runs inside the
runner's determinism context on the same backend. The sensitivity summary that reads its result
is the verdict's (compare/verdict.py); its lines are the renderers' (render/text.py).
"""

from __future__ import annotations

from typing import Any

from .batching import batch_requests, trace_record

CONTROL_BATCH = 8  # the control's batch size, capped by what the backend was started for (llama.cpp slots)


def control_batches(n_prompts: int, size: int) -> list[list[int]]:
    """Each prompt last in a batch of `size`: fillers (index < 0) first, then the prompt."""
    return [[-(k + 1) for k in range(size - 1)] + [i] for i in range(n_prompts)]


def negative_control(config, backend, caps, prompts, input_ids, filler_ids, records) -> dict[str, Any]:
    """Generate the control and compare it with run 0 at batch 1 (else at the base batch size)."""
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
    from ..compare.engine import compare, select  # only a check with --negative-control compares here

    ref = select(records, run=0, batch=ref_batch)
    got = []
    for batch in control_batches(len(prompts.texts), size):
        reqs = batch_requests(prompts, batch, input_ids, filler_ids)
        gens = backend.generate(reqs, config.decoding, seed=config.seed, n_logprobs=config.logprobs, logprobs=caps.logprobs)
        got.append(trace_record(config, prompts, batch[-1], input_ids[batch[-1]], gens[-1], 0, size, size - 1))
    comp = compare(ref, got, name=f"negative control vs batch {ref_batch}", kind="batch", left_label=f"run_0@batch_{ref_batch}",
                   right_label=f"control@batch_{size}", required=False, check_logprobs=True, atol=0.0)
    drift = comp["drift"]
    lp = drift.get("max_abs_logprob_diff") if drift.get("available") else None
    tokens = sum(1 for d in comp["divergences"] if d["kind"] in ("token", "length"))
    differed = comp["status"] != "PASS"
    return {"ran": True, "setting": setting, "batch_size": size, "differed": differed, "prompts": comp["prompts_compared"],
            "prompts_differed": comp["prompts_diverged"], "token_divergences": tokens, "max_abs_logprob_diff": lp,
            "note": "" if differed else "the control did not differ either: the prompts and tokens were too few to expose variance"}
