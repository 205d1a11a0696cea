"""The numbers of `detllm parity`, from logprob lists alone (no torch, no engine): per path, the
per-token |Δlogprob| against the trainer, and the same gap in the terms RL trainers log, the
importance ratio r = exp(logp_trainer − logp_engine) and the k3 mismatch KL. parity.py computes
them once; verify re-derives them from a sealed parity.json with the same functions.
"""

from __future__ import annotations

import math
from typing import Any

from ..compare.steps import abs_diff

RATIO_BAND = (0.99, 1.01)  # the share of tokens whose r falls outside it is reported
KL_DIRECTION = ("KL(engine || trainer): the rollout tokens come from the engine, r = p_trainer/p_engine, "
                "k3 = r - 1 - log r per token, averaged; over a greedy rollout it is the figure RL tools log, "
                "not an unbiased estimate")


def rl_terms(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    """The importance ratio and k3 mismatch KL over (trainer, engine) logprob pairs with finite
    values: r's max and min, the share of tokens with r outside RATIO_BAND, mean(r − 1 − log r)."""
    logs = [t - e for t, e in pairs if math.isfinite(t) and math.isfinite(e)]
    if not logs:
        return {"tokens": 0, "ratio_max": None, "ratio_min": None, "ratio_outside_share": None, "mismatch_kl_k3": None}
    # r - 1 - log r with log r = d: expm1(d) - d keeps its precision where d is ~1e-6 (exp(d) - 1 would round it away)
    k3 = [max(0.0, math.expm1(d) - d) for d in logs]
    lo, hi = RATIO_BAND
    outside = sum(1 for d in logs if not lo <= math.exp(d) <= hi)
    return {"tokens": len(logs), "ratio_max": math.exp(max(logs)), "ratio_min": math.exp(min(logs)),
            "ratio_outside_share": outside / len(logs), "mismatch_kl_k3": sum(k3) / len(k3)}


def compare_path(trainer: list[list[float]], engine: list[list[float] | None], *, atol: float) -> dict[str, Any]:
    """Per-token |Δlogprob| of one engine path against the trainer over every sequence: positions,
    bitwise-equal positions, max/mean |Δ|, the first position (sequence, position) with |Δ| > atol,
    and the RL terms (`rl`)."""
    n = eq = 0
    worst, total, first = 0.0, 0.0, None
    pairs: list[tuple[float, float]] = []
    for s, (tr, en) in enumerate(zip(trainer, engine)):
        if en is None:
            continue
        for p, (x, y) in enumerate(zip(tr, en)):
            d = abs_diff(x, y)
            n += 1
            eq += x == y and math.isfinite(x)
            if x is not None and y is not None:
                pairs.append((x, y))
            if math.isfinite(d):
                worst, total = max(worst, d), total + d
            if d > atol and (first is None or p < first["position"]):
                first = {"sequence": s, "position": p, "trainer": x, "engine": y, "abs_diff": d if math.isfinite(d) else None}
    return {"available": True, "positions": n, "bitwise_equal_positions": eq, "bitwise_equal": n > 0 and eq == n,
            "max_abs_diff": worst, "mean_abs_diff": total / n if n else 0.0, "first_difference": first, "rl": rl_terms(pairs)}


def verdict_of(paths: dict[str, Any]) -> str:
    """PASS when at least one path was compared and none has a difference beyond atol."""
    ran = [p for p in paths.values() if p["available"]]
    return "PASS" if ran and all(p["first_difference"] is None for p in ran) else "FAIL"


__all__ = ["KL_DIRECTION", "RATIO_BAND", "compare_path", "rl_terms", "verdict_of"]
