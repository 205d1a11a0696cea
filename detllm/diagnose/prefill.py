"""Prefill vs decode: re-score a generated sequence teacher-forced (the whole sequence as one
prompt) and compare each position's logprob with the one seen while decoding token by token.

Owns the comparison and, in a probe worker, running it on the real engine through the
backends' `score()`. A difference is the train/inference mismatch RL users hit, or the KV-cache
path difference between prompt processing and token generation; it is not a run or batch effect.
"""

from __future__ import annotations

from typing import Any

from ..compare.steps import abs_diff
from ..core.config import RunConfig


def compare_scores(decoded: list[float], scored: list[float], *, atol: float = 0.0) -> dict[str, Any]:
    """max |d| over positions and the first position where |d| > atol (None: none differs)."""
    # the one NaN rule (compare/steps.py): a null on one side only differs, and stays out of max and mean
    diffs = [abs_diff(a, b) for a, b in zip(decoded, scored)]
    first = next((i for i, d in enumerate(diffs) if d > atol), None)
    finite = [d for d in diffs if d != float("inf")]
    return {"positions": len(diffs), "max_abs_logprob_diff": max(finite, default=0.0), "first_differing_position": first,
            "mean_abs_logprob_diff": sum(finite) / len(finite) if finite else 0.0, "null_logprob_positions": len(diffs) - len(finite)}


def run_prefill_probe(config: RunConfig, job: dict[str, Any]) -> dict[str, Any]:
    """Worker side: decode each prompt alone (batch 1), then score prompt + generated tokens in
    one pass, and compare the chosen tokens' logprobs position by position."""
    from ..backends.registry import create_backend
    from ..backends.base import Request
    from ..core.prompts import load_prompts

    prompts = load_prompts(job.get("prompts"))
    with create_backend(config) as backend:
        if not getattr(backend, "can_score", False):
            return {"available": False, "reason": f"backend {config.backend!r} cannot score a given sequence"}
        caps = backend.capabilities()
        if not caps.logprobs:
            return {"available": False, "reason": f"backend {config.backend!r} returns no logprobs"}
        per_prompt = []
        with backend.determinism(tier=min(job["tier"], caps.max_tier), seed=config.seed, threads=config.threads):
            for i, text in enumerate(prompts.texts):
                ids = tuple(backend.tokenize(text))
                gen = backend.generate([Request(i, ids, text, prompts.ids[i], 0)], config.decoding, seed=config.seed,
                                       n_logprobs=config.logprobs, logprobs=True)[0]
                if not gen.token_ids:
                    continue
                scored = backend.score(list(ids), list(gen.token_ids))
                per_prompt.append({"prompt_index": i, **compare_scores(list(gen.logprobs or []), scored, atol=config.atol)})
    if not per_prompt:
        return {"available": False, "reason": "no prompt generated any token"}
    firsts = [p["first_differing_position"] for p in per_prompt if p["first_differing_position"] is not None]
    return {
        "available": True,
        "method": getattr(backend, "score_method", ""),
        "prompts": len(per_prompt),
        "positions": sum(p["positions"] for p in per_prompt),
        "max_abs_logprob_diff": max(p["max_abs_logprob_diff"] for p in per_prompt),
        "first_differing_position": min(firsts) if firsts else None,
        "prompts_differing": len(firsts),
        "per_prompt": per_prompt,
    }
