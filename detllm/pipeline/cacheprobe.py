"""The prefix-cache probe of a served endpoint (`check --cache-probe`): its settings and its verdict.

Each prompt is sent cold (the server's cache reset where it can be, see backends/openai/),
at once again warm, and once more after a prompt that shares its whole text as a prefix. The
runner records them as runs 0, 1 and 2 at batch size 1; this module compares warm and
after-prefix with cold and names a difference CACHE_VARIANCE, with the cached-token counts the
server reported. Reads trace records only; the request sequence lives in the backend.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..core.config import RunConfig
from ..core.errors import UsageError

SIDES = ("cold", "warm", "after_shared_prefix")
_TRUE = ("1", "true", "yes", "on")


def wants_probe(config: RunConfig) -> bool:
    return config.backend == "openai" and dict(config.options).get("cache_probe", "").lower() in _TRUE


def probe_config(config: RunConfig) -> RunConfig:
    """The probe's run plan: one request at a time, runs = the three sides (more runs: warm again)."""
    if config.vary_batch or config.batch_size != 1:
        raise UsageError("--cache-probe sends one request at a time: drop --concurrency/--vary-batch and --batch-size",
                         hint="probe batching and caching in two checks")
    return dataclasses.replace(config, runs=max(config.runs, len(SIDES)))


def cache_report(config: RunConfig, records: list[dict[str, Any]], *, tier: int, floor: float | None,
                 summary: dict[str, Any], drift: bool = True) -> dict[str, Any]:
    """report.json of a probe folder (called by checkverdict.check_verdict, for the runner and for
    verify alike): the check's comparisons with the run's noise floor, renamed by side, and
    CACHE_VARIANCE in place of RUN_VARIANCE (within a probe folder nothing but the cache differs
    between runs)."""
    from ..compare.engine import parse_label  # the comparisons: needed once the runs are done, not to plan them
    from ..compare.verdict import check_comparisons, check_report

    comps = check_comparisons(records, base_batch=1, runs=config.runs, batch_sizes=(1,), tier=tier, atol=config.atol,
                              floor=floor, sampled=not config.decoding.greedy, drift=drift)
    for c in comps:  # every one is a repeat at batch 1 (run_k vs run_0): named by its side before causes cite it
        c["name"] = f"{side_name(parse_label(c['right'])[0])} vs cold"
    report = check_report(comps, tier_requested=config.tier, tier_effective=tier, summary={**summary, "cache_probe": sides(records)})
    for group in ("causes", "info"):
        for cause in report.get(group, []):
            if cause["code"] == "RUN_VARIANCE":
                cause["code"] = "CACHE_VARIANCE"
                ev = cause["evidence"]
                ev.pop("recorded_differences", None)
                ev["sides"] = sides(records)
                drifts = [c.get("drift") or {} for c in comps if c["status"] != "PASS"]
                ev["max_abs_logprob_diff"] = max((d.get("max_abs_logprob_diff") or 0.0 for d in drifts if d.get("available")), default=None)
                ev["argmax_flips"] = sum(d.get("argmax_flips") or 0 for d in drifts if d.get("available")) if drifts else None
    if report["category"] == "RUN_VARIANCE":
        report["category"] = "CACHE_VARIANCE"
    return report


def side_name(run: int) -> str:
    return SIDES[run] if run < len(SIDES) else f"warm_{run}"


def sides(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per run: the side, how the cold side was made, and the cached prompt tokens the server reported."""
    out: dict[str, Any] = {}
    for r in records:
        ev = r.get("evidence") or {}
        cache = ev.get("cache") or {}
        key = f"run_{r['run_index']}"
        s = out.setdefault(key, {"side": cache.get("side", side_name(r["run_index"])), "cached_prompt_tokens": 0, "prompts": 0})
        if cache.get("reset"):
            s["reset"] = cache["reset"]
        s["prompts"] += 1
        if isinstance(ev.get("cached_prompt_tokens"), int):
            s["cached_prompt_tokens"] += ev["cached_prompt_tokens"]
    return out


__all__ = ["SIDES", "cache_report", "probe_config", "sides", "wants_probe"]
