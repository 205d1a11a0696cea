"""A check folder's verdict, made by one function: the runner writes report.json with it and
`verify` re-derives it with it (rederive.py), so the two never take different paths.

Owns which report maker a check gets (a plain check, or `check --cache-probe`, read from the
config the trace chain binds), what it is given (noise floor, sampled, fresh runs, the records
for per-record causes), and the effective tier gated from the requested tier and the backend's
capabilities. Does not own the comparisons and causes (compare/), running (runner.py) or reading
a sealed folder (rederive.py).
"""

from __future__ import annotations

from typing import Any

from ..backends.base import Capabilities
from . import engagement
from .cacheprobe import cache_report, wants_probe
from ..compare.verdict import check_comparisons, check_report
from ..core.config import RunConfig
from ..core.errors import TierUnsupportedError
from .fresh import fresh_runs, scope_text


def gate_tier(config: RunConfig, caps: Capabilities) -> tuple[int, str | None]:
    """(effective tier, downgrade reason). Strict mode refuses instead of downgrading."""
    max_tier = caps.max_tier if caps.logprobs else min(caps.max_tier, 1)
    if config.tier <= max_tier:
        return config.tier, None
    why = f"backend {config.backend!r} enforces tier {max_tier} at most" + (f": {'; '.join(caps.notes)}" if caps.notes else "")
    if config.mode == "strict":
        raise TierUnsupportedError(f"tier {config.tier} refused in strict mode: {why}", hint=f"use --tier {max_tier} or --mode best-effort")
    return max_tier, why


def recorded_capabilities(applied: dict[str, Any]) -> Capabilities:
    """The Capabilities determinism_applied.json recorded (what gate_tier was given)."""
    caps = applied["capabilities"]
    return Capabilities(max_tier=caps["max_tier"], logprobs=caps["logprobs"], sampling=caps["sampling"],
                        batch_invariant=caps["batch_invariant"], notes=tuple(caps.get("notes") or ()))


def check_verdict(config: RunConfig, records: list[dict[str, Any]], *, tier: int, floor: float | None,
                  summary: dict[str, Any], control: dict[str, Any] | None = None, drift: bool = True) -> dict[str, Any]:
    """report.json of a check of `records` under `config` at effective tier `tier`. `drift=False`
    skips the drift aggregation (verify: status, category and first divergence do not read it)."""
    if wants_probe(config):  # check --cache-probe: cold/warm runs, CACHE_VARIANCE verdict
        report = cache_report(config, records, tier=tier, floor=floor, summary=summary, drift=drift)
        return engagement.apply(report, records, config, probe=True)
    comps = check_comparisons(records, base_batch=config.batch_size, runs=config.runs, batch_sizes=config.batch_sizes,
                              tier=tier, atol=config.atol, floor=floor, fresh=fresh_runs(config),
                              sampled=not config.decoding.greedy, drift=drift)
    report = check_report(comps, tier_requested=config.tier, tier_effective=tier, summary=summary,
                          scope=scope_text(config, records), control=control, records=records)
    return engagement.apply(report, records, config)  # UNVERIFIED where a varied axis was shown not engaged


__all__ = ["check_verdict", "gate_tier", "recorded_capabilities"]
