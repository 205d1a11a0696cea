"""Aligning two captures module by module and measuring each difference: tensors are paired by
name (Hugging Face module paths; no user-written map), the prompt's positions sliced out where the
two batches padded it differently, and each pair measured (max |Δ| with its coordinate and both
values, mean |Δ|, relative difference, cosine, bitwise equality of inputs and output). numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..backends.base import UNCAPTURED_PREFIX, CapturedTensor


@dataclass
class Pair:
    """One module captured on both sides, measured."""

    left: CapturedTensor
    right: CapturedTensor
    shapes_match: bool  # the row's output could be aligned element for element
    output_equal: bool | None  # bitwise (None: not comparable)
    inputs_equal: bool | None  # every input bitwise equal (None: inputs not captured or not comparable)
    kv_equal: bool | None  # attention: the cached K/V inputs bitwise equal (None: none read)
    metrics: dict[str, Any]
    trimmed: bool = False  # padding positions were sliced off to align the prompt's positions
    kv_step: int | None = None  # the step that wrote the first cached position that differs (None: unknown or none)
    inputs_inferred: bool = False  # a layer boundary's input taken from the boundary before it (not captured)


def trailing(a: Any, b: Any) -> tuple[Any, Any, bool] | None:
    """The two arrays over their common trailing extent in every dimension that differs (left
    padding puts a prompt's real positions last; a batch of 1 has none), or None when their ranks
    differ. Returns (a', b', trimmed)."""
    import numpy as np

    a, b = np.asarray(a), np.asarray(b)
    while a.ndim > b.ndim and a.shape[0] == 1:
        a = a[0]
    while b.ndim > a.ndim and b.shape[0] == 1:
        b = b[0]
    if a.ndim != b.ndim:
        return None
    if a.shape == b.shape:
        return a, b, False
    sa = tuple(slice(n - min(n, m), n) for n, m in zip(a.shape, b.shape))
    sb = tuple(slice(m - min(n, m), m) for n, m in zip(a.shape, b.shape))
    return a[sa], b[sb], True


def bitwise_equal(a: Any, b: Any) -> bool:
    """Same dtype, same shape, same bytes (NaN payloads and signed zeros included)."""
    import numpy as np

    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def measure(a: Any, b: Any) -> dict[str, Any]:
    """max |Δ| (coordinate, both values), mean |Δ|, relative difference 1 - 2Σxy/(Σx²+Σy²) (squared,
    clamped at 0), relative L2 ‖x−y‖/max(‖x‖, ‖y‖) and cosine, in float64. Non-finite values count as a difference of inf at their coordinate."""
    import numpy as np

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.size == 0:
        return {"max_abs_diff": 0.0, "at": [], "left_value": None, "right_value": None, "mean_abs_diff": 0.0,
                "rel_diff": 0.0, "rel_l2": 0.0, "cosine": 1.0}
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(x - y)
    same_nonfinite = (~np.isfinite(x)) & (x == y)  # inf == inf: no difference
    diff = np.where(same_nonfinite, 0.0, np.where(np.isnan(diff), np.inf, diff))
    at = np.unravel_index(int(np.argmax(diff)), diff.shape)
    finite = np.isfinite(x) & np.isfinite(y)
    xf, yf = np.where(finite, x, 0.0), np.where(finite, y, 0.0)
    sxy, sxx, syy = float((xf * yf).sum()), float((xf * xf).sum()), float((yf * yf).sum())
    rel = 0.0 if sxx + syy == 0 else max(0.0, 1.0 - 2.0 * sxy / (sxx + syy))  # cancellation can give -2e-16: clamped
    cos = 1.0 if sxx == 0 and syy == 0 else (0.0 if sxx == 0 or syy == 0 else sxy / (sxx * syy) ** 0.5)
    norm = max(sxx, syy) ** 0.5
    l2 = 0.0 if norm == 0 else float(np.sqrt(((xf - yf) ** 2).sum())) / norm  # from the differences: no cancellation
    return {"max_abs_diff": _num(float(diff[at])), "at": [int(i) for i in at], "left_value": _num(float(x[at])),
            "right_value": _num(float(y[at])), "mean_abs_diff": _num(float(diff.mean())), "rel_diff": rel, "rel_l2": l2,
            "cosine": cos}


def _num(v: float) -> float | str:
    """JSON has no inf or NaN: they are written as strings."""
    return v if v == v and abs(v) != float("inf") else str(v)


KV_NAMES = ("past_keys", "past_values")  # the cached K/V inputs of an attention (CapturedTensor.input_names)


def is_kv(t: CapturedTensor, n: int) -> bool:
    if t.input_names and n < len(t.input_names):
        return t.input_names[n] in KV_NAMES
    return n >= 1 and t.cached_from_step is not None  # no names: inputs after the first are the cache


def _inputs(a: CapturedTensor, b: CapturedTensor) -> tuple[bool | None, bool | None, int | None]:
    """(every input bitwise equal, the cached K/V inputs equal, the step that wrote the first cached
    position that differs) after aligning each input pair."""
    import numpy as np

    if not a.inputs or not b.inputs or len(a.inputs) != len(b.inputs):
        return None, None, None
    equal, kv, wrote = True, None, None
    for n, (x, y) in enumerate(zip(a.inputs, b.inputs)):
        t = trailing(x, y)
        same = t is not None and bitwise_equal(t[0], t[1])
        equal = equal and same
        if is_kv(a, n) or is_kv(b, n):
            kv = same if kv is None else kv and same
            if not same and t is not None and t[0].ndim >= 2 and t[0].shape == t[1].shape:
                # [heads, position, dim]: the first cached position that differs, and the step that wrote it
                moved = np.any(np.ascontiguousarray(t[0]).view(np.uint8).reshape(t[0].shape + (-1,)) !=
                               np.ascontiguousarray(t[1]).view(np.uint8).reshape(t[1].shape + (-1,)),
                               axis=tuple(i for i in range(t[0].ndim + 1) if i != t[0].ndim - 2))
                first = int(np.argmax(moved)) if moved.any() else None
                steps = a.cached_steps or b.cached_steps
                if first is not None and steps and len(steps) == t[0].shape[-2]:
                    at = steps[first]
                    wrote = at if wrote is None else min(wrote, at)
    return equal, kv, wrote


IN_PASS = ("in_pass_keys", "in_pass_values")  # the K/V a prefill's attention wrote in the pass (taps.Window.in_pass_kv)


def _decode_prefill_inputs(a: CapturedTensor, b: CapturedTensor) -> tuple[bool | None, bool | None, None]:
    """An attention of a decode step (cached K/V of n positions) against the same attention of a
    prefill of those n positions + 1 (the K/V it wrote in the pass, n + 1 positions): the cached K/V
    against the prefill's first n, the other inputs by name over their common trailing extent (the
    decode's one position, the prefill's last). (None, None, None) when they cannot be paired."""
    dec, pre = (a, b) if "past_keys" in a.input_names else (b, a)
    if "past_keys" not in dec.input_names or "in_pass_keys" not in pre.input_names:
        return None, None, None
    d, p = dict(zip(dec.input_names, dec.inputs)), dict(zip(pre.input_names, pre.inputs))
    kv = True
    for past, fresh in zip(KV_NAMES, IN_PASS):
        x, y = d.get(past), p.get(fresh)
        if x is None or y is None or x.ndim < 2 or y.shape[-2] != x.shape[-2] + 1:
            return None, None, None
        kv = kv and bitwise_equal(x, y[..., :x.shape[-2], :])
    rest = [n for n in d if n not in KV_NAMES]
    if sorted(rest) != sorted(n for n in p if n not in IN_PASS):
        return None, None, None
    equal = kv
    for n in rest:
        t = trailing(d[n], p[n])
        equal = equal and t is not None and bitwise_equal(t[0], t[1])
    return equal, kv, None


def whole(t: CapturedTensor, rows: int) -> bool:
    """A tensor of a batch of `rows` > 1 the capture kept whole (not cut to the prompt's row: an op with no
    batch axis, e.g. a blocked GEMM over 64 rows of several sequences): no row of it can be compared.
    What the capture says it did decides (`CapturedTensor.whole`: vLLM's first axis is the forward's
    flattened tokens, which a forward holding only the prompt's request matches); else the shapes."""
    import numpy as np

    if t.whole is not None:
        return t.whole
    return rows > 1 and bool(t.output_shape) and tuple(np.shape(t.output)) == tuple(t.output_shape) and t.output_shape[0] != 1


def pair_up(left: list[CapturedTensor], right: list[CapturedTensor], rows: tuple[int, int] = (1, 1), *,
            kv: bool = True) -> tuple[list[Pair], list[str], list[str]]:
    """Pairs by name in the left side's execution order; names captured on one side only. `rows`: each
    side's batch size (a tensor kept whole on a side of several rows is not compared). `kv` False: one
    side's cached K/V have no counterpart on the other (decode vs prefill, whose K/V are computed inside
    the attention): an attention that reads them has inputs not compared (`kv_not_comparable`)."""
    by_name = {t.name: t for t in right}
    pairs, left_only = [], []
    for t in sorted(left, key=lambda t: t.order):
        other = by_name.get(t.name)
        if other is None:
            left_only.append(t.name)
            continue
        if whole(t, rows[0]) or whole(other, rows[1]):
            pairs.append(Pair(t, other, False, None, None, None, {"kept_whole": True}))
            continue
        t2 = trailing(t.output, other.output)
        inputs_equal, kv_equal, kv_step = _inputs(t, other)
        apart = not kv and any(is_kv(x, n) for x in (t, other) for n in range(len(x.inputs)))
        if apart:
            inputs_equal, kv_equal, kv_step = _decode_prefill_inputs(t, other)
            apart = kv_equal is None
        if t2 is None:
            pairs.append(Pair(t, other, False, None, inputs_equal, kv_equal, {}, kv_step=kv_step))
            continue
        x, y, trimmed = t2
        pairs.append(Pair(t, other, True, bitwise_equal(x, y), inputs_equal, kv_equal,
                          {**measure(x, y), **({"kv_not_comparable": True} if apart else {})}, trimmed, kv_step))
    _reads_cache(pairs)
    _boundary_inputs(pairs)
    names = {t.name for t in left}
    return pairs, left_only, [t.name for t in sorted(right, key=lambda t: t.order) if t.name not in names]


BOUNDARIES = ("embedding", "layer")


def _reads_cache(pairs: list[Pair]) -> None:
    """An attention that read a prefix cache no capture holds has inputs not compared; a decoder layer
    reads the cached K/V through its attention, so a layer whose attention's cached K/V differ has
    inputs that differ, and one whose attention's cache could not be compared has inputs not compared."""
    for p in pairs:
        if p.left.kind == "attention" and UNCAPTURED_PREFIX in (*p.left.input_names, *p.right.input_names):
            p.inputs_equal, p.kv_equal = None, None
            p.metrics["cached_prefix_not_captured"] = True
    for p in pairs:
        if p.left.kind != "layer":
            continue
        inner = [q for q in pairs if q.left.kind == "attention" and q.left.name.startswith(p.left.name + ".")]
        if any(q.metrics.get("cached_prefix_not_captured") or q.metrics.get("kv_not_comparable") for q in inner):
            p.inputs_equal = None
            p.metrics["cache_not_compared"] = True
        elif any(q.kv_equal is False for q in inner) and p.inputs_equal is not False:
            p.inputs_equal = False
            p.metrics["cached_kv_differ"] = True


def _boundary_inputs(pairs: list[Pair]) -> None:
    """A layer boundary captured without its inputs (llama.cpp's l_out-N, one engine's boundaries against
    another's) takes as its input the boundary before it: a decoder layer's input is the previous
    layer's output (or the embedding's). Marked `inputs_inferred`."""
    previous: Pair | None = None
    for p in pairs:
        if (p.left.kind == "layer" and p.inputs_equal is None and previous is not None and previous.output_equal is not None
                and not p.metrics.get("cache_not_compared")):
            p.inputs_equal, p.inputs_inferred = previous.output_equal, True
        if p.left.kind in BOUNDARIES:
            previous = p
