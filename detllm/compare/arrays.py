"""A differing payload parsed straight into arrays (`Payload`: simdjson for the numbers, msgspec
for the texts), and `View`, the record read through them. A record not laid out as the runner
writes it gets no Payload and takes the reference path. Computes nothing on the arrays
(compare/fast.py does) and decides nothing about which pairs come here (compare/pairs.py).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import msgspec
import numpy as np
import simdjson

from .trace import TraceRecord, payload_spans

_STRS = msgspec.json.Decoder(list[str])
_STR = msgspec.json.Decoder(str)
_NUMBER_BYTES = b"0123456789.-+eE"
_MAX_ID = 2**53  # ids read as float64 are exact below this


class Payload:
    """A record's generated steps as arrays. ids (n,) int64; lps (n,) float64 or None;
    top_ids (n, k) int64 and top_lps (n, k) float64, or None; texts and text as raw JSON.
    The arrays are read-only: a divergence is reported from them after the drift was computed
    on them, so an in-place write (a view numpy did not copy) raises instead of changing the
    numbers reported."""

    __slots__ = ("ids", "lps", "top_ids", "top_lps", "texts_raw", "text_raw", "finish_reason", "tops_raw")

    def __init__(self, ids, lps, top_ids, top_lps, texts_raw: bytes, text_raw: bytes, finish_reason: str,
                 tops_raw: bytes | None = None) -> None:
        for arr in (ids, lps, top_ids, top_lps):
            if arr is not None:
                arr.flags.writeable = False
        self.ids, self.lps, self.top_ids, self.top_lps = ids, lps, top_ids, top_lps
        self.texts_raw, self.text_raw, self.finish_reason = texts_raw, text_raw, finish_reason
        self.tops_raw = tops_raw  # the top-k section, not parsed yet (payload(tops=False)); else None


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
    """(ids, lps) of a top-k section written as n steps of k [id, logprob] pairs each. One liberty:
    the numbers are read by type, so a hand-written `5.0` as a top-k id or `0` as a logprob reads
    as 5 and 0.0 (the runner never writes either)."""
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
    spans = payload_spans(rec)
    if spans is None:
        return None
    ids_raw, texts_raw, text_raw, lps_raw, tops_raw, fin_raw = (rec._src[a:b] for a, b in spans)
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


class Tops(Sequence):
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
LAZY_STEPS = 32  # past this many steps, the whole section is read as arrays at once


class _LazyTops(Sequence):
    """top_logprobs of a View made with payload(tops=False), for a comparison without drift
    (verify's verdict re-derivation): step i decoded from the raw section on access, as the
    reference path reads it. The section is first checked against the runner's layout (n steps
    of k pairs); any other layout, an id not an integer, or an access past LAZY_STEPS reads the
    whole section at once (as arrays, or as JSON when it is irregular)."""

    def __init__(self, raw: bytes, n: int) -> None:
        self._raw, self._n = raw, n
        self._whole: Any = None  # the whole section: a Tops or a list
        self._ends = [1]  # raw offsets where the steps found so far end (and the next begins after ",")
        self._checked = False

    def _all(self) -> Any:
        if self._whole is None:
            got = _tops(self._raw, self._n)
            self._whole = Tops(*got) if got is not None else _ANY.decode(self._raw)
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
        if not self._regular() or i >= LAZY_STEPS or i < 0:
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
                value = None if p.top_ids is None else Tops(p.top_ids, p.top_lps)
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


IRREGULAR = object()  # top_arrays: a top-k section not laid out as n x k pairs


def top_arrays(p: Payload) -> Any:
    """(ids, lps) of the top-k section, None without one, IRREGULAR when it is not laid out as n x k pairs."""
    if p.tops_raw is not None:
        got = _tops(p.tops_raw, len(p.ids))
        return IRREGULAR if got is None else got
    return None if p.top_ids is None else (p.top_ids, p.top_lps)


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


__all__ = ["IRREGULAR", "LAZY_STEPS", "Payload", "Tops", "View", "payload", "top_arrays", "views"]
