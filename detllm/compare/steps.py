"""One generated step of two records compared value by value: the NaN rule (`finite`), the
distance of two logprobs and of two top-k lists. Shared by the reference path (divergence.py,
engine.py) and the array path (fast.py), so both measure a step alike; knows nothing of
records, divergences or drift.
"""

from __future__ import annotations

import math
from typing import Any


def finite(x: Any) -> float | None:
    """The value as the sanitised record holds it: None for null, NaN and +-inf."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def abs_diff(x: Any, y: Any) -> float:
    """|x - y| of two logprobs; null (or non-finite) equals null and is infinitely far from any number."""
    if x == y:
        return 0.0
    x, y = finite(x), finite(y)
    if x is None or y is None:
        return 0.0 if x is y else float("inf")
    return abs(x - y)


def topk_diff(ta: list[list[Any]] | None, tb: list[list[Any]] | None, atol: float = 0.0) -> float:
    """Largest |logprob difference| over the top-k ids. Sides that recorded a different k
    compare their common top-min(k). Ids in one side's top-k only: inf when bitwise
    (atol 0); with atol > 0 such an id is fine when its value is within atol of the other
    side's k-th value (a boundary swap: it may sit just below the other's cut)."""
    if ta == tb:
        return 0.0
    if ta is None or tb is None:
        return float("inf")
    k = min(len(ta), len(tb))
    ta, tb = ta[:k], tb[:k]
    if ta == tb:
        return 0.0
    da, db = {t[0]: finite(t[1]) for t in ta}, {t[0]: finite(t[1]) for t in tb}
    common = da.keys() & db.keys()
    d = max((abs_diff(da[i], db[i]) for i in common), default=0.0)
    if len(common) == len(da) == len(db):
        return d
    if atol <= 0:
        return float("inf")
    for mine, other in ((da, db), (db, da)):
        kth = min((v for v in other.values() if v is not None), default=None)
        for i in mine.keys() - other.keys():
            if mine[i] is None or kth is None:
                return float("inf")
            d = max(d, mine[i] - kth)  # it would sit at or below the other's k-th value: the gap is at least this
    return d
