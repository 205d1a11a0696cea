"""A check folder's verdict, made by one function: the runner writes report.json with it and
`verify` re-derives it with it (rederive.py), so the two never take different paths.

Owns which report maker a check gets (a plain check, or `check --cache-probe`, read from the
config the trace chain binds), what it is given (noise floor, sampled, fresh runs, the records
for per-record causes). Does not own the effective tier's gate (tiergate.py), the comparisons and
causes (compare/), running (runner.py) or reading a sealed folder (rederive.py).
"""

from __future__ import annotations

from typing import Any

from . import engagement
from .cacheprobe import cache_report, wants_probe
from ..compare.verdict import check_comparisons, check_report
from ..core.config import RunConfig
from .fresh import fresh_runs, scope_text


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


__all__ = ["check_verdict"]
