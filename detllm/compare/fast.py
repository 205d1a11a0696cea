"""The fast path's arithmetic on two Views (compare/arrays.py): a pair's first logprob
divergence (`logprob_step`) and its drift (`pair_drift`), on arrays. Owns no meaning: each
mirrors its reference (divergence._logprob_step, engine._pair_drift) step for step, same floats
and summation order, and tests/test_fast_diff.py holds both paths to the same report.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .arrays import IRREGULAR, LAZY_STEPS, Tops, View, top_arrays
from .steps import topk_diff


def logprob_step(a: View, b: View, stop: int, atol: float) -> Any:
    """divergence._logprob_step on arrays: the first step < stop whose chosen-token logprob or
    top-k differs by more than atol, with that difference, or None; NotImplemented when a top-k
    section is irregular (the reference loop then reads it). A step whose two top-k lists hold
    the same distinct ids in the same order is measured on the arrays; any other step (ids moved,
    swapped in or repeated) by steps.topk_diff itself, as the reference loop would."""
    pa, pb = a.payload, b.payload
    if pa.lps is None or pb.lps is None:
        return None
    m = min(stop, len(pa.lps), len(pb.lps))
    if m <= 0:
        return None
    d = np.abs(pa.lps[:m] - pb.lps[:m])
    if pa.tops_raw is not None or pb.tops_raw is not None:  # top-k kept as bytes (a comparison without drift)
        over = np.flatnonzero(d > atol)
        if over.size and over[0] < LAZY_STEPS:
            return NotImplemented  # the reference loop stops by that step, reading only the steps before it
    ta, tb = top_arrays(pa), top_arrays(pb)
    if ta is IRREGULAR or tb is IRREGULAR:
        return NotImplemented
    na, nb = (0 if ta is None else len(ta[0])), (0 if tb is None else len(tb[0]))
    both = min(m, na, nb)
    d[both:min(m, max(na, nb))] = np.inf  # one side has a top-k list at the step, the other none
    other: np.ndarray = np.zeros(0, dtype=np.int64)  # steps measured by the reference function
    if both:
        k = min(ta[0].shape[1], tb[0].shape[1])
        A, B = ta[0][:both, :k], tb[0][:both, :k]
        simple = _rows_equal(A, B) & ~_repeats(A)
        gap = np.abs(ta[1][:both, :k] - tb[1][:both, :k]).max(axis=1)
        np.maximum(d[:both], np.where(simple, gap, 0.0), out=d[:both])
        other = np.flatnonzero(~simple)
    over = np.flatnonzero(d > atol)
    first = int(over[0]) if over.size else m
    for i in other.tolist():  # up to and including `first`, whose top-k term is not in d yet if it is here
        if i > first:
            break
        rows = Tops(*ta)[i], Tops(*tb)[i]
        di = max(float(d[i]), topk_diff(rows[0], rows[1], atol)) if rows[0] != rows[1] else float(d[i])
        if di > atol:
            return i, di
    return (first, float(d[first])) if first < m else None


def same_tokens(a: View, b: View) -> bool:
    """The same input and the same generated ids on both sides (no token or length divergence)."""
    return a["input_ids_sha256"] == b["input_ids_sha256"] and np.array_equal(a.payload.ids, b.payload.ids)


def first_token_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    n = min(len(a), len(b))
    neq = np.flatnonzero(a[:n] != b[:n])
    if neq.size:
        return int(neq[0])
    return None if len(a) == len(b) else n


def _first_of_id(x: np.ndarray) -> np.ndarray:
    """(m, k) bool: entry j is the first of its id in its step (a set keeps one of each)."""
    out = np.ones(x.shape, dtype=bool)
    for j in range(1, x.shape[1]):
        out[:, j] = ~(x[:, :j] == x[:, j:j + 1]).any(axis=1)
    return out


def _last_of_id(x: np.ndarray) -> np.ndarray:
    """(m, k) bool: entry j is the last of its id in its step (a dict keeps the last)."""
    return _first_of_id(x[:, ::-1])[:, ::-1]


def _right_values(pa_ids: np.ndarray, pb_ids: np.ndarray, pb_lps: np.ndarray) -> np.ndarray:
    """(m, ka): the right's logprob of each left top-k id, as engine._kl_topk looks it up: the
    right's {id: logprob} (an id's last entry wins), the right's k-th value for a missing id."""
    kb = pb_ids.shape[1]
    last = _last_of_id(pb_ids)
    match = (pa_ids[:, :, None] == pb_ids[:, None, :]) & last[:, None, :]  # (m, ka, kb)
    kth = np.where(last, pb_lps, np.inf).min(axis=1)
    at = kb - 1 - match[:, :, ::-1].argmax(axis=2)  # the matching column
    return np.where(match.any(axis=2), np.take_along_axis(pb_lps, at, axis=1), kth[:, None])


def kl_rows(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """engine._kl_topk for m steps at once: KL(left || right) over the left's top-k ids, p the
    left's logprobs (m, k) and q the right's of the same ids, each side renormalised over them.
    numpy's exp and log on both paths; sums run left to right, as Python's sum. Worked on the
    k columns (contiguous copies): numpy reduces a short last axis slowly. Writes into neither
    input: at k == 1 or m == 1 the transpose is already contiguous, so `pt` is p itself (a
    record's top-k, read-only in its Payload) and is renormalised into a new array."""
    pt, qt = np.ascontiguousarray(p.T), np.ascontiguousarray(q.T)  # (k, m)
    zp = np.log(_colsum(np.exp(pt)))
    zq = np.log(_colsum(np.exp(qt)))
    pt = pt - zp
    qt = qt - zq
    s = _colsum(np.exp(pt) * (pt - qt))
    return np.where(s > 0.0, s, 0.0)


def _colsum(x: np.ndarray) -> np.ndarray:
    """Sums of the k rows of (k, m), added first to last: each step's sum as Python's sum()."""
    out = x[0].copy()
    for row in x[1:]:
        out += row
    return out


def _rows_equal(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(m,) bool: row i of x equals row i of y (both (m, k)), column by column."""
    out = x[:, 0] == y[:, 0]
    for j in range(1, x.shape[1]):
        out &= x[:, j] == y[:, j]
    return out


def _repeats(x: np.ndarray) -> np.ndarray:
    """(m,) bool: the step lists some id twice (each pair of columns compared)."""
    out = np.zeros(len(x), dtype=bool)
    for j in range(1, x.shape[1]):
        for i in range(j):
            out |= x[:, i] == x[:, j]
    return out


def pair_drift(a: View, b: View) -> tuple[dict[str, Any], np.ndarray, int, list[float]] | None:
    """engine._pair_drift on arrays (same result, same floats; |dlogprob| per step as an array)."""
    pa, pb = a.payload, b.payload
    if pa.lps is None or pb.lps is None or a["input_ids_sha256"] != b["input_ids_sha256"]:
        return None
    ia, ib = pa.ids, pb.ids
    tok = first_token_difference(ia, ib)
    same = min(len(pa.lps), len(pb.lps), len(ia) if tok is None else tok)
    shared = same + 1 if tok is not None and tok < min(len(ia), len(ib)) else same
    per = np.abs(pa.lps[:same] - pb.lps[:same])
    overlap, counted, flips, kls = 0.0, 0, 0, []
    if pa.top_ids is not None and pb.top_ids is not None:
        m = min(shared, len(pa.top_ids), len(pb.top_ids))
        if m:
            A, B = pa.top_ids[:m], pb.top_ids[:m]
            ka, kb = A.shape[1], B.shape[1]
            la, lb = pa.top_lps[:m], pb.top_lps[:m]
            counted = m
            same_ids = ka == kb and np.array_equal(A, B)
            repeats = _repeats(A) if same_ids else None
            if same_ids and not repeats.any():  # the usual drift: same ids, values moved
                overlap = float(m)  # m steps of 1.0, added one by one: exact
                q = lb
            elif same_ids:  # the same, but some steps list an id twice: those steps as the general case below
                rows = np.flatnonzero(repeats)
                inter = np.full(m, ka, dtype=np.int64)
                inter[rows] = _first_of_id(A[rows]).sum(axis=1)  # |set & set| = the distinct ids of the step
                overlap = float(np.cumsum(inter / ka)[-1])
                q = lb.copy()
                q[rows] = _right_values(A[rows], B[rows], lb[rows])
            else:
                inter = ((A[:, :, None] == B[:, None, :]).any(axis=2) & _first_of_id(A)).sum(axis=1)  # |set & set|
                overlap = float(np.cumsum(inter / max(ka, kb))[-1])  # left to right, as the reference's +=
                flips = int((A[:, 0] != B[:, 0]).sum())
                q = _right_values(A, B, lb)
            kl = kl_rows(la, q)
            if ka == kb:  # a step whose top-k lists are equal is 0.0 without computing
                equal = _rows_equal(la, lb) if same_ids else _rows_equal(A, B) & _rows_equal(la, lb)
                kl = np.where(equal, 0.0, kl)
            kls = kl.tolist()
    return ({"prompt_index": a["prompt_index"], "steps": shared,
             "max_abs_logprob_diff": float(per.max()) if same else 0.0,
             "mean_topk_overlap": overlap / counted if counted else None, "argmax_flips": flips,
             "tokens_equal": tok is None},
            per, counted, kls)  # per: an array, which engine.drift aggregates with numpy


__all__ = ["kl_rows", "logprob_step", "pair_drift", "same_tokens"]
