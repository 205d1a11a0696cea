"""KL divergence between two runs' next-token distributions, in llama-perplexity's terms.

Owns the numbers of `report --format kld`: which positions count (each prompt's steps up to and
including its first divergent token, where both contexts are still equal), the per-position
KLD, Δp and negative log-likelihoods over the shared top-k plus one "other" bucket, and the
statistics llama.cpp's `--kl-divergence` prints, computed with its formulas. Reads trace
records only; the text block is render/kld.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..core.errors import UsageError

# llama-perplexity skips the terms of the base distribution with log p <= -16 (perplexity.cpp, log_softmax)
MIN_BASE_LOGPROB = -16.0
# a probability the top-k lists leave at 0 (their listed mass rounds to >= 1) is taken as this, so logs stay finite
FLOOR = 1e-30
KLD_PERCENTILES = (0.999, 0.990, 0.950, 0.900, None, 0.100, 0.050, 0.010, 0.001)  # None: the median
P_DIFF_PERCENTILES = (0.999, 0.990, 0.950, 0.900, 0.750, None, 0.250, 0.100, 0.050, 0.010, 0.001)


@dataclass(frozen=True)
class Position:
    """One counted position. Base (P) is the left run, Q the right run; the reference token is
    the left run's chosen token."""

    kld: float  # KL(P || Q) over the shared tokens and the "other" bucket, in nats
    nll_base: float  # -ln P(reference token)
    nll: float  # -ln Q(reference token) (Q's "other" mass when Q did not list the token: an upper bound)
    p_diff: float  # Q(reference token) - P(reference token)
    same_top: bool  # both runs' most likely token (first of each top-k) is the same
    outside: bool  # the reference token is in neither Q's top-k nor Q's chosen token


def _known(top: Any, chosen_id: Any, chosen_lp: float) -> dict[Any, float]:
    """A side's listed log-probabilities: its top-k plus its chosen token, keyed by token id, or by token
    text where a served model gave no ids (tokens_as "strings": two ids that decode alike are one key)."""
    known = {t: float(lp) for t, lp in top}
    known.setdefault(chosen_id, float(chosen_lp))
    return known


def keyed_by(records: Iterable[Mapping[str, Any]]) -> str | None:
    """"ids" or "text": what a run's tokens and top-k are keyed by (a served model without ids records
    token strings); None for a run with no generated token; "mixed" when its records disagree."""
    kinds = {"text" if isinstance(t, str) else "ids" for r in records for t in r["token_ids"]}
    return None if not kinds else kinds.pop() if len(kinds) == 1 else "mixed"


def position(left_top: Any, left_id: int, left_lp: float, right_top: Any, right_id: int, right_lp: float) -> Position:
    """The statistics of one position from each side's top-k [(id, logprob)], chosen id and logprob."""
    p, q = _known(left_top, left_id, left_lp), _known(right_top, right_id, right_lp)
    shared = [t for t in p if t in q]
    p_other = max(1.0 - sum(math.exp(p[t]) for t in shared), 0.0)
    q_other = max(1.0 - sum(math.exp(q[t]) for t in shared), 0.0)
    kld = 0.0
    for t in shared:
        if p[t] > MIN_BASE_LOGPROB:
            kld += math.exp(p[t]) * (p[t] - q[t])
    if p_other > 0 and math.log(p_other) > MIN_BASE_LOGPROB:
        kld += p_other * (math.log(p_other) - math.log(max(q_other, FLOOR)))
    outside = left_id not in q
    q_lp = math.log(max(q_other, FLOOR)) if outside else q[left_id]
    top_p = left_top[0][0] if len(left_top) else left_id
    top_q = right_top[0][0] if len(right_top) else right_id
    return Position(kld=kld, nll_base=-float(left_lp), nll=-q_lp, p_diff=math.exp(q_lp) - math.exp(left_lp),
                    same_top=top_p == top_q, outside=outside)


def positions(left: Iterable[Mapping[str, Any]], right: Iterable[Mapping[str, Any]]) -> tuple[list[Position], dict[str, int]]:
    """Every counted position of two runs' records (paired by prompt), and the counts of what
    was left out: prompts whose inputs differ (their contexts are never equal), steps with a
    null logprob, steps after each prompt's first divergent token."""
    left, right = list(left), list(right)
    keys = {keyed_by(left), keyed_by(right)} - {None}
    if len(keys) > 1:
        raise UsageError("the kld format needs both runs' tokens keyed alike: one run records token ids, the other token "
                         "text (a served model that gave no ids), so their distributions cannot be matched token by token",
                         hint="compare two runs of the same kind (both served without ids, or both with ids)")
    rights = {r["prompt_index"]: r for r in right}
    out: list[Position] = []
    counts = {"prompts": 0, "prompts_diverged": 0, "prompts_other_input": 0, "generated": 0, "null_steps": 0, "moved": 0}
    for rec in sorted(left, key=lambda r: r["prompt_index"]):
        other = rights.get(rec["prompt_index"])
        if other is None:
            continue
        if list(rec["input_ids"]) != list(other["input_ids"]):
            counts["prompts_other_input"] += 1
            continue
        counts["prompts"] += 1
        counts["generated"] += len(rec["token_ids"])
        for side in (rec, other):
            if side["logprobs"] is None or side["top_logprobs"] is None or (side["token_ids"] and not any(side["top_logprobs"])):
                raise UsageError(f"prompt {rec['prompt_index']} has no logprobs or top-k on one side: the kld format needs both "
                                 "runs recorded with logprobs", hint="run both at --tier 2 with --logprobs 5 (the default)")
        steps = zip(rec["token_ids"], rec["logprobs"], rec["top_logprobs"], other["token_ids"], other["logprobs"], other["top_logprobs"])
        for lid, llp, ltop, rid, rlp, rtop in steps:
            values = [llp, rlp, *(lp for _, lp in ltop), *(lp for _, lp in rtop)]
            if any(v is None or not math.isfinite(v) for v in values):
                counts["null_steps"] += 1
            else:
                out.append(position(ltop, lid, llp, rtop, rid, rlp))
                counts["moved"] += (llp, list(map(list, ltop))) != (rlp, list(map(list, rtop)))  # a logprob or the top-k differs
            if lid != rid:  # the first divergent token counts; after it the contexts differ
                counts["prompts_diverged"] += 1
                break
    counts["outside_top_k"] = sum(p.outside for p in out)
    counts["keyed_by"] = keys.pop() if keys else "ids"

    return out, counts


def _mean_and_uncertainty(total: float, total2: float, count: int) -> tuple[float, float]:
    """llama.cpp's mean_and_uncertainty: the mean and its standard error (0 for 10 values or fewer)."""
    if count < 1:
        return 0.0, 0.0
    f = total / count
    df = total2 / count - f * f
    return f, math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0


def _covariance(a: float, b: float, ab: float, count: int) -> float:
    return 0.0 if count < 10 else (ab / count - (a / count) * (b / count)) / (count - 1)


def _percentile(values: list[float], fraction: float | None) -> float:
    """llama.cpp's percentile (linear between neighbours of a sorted list); None: its median."""
    n = len(values)
    if fraction is None:
        return 0.5 * (values[n // 2] + values[n // 2 - 1]) if n % 2 == 0 else values[n // 2]
    p = fraction * (n - 1)
    i = int(p)
    p -= i
    return (1 - p) * values[i] + p * values[min(i + 1, n - 1)]


def statistics(found: list[Position]) -> dict[str, Any]:
    """The three sections of llama-perplexity's statistics, keyed by name ([value, uncertainty]
    pairs where llama.cpp prints "±")."""
    n = len(found)
    if n == 0:
        raise UsageError("no position to compare: every prompt's inputs differ, or the runs generated nothing")
    nll = [p.nll for p in found]
    base = [p.nll_base for p in found]
    log_ppl = _mean_and_uncertainty(sum(nll), sum(x * x for x in nll), n)
    log_base = _mean_and_uncertainty(sum(base), sum(x * x for x in base), n)
    cov = _covariance(sum(nll), sum(base), sum(a * b for a, b in zip(nll, base)), n)
    ppl, ppl_base = math.exp(log_ppl[0]), math.exp(log_base[0])
    ppl_unc, base_unc = ppl * log_ppl[1], ppl_base * log_base[1]
    ratio = log_ppl[0] - log_base[0]
    ratio_unc = math.sqrt(max(log_ppl[1] ** 2 + log_base[1] ** 2 - 2 * cov, 0.0))  # llama.cpp: nan where rounding makes it < 0
    denom = log_ppl[1] * log_base[1]
    kld = sorted(p.kld for p in found)
    dp = sorted(p.p_diff for p in found)
    dp2 = [x * x for x in dp]
    mse = _mean_and_uncertainty(sum(dp2), sum(x * x for x in dp2), n)
    rms = math.sqrt(mse[0])
    same = sum(p.same_top for p in found) / n
    return {
        "count": n,
        "perplexity": {
            "ppl_q": [ppl, ppl_unc],
            "ppl_base": [ppl_base, base_unc],
            "cor": cov / denom if denom else math.nan,
            "ln_ratio": [ratio, ratio_unc],
            "ratio": [math.exp(ratio), math.exp(ratio) * ratio_unc],
            "difference": [ppl - ppl_base, math.sqrt(max(ppl_unc ** 2 + base_unc ** 2 - 2 * ppl * ppl_base * cov, 0.0))],
        },
        "kld": {
            "mean": list(_mean_and_uncertainty(sum(kld), sum(x * x for x in kld), n)),
            "maximum": kld[-1],
            "percentiles": [[f, _percentile(kld, f)] for f in KLD_PERCENTILES],
            "minimum": kld[0],
        },
        "p_diff": {
            "mean": list(_mean_and_uncertainty(sum(dp), sum(dp2), n)),
            "maximum": dp[-1],
            "percentiles": [[f, _percentile(dp, f)] for f in P_DIFF_PERCENTILES],
            "minimum": dp[0],
            "rms": [rms, 0.5 / rms * mse[1] if rms else 0.0],
            "same_top": [same, math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0],
        },
    }


__all__ = ["FLOOR", "MIN_BASE_LOGPROB", "Position", "position", "positions", "statistics"]
