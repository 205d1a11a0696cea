"""The effective tier of a run: gated from the tier asked for and what the backend enforces
(gate_tier), and the capabilities determinism_applied.json recorded for that gate
(recorded_capabilities), so `verify` re-gates from the folder as the runner gated before running.

Apart from checkverdict.py: the runner gates before the first generate, and the comparison and
verdict machinery checkverdict imports is only needed once the runs are done.
"""

from __future__ import annotations

from typing import Any

from ..backends.base import Capabilities
from ..core.config import RunConfig
from ..core.errors import TierUnsupportedError


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
