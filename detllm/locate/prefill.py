"""Prefill vs decode (`detllm locate FOLDER --prefill`): the two sides of one recorded prompt are
its recorded decode at step s and a prefill of prompt + generated tokens[:s] through the same
backend (prompt processing, the backend's own generate loop, one token), whose last position
predicts token s. s is the first step where the recorded token or logprob and that prefill's
differ (score()'s teacher-forced view, as diagnose's prefill probe, is recorded beside it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..backends.base import Request
from ..compare.causes import Side
from ..core.errors import UsageError
from .rerun import Rerun, attach, prepare, start


@dataclass
class PrefillStep:
    """The first step where the recorded decode and a prefill of the same tokens differ."""

    prompt_index: int
    prompt_id: str
    step: int
    decoded: float  # the recorded logprob of token s
    prefilled: float | None  # the prefill of prompt + tokens[:s]'s logprob of the token it chose
    token: int  # the recorded token s
    prefill_token: int | None  # the token that prefill chose
    scored: list[dict[str, Any]]  # per prompt scanned: steps scored, first differing step


def check(side: Side, tier: int) -> None:
    """Refused (before anything loads) when the side cannot be compared with its prefill."""
    if tier < 2:
        raise UsageError(f"{side.label} was recorded without logprobs (tier < 2, or a backend that returns none): "
                         "prefill vs decode compares the chosen tokens' logprobs", hint="record it with --tier 2 or 3")


def find_step(side: Side, prompt: int | None, seen: dict) -> tuple[Rerun, PrefillStep | None, list[dict[str, Any]]]:
    """Start the side's backend (model files checked first, exit 7) and prefill, prompt by prompt
    (`prompt`: that one only), prompt + tokens[:s] for s = 0, 1, ... until the prefill's token or
    logprob differs from the recorded decode's at s. Returns the decode side ready to re-run (its recorded
    batch), the step (None when every step agrees bitwise) and what was prefilled per prompt."""
    records = sorted(side.records or (), key=lambda r: r["prompt_index"])
    if prompt is not None:
        records = [r for r in records if r["prompt_index"] == prompt]
        if not records:
            raise UsageError(f"--prompt {prompt}: {side.label} holds no record of that prompt index")
    if not records:
        raise UsageError(f"{side.label} holds no record to compare with its prefill")
    first = prepare(side, records[0]["prompt_index"])
    start(first, seen)
    backend, cfg, found, scanned = first.backend, first.config, None, []
    assert backend is not None
    one = dataclasses.replace(cfg.decoding, max_new_tokens=1)
    try:
        with backend.determinism(tier=side.applied["tier_effective"], seed=cfg.seed, threads=cfg.threads):
            for rec in records:
                ids, toks, lps = list(rec["input_ids"]), list(rec["token_ids"]), rec.get("logprobs") or []
                at = None
                for s in range(min(len(toks), len(lps))):
                    req = Request(rec["prompt_index"], tuple(ids + toks[:s]), rec["prompt_text"], rec["prompt_id"], 0)
                    gen = backend.generate([req], one, seed=cfg.seed, n_logprobs=cfg.logprobs, logprobs=True)[0]
                    tok = gen.token_ids[0] if gen.token_ids else None
                    lp = gen.logprobs[0] if gen.logprobs else None
                    if tok != toks[s] or lp != lps[s]:
                        at = s
                        found = PrefillStep(rec["prompt_index"], rec["prompt_id"], s, lps[s], lp, toks[s], tok, scanned)
                        break
                scored = backend.score(ids, toks) if getattr(backend, "can_score", False) else None
                whole = None if scored is None else next((i for i, (x, y) in enumerate(zip(scored, lps)) if x != y), None)
                scanned.append({"prompt": rec["prompt_index"], "steps_prefilled": (at + 1) if at is not None else min(len(toks), len(lps)),
                                "first_differing_step": at, "score_first_differing_step": whole})
                if found is not None:
                    break
        if found is not None and found.prompt_index != records[0]["prompt_index"]:
            moved = prepare(side, found.prompt_index)
            attach(moved, backend)
            return moved, found, scanned  # the backend moves to the prompt's own batch
        return first, found, scanned
    except BaseException:
        backend.close()
        raise


def prefill_side(decode: Rerun, at: PrefillStep) -> Rerun:
    """The prefill side: prompt + tokens[:s] as one sequence of a batch of 1, captured at its
    prefill (step 0) through the decode side's backend (shared, closed with it)."""
    rec = decode.recorded[decode.row]
    ids = tuple(rec["input_ids"]) + tuple(rec["token_ids"][:at.step])
    req = Request(rec["prompt_index"], ids, rec["prompt_text"], rec["prompt_id"], decode.requests[decode.row].occurrence)
    side = Rerun(decode.side, decode.config, [req], 0, {}, fixed_step=0, own_check=lambda cap: differs(cap, at), in_pass_kv=True)
    assert decode.backend is not None
    attach(side, decode.backend, shared=True)
    return side


def differs(cap: Any, at: PrefillStep) -> str | None:
    """What the prefill capture's own generation changed from the scored prefill (token s and its
    logprob), or None: it computed the same prefill."""
    gen = cap.generations[0] if cap.generations else None
    if gen is None or not gen.token_ids:
        return "the prefill re-run generated nothing"
    lp = gen.logprobs[0] if gen.logprobs else None
    if gen.token_ids[0] != at.prefill_token or lp != at.prefilled:
        return (f"the capture's prefill gave token {gen.token_ids[0]} logprob {lp!r}, the same prefill before it token "
                f"{at.prefill_token} logprob {at.prefilled!r}")
    return None
