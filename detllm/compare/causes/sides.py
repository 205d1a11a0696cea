"""What the detectors share: a `Side` (what one selection recorded), `flat_diff` (two JSON
values leaf by leaf), `Routed` (a difference found by one detector that belongs to another)
and the evidence helpers. Detects nothing itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CAP = 20  # evidence lists keep this many entries; a count says how many there were
ABSENT = "<absent>"  # flat_diff: the field is missing on this side


@dataclass(frozen=True)
class Side:
    """One selection of trace records and what its folder recorded. Within one folder
    (check) env/run_config/applied are None: there is nothing to compare them with."""

    label: str
    run_index: int
    batch_size: int
    records: list[dict[str, Any]] | None = None
    folder: str | None = None
    env: dict[str, Any] | None = None
    run_config: dict[str, Any] | None = None
    applied: dict[str, Any] | None = None


def flat_diff(a: Any, b: Any, prefix: str = "") -> list[dict[str, Any]]:
    """Leaf-by-leaf differences of two JSON values: [{field: "libraries.torch", left, right}]."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[dict[str, Any]] = []
        for k in sorted(set(a) | set(b), key=str):
            out += flat_diff(a.get(k, ABSENT), b.get(k, ABSENT), f"{prefix}.{k}" if prefix else str(k))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and any(isinstance(x, dict) for x in a + b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in flat_diff(x, y, f"{prefix}[{i}]")]
    if a == b and type(a) is type(b):
        return []
    return [{"field": prefix, "left": a, "right": b}]


@dataclass
class Routed:
    """Differences found outside their own detector, by where they belong."""

    machine: list[dict[str, Any]] = field(default_factory=list)  # ENV: chosen by the machine or engine
    batch: list[dict[str, Any]] = field(default_factory=list)  # BATCH: follows the batch sizes
    dtype: dict[str, Any] | None = None  # the dtype in effect differs: {left, right, requested}


def lr(a: Any, b: Any) -> dict[str, Any]:
    return {"left": a, "right": b}


def cut(items: list[Any], cap: int = CAP) -> list[Any]:
    return items[:cap]
