"""The fast path of a comparison: payloads that differ are parsed straight into arrays.

compare/trace.py keeps every payload as the bytes the runner wrote; a byte-identical
pair is settled there. A pair that differs is parsed here: simdjson reads the number
lists (ids, logprobs, and the top-k section, flattened after its bracket layout is
checked) straight into numpy arrays, msgspec validates the texts, numpy does the per-step
work. Owns no meaning: `pair_drift` mirrors engine._pair_drift step for step (same
floats, same summation order) and first divergences still come from
divergence.first_divergence, run on a `View` of the arrays. A record not laid out as
the runner writes it (nulls, token strings, a ragged top-k, whitespace, evidence) gets
no view and takes the reference path. tests/test_fast_diff.py holds both paths to the
same report. One liberty: top-k numbers are read by type, so a hand-written `5.0` as a
top-k id or `0` as a logprob reads as 5 and 0.0 (the runner never writes either). A
comparison without drift (verify's verdict re-derivation) leaves the top-k section as
bytes and reads only the steps a divergence looks at (_LazyTops), as the reference path
would read them. compare/pairs.py decides which pairs come here, and on which core.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import msgspec
import numpy as np
import simdjson

from .trace import TraceRecord

_STRS = msgspec.json.Decoder(list[str])
_STR = msgspec.json.Decoder(str)
_MARKS = (b',"token_ids":', b',"token_texts":', b',"text":', b',"logprobs":', b',"top_logprobs":')
_FINISH = b',"finish_reason":'
_NUMBER_BYTES = b"0123456789.-+eE"
_MAX_ID = 2**53  # ids read as float64 are exact below this


class Payload:
    """A record's generated steps as arrays. ids (n,) int64; lps (n,) float64 or None;
    top_ids (n, k) int64 and top_lps (n, k) float64, or None; texts and text as raw JSON."""

    __slots__ = ("ids", "lps", "top_ids", "top_lps", "texts_raw", "text_raw", "finish_reason", "tops_raw")

    def __init__(self, ids, lps, top_ids, top_lps, texts_raw: bytes, text_raw: bytes, finish_reason: str,
                 tops_raw: bytes | None = None) -> None:
        self.ids, self.lps, self.top_ids, self.top_lps = ids, lps, top_ids, top_lps
        self.texts_raw, self.text_raw, self.finish_reason = texts_raw, text_raw, finish_reason
        self.tops_raw = tops_raw  # the top-k section, not parsed yet (payload(tops=False)); else None


def _sections(rec: TraceRecord) -> list[bytes] | None:
    """The payload's values as bytes, in the order the runner writes them (ids, texts, text,
    logprobs, top-k, finish_reason); None when the layout differs."""
    src, start, end = rec._src, rec._start, rec._end
    if src is None:
        return None
    at = []
    pos = start
    for mark in _MARKS:
        p = src.find(mark, pos, end)
        if p < 0 or (at and p < at[-1][1]):
            return None
        at.append((p, p + len(mark)))
        pos = p + len(mark)
    fin = src.rfind(_FINISH, pos, end)  # the last field: found from the end
    if fin < 0:
        return None
    bounds = [*(a for _, a in at), fin + len(_FINISH)]
    stops = [p for p, _ in at[1:]] + [fin, end - 1]  # end - 1: the closing brace
    return [src[a:b] for a, b in zip(bounds, stops)]


_PARSER = simdjson.Parser()


_AS = {"d": np.float64, "i": np.int64}


def _flat(raw: bytes, of_type: str = "d") -> np.ndarray | None:
    """Every number of a JSON document of nested arrays, flattened (simdjson): float64 ("d"),
    or int64 ("i": a number written with a fraction or exponent is refused, as msgspec's int
    is). None when it is not valid JSON, holds anything but numbers, or one out of range."""
    try:
        return np.frombuffer(_PARSER.parse(raw).as_buffer(of_type=of_type), dtype=_AS[of_type])
    except RuntimeError:  # the shared parser is still held (another thread, a live document)
        try:
            return np.frombuffer(simdjson.Parser().parse(raw).as_buffer(of_type=of_type), dtype=_AS[of_type])
        except (ValueError, TypeError, RuntimeError):
            return None
    except (ValueError, TypeError):
        return None


def _list(raw: bytes, of_type: str) -> np.ndarray | None:
    """A flat JSON list of numbers (token ids, logprobs) as an array; None for anything else."""
    if not raw.startswith(b"[") or raw.count(b"[") != 1:  # simdjson would flatten [[1], [2]]
        return None
    return _flat(raw, of_type)


@functools.lru_cache(maxsize=64)
def _skeleton(n: int, k: int) -> bytes:
    """The brackets and commas of n steps of k [id, logprob] pairs, as the runner writes them."""
    step = b"[" + b",".join([b"[,]"] * k) + b"]"
    return b"[" + b",".join([step] * n) + b"]"


def _pairs_per_step(raw: bytes, n: int) -> int:
    """k when a top-k section is laid out as the runner writes it, n steps of k [id, logprob]
    pairs (nothing but numbers between its brackets and commas); else 0 (ragged, nested
    otherwise, nulls or whitespace)."""
    if n == 0 or not raw.startswith(b"[[["):
        return 0
    skeleton = raw.translate(None, _NUMBER_BYTES)  # the brackets and commas alone
    first = skeleton.find(b"]]")
    k = skeleton.count(b"[,]", 0, first + 1) if first >= 0 else 0
    return k if k and skeleton == _skeleton(n, k) else 0


def _tops(raw: bytes, n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(ids, lps) of a top-k section written as n steps of k [id, logprob] pairs each."""
    k = _pairs_per_step(raw, n)
    if not k:
        return None
    flat = _flat(raw)
    if flat is None or len(flat) != n * k * 2:
        return None
    pairs = flat.reshape(n, k, 2)
    ids = pairs[:, :, 0]
    as_int = ids.astype(np.int64)  # JSON has no inf or NaN and simdjson refuses 1e400: every number is finite
    if not (as_int == ids).all() or as_int.min() < 0 or as_int.max() >= _MAX_ID:
        return None  # an id with a fraction, negative, or past what a float64 holds exactly
    return as_int, np.ascontiguousarray(pairs[:, :, 1])


def payload(rec: TraceRecord, tops: bool = True) -> Payload | None:
    """The record's payload as arrays, validated as records.check_trace_record would; None
    when it is not laid out as the runner writes it (the reference path then reads it).
    `tops=False`: the top-k section is kept as bytes and read per step when a divergence needs
    it (_LazyTops), for a comparison without drift (engine.compare(drift=False))."""
    parts = _sections(rec)
    if parts is None:
        return None
    ids_raw, texts_raw, text_raw, lps_raw, tops_raw, fin_raw = parts
    fin = {b'"length"': "length", b'"stop"': "stop"}.get(fin_raw)
    if fin is None:
        return None
    ids = _list(ids_raw, "i")
    lps = None if lps_raw == b"null" else _list(lps_raw, "d")
    if ids is None or (lps is None and lps_raw != b"null"):
        return None
    n = len(ids)
    if (n and ids.min() < 0) or (lps is not None and (len(lps) != n or not np.isfinite(lps).all())):
        return None
    lazy = None
    if tops_raw == b"null":
        top_ids = top_lps = None
    elif not tops:
        top_ids = top_lps = None
        lazy = tops_raw
    else:
        got = _tops(tops_raw, n)
        if got is None:
            return None
        top_ids, top_lps = got
    try:  # validated here as check_trace_record would; used only on a divergence
        _STRS.decode(texts_raw), _STR.decode(text_raw)
    except msgspec.DecodeError:
        return None
    return Payload(ids, lps, top_ids, top_lps, texts_raw, text_raw, fin, lazy)


class _Tops(Sequence):
    """top_logprobs of a View: step i as [[id, logprob], ...], built on access."""

    def __init__(self, ids: np.ndarray, lps: np.ndarray) -> None:
        self._ids, self._lps = ids, lps

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return [[t, lp] for t, lp in zip(self._ids[i].tolist(), self._lps[i].tolist())]


_STEP = msgspec.json.Decoder(list[tuple[int, float]])
_ANY = msgspec.json.Decoder()
_LAZY_STEPS = 32  # past this many steps, the whole section is read as arrays at once


class _LazyTops(Sequence):
    """top_logprobs of a View made with payload(tops=False): step i decoded from the raw section
    on access, as the reference path reads it. The section is first checked against the runner's
    layout (n steps of k pairs); any other layout, an id not an integer, or an access past
    _LAZY_STEPS reads the whole section at once (as arrays, or as JSON when it is irregular)."""

    def __init__(self, raw: bytes, n: int) -> None:
        self._raw, self._n = raw, n
        self._whole: Any = None  # the whole section: a _Tops or a list
        self._ends = [1]  # raw offsets where the steps found so far end (and the next begins after ",")
        self._checked = False

    def _all(self) -> Any:
        if self._whole is None:
            got = _tops(self._raw, self._n)
            self._whole = _Tops(*got) if got is not None else _ANY.decode(self._raw)
        return self._whole

    def _regular(self) -> bool:
        if not self._checked:
            self._checked = True
            if not _pairs_per_step(self._raw, self._n):
                self._all()
        return self._whole is None

    def __len__(self) -> int:
        return self._n if self._regular() else len(self._whole)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not self._regular() or i >= _LAZY_STEPS or i < 0:
            return self._all()[i]
        while len(self._ends) <= i + 1:
            start = self._ends[-1]
            end = self._raw.find(b"]]", start) + 2
            self._ends.append(end + 1)  # past the comma
        start, end = self._ends[i], self._ends[i + 1] - 1
        try:
            step = _STEP.decode(self._raw[start:end])
        except msgspec.DecodeError:
            return self._all()[i]
        if any(t < 0 for t, _ in step):
            return self._all()[i]
        return [[t, lp] for t, lp in step]


class View(dict):
    """A trace record whose payload lives in a Payload: the header as keys, the generated
    fields built on first access (as lists, as the reference code reads them)."""

    def __init__(self, rec: TraceRecord, p: Payload) -> None:
        super().__init__({k: dict.__getitem__(rec, k) for k in rec.keys()})
        self.payload, self.where = p, rec.where

    def __missing__(self, key: str) -> Any:
        p = self.payload
        if key == "token_ids":
            value: Any = p.ids.tolist()
        elif key == "logprobs":
            value = None if p.lps is None else p.lps.tolist()
        elif key == "top_logprobs":
            if p.tops_raw is not None:
                value = _LazyTops(p.tops_raw, len(p.ids))
            else:
                value = None if p.top_ids is None else _Tops(p.top_ids, p.top_lps)
        elif key == "token_texts":
            value = _STRS.decode(p.texts_raw)
        elif key == "text":
            value = _STR.decode(p.text_raw)
        elif key == "finish_reason":
            value = p.finish_reason
        else:
            raise KeyError(key)
        self[key] = value  # kept: a View lives while its pair is settled (compare/pairs.py), then goes
        return value

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default


def _top_arrays(p: Payload) -> Any:
    """(ids, lps) of the top-k section, None without one, _IRREGULAR when it is not laid out as n x k pairs."""
    if p.tops_raw is not None:
        got = _tops(p.tops_raw, len(p.ids))
        return _IRREGULAR if got is None else got
    return None if p.top_ids is None else (p.top_ids, p.top_lps)


_IRREGULAR = object()


def logprob_step(a: View, b: View, stop: int, atol: float) -> Any:
    """divergence._logprob_step on arrays: the first step < stop whose chosen-token logprob or
    top-k differs by more than atol, with that difference, or None; NotImplemented when a top-k
    section is irregular (the reference loop then reads it). A step whose two top-k lists hold
    the same distinct ids in the same order is measured on the arrays; any other step (ids moved,
    swapped in or repeated) by divergence._topk_diff itself, as the reference loop would."""
    from .divergence import _topk_diff

    pa, pb = a.payload, b.payload
    if pa.lps is None or pb.lps is None:
        return None
    m = min(stop, len(pa.lps), len(pb.lps))
    if m <= 0:
        return None
    d = np.abs(pa.lps[:m] - pb.lps[:m])
    if pa.tops_raw is not None or pb.tops_raw is not None:  # top-k kept as bytes (a comparison without drift)
        over = np.flatnonzero(d > atol)
        if over.size and over[0] < _LAZY_STEPS:
            return NotImplemented  # the reference loop stops by that step, reading only the steps before it
    ta, tb = _top_arrays(pa), _top_arrays(pb)
    if ta is _IRREGULAR or tb is _IRREGULAR:
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
        rows = _Tops(*ta)[i], _Tops(*tb)[i]
        di = max(float(d[i]), _topk_diff(rows[0], rows[1], atol)) if rows[0] != rows[1] else float(d[i])
        if di > atol:
            return i, di
    return (first, float(d[first])) if first < m else None


def views(a: Any, b: Any, tops: bool = True) -> tuple[Any, Any]:
    """Both records as Views when both payloads read as arrays, else both unchanged.
    `tops=False`: their top-k sections are read per step on access (payload)."""
    if not (isinstance(a, TraceRecord) and isinstance(b, TraceRecord)):
        return a, b
    pa = payload(a, tops)
    pb = payload(b, tops) if pa is not None else None
    if pa is None or pb is None:
        return a, b
    return View(a, pa), View(b, pb)


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
    k columns (contiguous copies): numpy reduces a short last axis slowly."""
    pt, qt = np.ascontiguousarray(p.T), np.ascontiguousarray(q.T)  # (k, m)
    zp = np.log(_colsum(np.exp(pt)))
    zq = np.log(_colsum(np.exp(qt)))
    pt -= zp
    qt -= zq
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


__all__ = ["Payload", "View", "kl_rows", "logprob_step", "pair_drift", "payload", "same_tokens", "views"]
