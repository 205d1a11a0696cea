"""Which divergences each cause can produce, and the ranking rule that follows: a cause whose
difference can produce none of the divergences seen (each diverged prompt's first divergence,
prompts on one side only) ranks below every cause that can, and says why (`evidence.cannot_explain`). The table is docs/causes.md "What each cause can explain".
Finds no cause itself (the detectors do) and orders nothing else (codes.rank).
"""

from __future__ import annotations

from typing import Any

from ..engine import align
from .sides import Side

# What a comparison's first divergence is, as a cause sees it:
#   input_ids  the same prompt was fed as different input ids
#   token      a different token from the same context
#   logprob    the same tokens, the logprobs differ
#   stop       one side ended (EOS or a stop string: a token choice) where the other went on
#   limit      one side ended because it reached its --max-new-tokens, where the other went on
#   unmatched  prompts on one side only (no aligned divergence)
NUMERIC = ("token", "logprob", "stop")  # what a different computation of the same request can change
CAN_EXPLAIN: dict[str, tuple[str, ...]] = {
    "MODEL_MISMATCH": NUMERIC,  # weights and model config compute the logits; they never cut generation off
    "TOKENIZER_MISMATCH": ("input_ids", *NUMERIC),
    "PROMPT_MISMATCH": ("unmatched",),
    "CONFIG_MISMATCH": ("input_ids", *NUMERIC, "limit"),  # per field: CONFIG_FIELDS
    "BACKEND_MISMATCH": ("input_ids", *NUMERIC, "limit"),  # another engine tokenizes, computes and limits its own way
    "ENV_MISMATCH": ("input_ids", *NUMERIC),  # library versions include the tokenizer's
    "RUN_VARIANCE": NUMERIC,
    "BATCH_VARIANCE": NUMERIC,
    "CACHE_VARIANCE": NUMERIC,
    "PROCESS_VARIANCE": NUMERIC,
}
# run_config fields that can produce fewer kinds than CONFIG_MISMATCH as a whole
CONFIG_FIELDS: dict[str, tuple[str, ...]] = {
    "config.decoding.max_new_tokens": ("limit",),  # where generation is cut off, at the smaller of the two only
    "config.seed": NUMERIC,  # only where the run sampled: greedy decoding draws no random number
}
_SAY = {
    "input_ids": "the prompt fed as different input ids",
    "token": "a different token from the same context",
    "logprob": "the same tokens with different logprobs",
    "stop": "one side stopping (EOS or a stop string) where the other went on",
    "limit": "one side reaching its --max-new-tokens where the other went on",
    "unmatched": "prompts compared with nothing",
    "length": "one side ending where the other went on",
}


def seen(comp: dict[str, Any], left_records: list[dict[str, Any]] | None,
         right_records: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """{kind, token_index} of every diverged prompt's first divergence in the comparison (a `length`
    one told apart as stop or limit by the finish reason of the side that ended), then `unmatched`
    when prompts sit on one side only; empty when the comparison shows none."""
    divs = comp.get("divergences")
    divs = divs if divs is not None else [d for d in (comp.get("first_divergence"),) if d is not None]
    finish: dict[int, tuple[Any, Any]] = {}
    if any(d["kind"] == "length" for d in divs) and left_records is not None and right_records is not None:
        finish = {a["prompt_index"]: (a.get("finish_reason"), b.get("finish_reason")) for a, b in align(left_records, right_records)[0]}
    out = []
    for d in divs:
        kind = d["kind"]
        if kind == "length":
            ended = finish.get(d["prompt_index"], (None, None))[0 if d["left"]["token_id"] is None else 1]
            kind = "limit" if ended == "length" else "stop" if ended == "stop" else "length"  # length: not known which
        out.append({"kind": kind, "token_index": d["token_index"]})
    unmatched = comp.get("unmatched") or {}
    if unmatched.get("left_only") or unmatched.get("right_only"):
        out.append({"kind": "unmatched", "token_index": None})
    return out


def _kinds(code: str, evidence: dict[str, Any], sampled: bool) -> set[str]:
    if code != "CONFIG_MISMATCH":
        return set(CAN_EXPLAIN.get(code, ()))
    out: set[str] = set()
    for f in evidence.get("fields", []) + evidence.get("applied", []):
        kinds = CONFIG_FIELDS.get(f["field"], CAN_EXPLAIN[code])
        out |= set() if f["field"] == "config.seed" and not sampled else set(kinds)
    return out


def _explains(code: str, evidence: dict[str, Any], kinds: set[str], at: dict[str, Any]) -> bool:
    kind, step = at["kind"], at["token_index"]
    if kind == "length":  # the side that ended is not known: either way
        return bool(kinds & {"stop", "limit"})
    if kind == "limit" and code == "CONFIG_MISMATCH" and kinds == {"limit"}:  # only --max-new-tokens differs
        return any(isinstance(f["left"], int) and isinstance(f["right"], int) and step == min(f["left"], f["right"])
                   for f in evidence.get("fields", []) if f["field"] == "config.decoding.max_new_tokens")
    return kind in kinds


def cannot_explain(code: str, evidence: dict[str, Any], divergences: list[dict[str, Any]], sampled: bool) -> str | None:
    """Why this cause can produce none of the divergences seen; None when it can produce one (or none was seen)."""
    kinds = _kinds(code, evidence, sampled)
    if not divergences or any(_explains(code, evidence, kinds, at) for at in divergences):
        return None
    at = divergences[0]
    if code == "CONFIG_MISMATCH":
        what = ("the settings that differ can produce only " + " or ".join(_SAY[k] for k in sorted(kinds)) if kinds
                else "only the seed differs, and greedy decoding draws no random number")
        if at["kind"] in kinds:
            what = "only --max-new-tokens differs, and it ends generation where the smaller of the two values ends"
    else:
        what = {"MODEL_MISMATCH": "a model difference changes the logits, never how a prompt is tokenized or where generation is cut off",
                "TOKENIZER_MISMATCH": "a tokenizer difference changes the input ids, never where generation is cut off",
                "PROMPT_MISMATCH": "prompts on one side only are compared with nothing",
                "ENV_MISMATCH": "the environment changes how the same request is computed, never where generation is cut off",
                }.get(code, "a difference in how the same request was computed changes tokens and logprobs only")
    where = f" (token {at['token_index']})" if at["token_index"] is not None else ""
    others = f", as are the other {len(divergences) - 1} seen" if len(divergences) > 1 else ""
    if len({d["kind"] for d in divergences}) > 1:
        others = f"; the others seen are {' or '.join(sorted({_SAY.get(d['kind'], d['kind']) for d in divergences[1:]}))}"
    return f"the first divergence{where} is {_SAY.get(at['kind'], 'a length difference')}{others}: {what}"


def judge(causes: list[dict[str, Any]], comp: dict[str, Any], left: Side, right: Side) -> None:
    """Mark each cause that can produce none of the comparison's divergences (evidence.cannot_explain)."""
    at = seen(comp, left.records, right.records)
    d = comp.get("first_divergence") or {}
    sampled = (d.get("magnitude") or {}).get("label") == "sampled_step" or any(
        ((s.run_config or {}).get("config", {}).get("decoding") or {}).get("temperature", 0) > 0 for s in (left, right))
    for c in causes:
        why = cannot_explain(c["code"], c["evidence"], at, sampled)
        if why is not None:
            c["evidence"]["cannot_explain"] = why
