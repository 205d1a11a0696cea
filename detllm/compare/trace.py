"""Fast reading of trace.jsonl for comparisons: headers parsed, payloads kept as bytes.

A record is a small header (run, batch, prompt, input ids) and a large payload
(generated ids, texts, logprobs, top-k). CPython parses ~20 MB/s of such JSON, so a
1,000 x 1,000-token trace would take seconds per side: every line's header is parsed
and validated here, while the payload stays raw until something reads it. Two
byte-identical payloads cannot diverge, so the engine only parses payloads that
differ from their partner. Validation is records.check_trace_record, the hand-written
equivalent of schemas/trace_record.schema.json; every header is validated, every
payload that is read, and the first and last record in full. Integrity of bytes nobody
parses is `detllm verify`'s job. Does not own what the records mean (engine, divergence).
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Any, Callable

from ..runfolder.schema_io import check_header  # (not artifacts: the pair worker imports this module, and should start fast)
from ..core.errors import ArtifactError
from ..runfolder.records import check_trace_record

PAYLOAD_KEYS = ("token_ids", "token_texts", "text", "logprobs", "top_logprobs", "finish_reason")
_PAYLOAD_SET = frozenset(PAYLOAD_KEYS)
TAIL_KEYS = ("evidence", "fresh_process")  # optional, written after the payload: read from the line's tail alone
_MARK = b',"token_ids":'  # cannot occur inside a JSON string: a quote there is escaped
# where each payload field starts, in the order the runner writes them
_SECTIONS = (b',"token_ids":', b',"token_texts":', b',"text":', b',"logprobs":', b',"top_logprobs":', b',"finish_reason":')
_BLANK = (b" ", b"\t", b"\r", b"\n", b"\x0b", b"\x0c")  # what bytes.strip() removes
# stands in for the payload while a header alone is validated
_EMPTY_PAYLOAD = {"token_ids": [], "token_texts": [], "text": "", "logprobs": None, "top_logprobs": None, "finish_reason": "length"}


class TraceRecord(dict):
    """A trace record whose payload fields are parsed (and validated) on first access."""

    __slots__ = ("_src", "_start", "_end", "where", "_file", "_tail")

    def __init__(self, header: dict[str, Any], src: "bytes | mmap.mmap | None", start: int, end: int, where: str) -> None:
        super().__init__(header)
        self._src, self._start, self._end, self.where = src, start, end, where
        self._file: Any = None  # the open file `src` is mapped from (compare/pairs.py hands it to its worker)
        self._tail = False  # whether the keys after the payload (TAIL_KEYS) were read

    def __missing__(self, key: str) -> Any:
        if self._src is not None and key in PAYLOAD_KEYS:
            self.load()
            return dict.__getitem__(self, key)
        if self._src is not None and key in TAIL_KEYS and not self._tail:
            self._read_tail()
            if key in self.keys():
                return dict.__getitem__(self, key)
        raise KeyError(key)

    def _read_tail(self) -> None:
        """The per-record facts written after the payload (a served engine's evidence, fresh_process),
        parsed from the few bytes after finish_reason without parsing the payload; anything not laid
        out that way is read by load(), which validates the whole record."""
        self._tail = True
        at = self._src.rfind(_SECTIONS[-1], self._start, self._end)
        if at >= 0 and self._src[at + 1:self._end] in _BARE_TAILS:  # a local engine's record: nothing after finish_reason
            return
        try:
            tail = json.loads(b"{" + self._src[at + 1:self._end]) if at >= 0 else None
        except ValueError:
            tail = None
        if not isinstance(tail, dict) or not all(k in (*TAIL_KEYS, "finish_reason") for k in tail) \
                or type(tail.get("evidence", {})) is not dict or type(tail.get("fresh_process", True)) is not bool:
            self.load()
            return
        self.update({k: tail[k] for k in TAIL_KEYS if k in tail})

    def get(self, key: str, default: Any = None) -> Any:
        # as self[key] with a default, without a KeyError raised and caught per call: the causes ask
        # every record for tail keys (evidence, fresh_process) that a local engine's records never hold
        if key in self:
            return dict.__getitem__(self, key)
        if self._src is None:
            return default
        if key in PAYLOAD_KEYS:
            self.load()
        elif key in TAIL_KEYS and not self._tail:
            self._read_tail()
        return dict.get(self, key, default)

    @property
    def raw_payload(self) -> bytes | None:
        """The payload as written (`,"token_ids":...}`), or None once parsed from a plain line."""
        return None if self._src is None else self._src[self._start:self._end]

    def load(self) -> "TraceRecord":
        """Parse the payload, validate the whole record, keep the bytes for comparisons."""
        if self._src is None or "token_ids" in self.keys():
            return self
        try:
            body = json.loads(b"{" + self._src[self._start + 1:self._end])
        except ValueError as exc:
            raise ArtifactError(f"{self.where}: not valid JSON") from exc
        problem = check_trace_record({**self, **body})
        if problem:
            raise ArtifactError(f"{self.where}: schema violation: {problem}")
        self.update(body)
        return self


def same_output(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """True when both payloads are byte-identical up to their evidence (so nothing generated can differ)."""
    if not (isinstance(a, TraceRecord) and isinstance(b, TraceRecord)) or a._src is None or b._src is None:
        return False
    ea, eb = _generated_end(a), _generated_end(b)
    n = ea - a._start
    # one copy, of a's payload; find() over a window exactly its size compares it with b's in place
    return n == eb - b._start and b._src.find(a._src[a._start:ea], b._start, eb) == b._start


_EVIDENCE = b',"evidence":'
_BARE_TAILS = (b'"finish_reason":"length"}', b'"finish_reason":"stop"}')  # a payload's last bytes with no tail keys
_FINISHED = (b'"finish_reason":"length"', b'"finish_reason":"stop"')


def _generated_end(rec: TraceRecord) -> int:
    """Where the generated fields of the payload end: before the evidence (what a served engine said
    of the request: its timings, retries, batch), which no comparison reads and which differs between
    any two requests, when it follows finish_reason as the runner writes it; else the payload's end.
    The last finish_reason is found from the end (near it: the payload's last section), and the
    evidence must follow it directly; one inside the evidence only makes the span longer. (Searching
    for the evidence itself read a whole payload from the end whenever a record had none.)"""
    src = rec._src
    fin = src.rfind(_SECTIONS[-1], rec._start, rec._end)
    if fin < 0:
        return rec._end
    for w in _FINISHED:
        after = fin + 1 + len(w)
        if src[fin + 1:after] == w and src[after:after + len(_EVIDENCE)] == _EVIDENCE:
            return after
    return rec._end


# payloads below this many bytes on both sides stay on the reference path: numpy's import
# (~0.1 s) costs more than the fast path saves (a 1,000-token top-5 payload is ~180 KB)
FAST_PATH_MIN_BYTES = 16_384
# ... and only when a comparison has more than this many such pairs (~20 ms each on the reference
# path): a repeat with one flipped prompt should not pay ~0.15 s of imports to parse two records
FAST_PATH_AFTER = 4


def fast_path(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether a differing pair goes through compare/fast.py (read from disk, large payloads)."""
    return (isinstance(a, TraceRecord) and isinstance(b, TraceRecord) and a._src is not None and b._src is not None
            and max(a._end - a._start, b._end - b._start) >= FAST_PATH_MIN_BYTES)


def use_fast_path(large_pairs: int) -> bool:
    """Whether a comparison with large_pairs large differing pairs reads them through compare/fast.py."""
    return large_pairs > FAST_PATH_AFTER


def payload_spans(rec: TraceRecord) -> list[tuple[int, int]] | None:
    """Where each payload value lies in the record's bytes, (start, stop) in PAYLOAD_KEYS order:
    found by the field names, in the order the runner writes them, each value ending where the
    next name begins (finish_reason, the last field, found from the end and running to the
    closing brace). None when a name is missing or the record holds no bytes."""
    src, start, end = rec._src, rec._start, rec._end
    if src is None:
        return None
    pos, names = start, []  # where each field's name begins
    for mark in _SECTIONS[:-1]:
        p = src.find(mark, pos, end)
        if p < 0:
            return None
        names.append(p)
        pos = p + len(mark)
    fin = src.rfind(_SECTIONS[-1], pos, end)  # the last field: found from the end
    if fin < 0:
        return None
    names.append(fin)
    starts = [p + len(mark) for p, mark in zip(names, _SECTIONS)]
    return list(zip(starts, [*names[1:], end - 1]))  # end - 1: the closing brace


def payload_shape(rec: TraceRecord) -> tuple[int, bool, bool] | None:
    """(generated tokens, has logprobs, has top-k) counted from the raw payload without
    parsing or copying it; None when the bytes are not laid out as the runner writes
    them (fields in order, one logprob per token). The top-k section (the bulk of the
    bytes) is never scanned: the runner writes one top-k list per token."""
    spans = payload_spans(rec)
    if spans is None:
        return None
    src = rec._src
    (ids_at, ids_end), _, _, (lps_at, lps_end), (tops_at, _), _ = spans

    def count(a: int, b: int) -> int | None:  # elements of the number array in src[a:b]
        while src[a:a + 1].isspace():
            a += 1
        if src[a:a + 4] == b"null":
            return None
        return 0 if src[a:a + 2] == b"[]" else src[a:b].count(b",") + 1  # (a mapped file has no count())

    n = count(ids_at, ids_end)
    lps = count(lps_at, lps_end)
    if n is None or (lps is not None and lps != n):
        return None
    return n, lps is not None, src[tops_at:tops_at + 4] != b"null"


def _map(path: Path) -> "tuple[bytes | mmap.mmap, Any]":
    """The file's bytes, and the open file they are mapped from (None when read into memory).
    A large trace is mapped read-only, not read: no copy, and its pages stay the page cache's
    (two 182 MB traces read into memory cost ~0.3 s and 364 MB of the process's own)."""
    f = open(path, "rb")
    try:
        size = os.fstat(f.fileno()).st_size
        if size >= _MAP_MIN_BYTES and os.name == "posix":
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # populate: one bulk fault, not 45k
            return mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ), f
        data = f.read()
    except BaseException:
        f.close()
        raise
    f.close()
    return data, None


_MAP_MIN_BYTES = 1 << 22  # below 4 MiB a read is as fast and holds no descriptor
_WARM_MIN_BYTES = 1 << 24  # a trace this large may well need compare/pairs.py's worker: start it early (spare.py)


def load_records(path: Path, keep: Callable[[dict[str, Any]], bool] = lambda h: True) -> tuple[list[TraceRecord], set[tuple[int, int]]]:
    """Records of trace.jsonl whose header passes `keep`, and every (run_index, batch_size)
    present. The first and last kept records are parsed in full as a sample."""
    try:
        data, file = _map(Path(path))
    except FileNotFoundError as exc:
        raise ArtifactError(f"{path}: missing", hint="the run may have been interrupted") from exc
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{path}: cannot be read ({exc.__class__.__name__})") from exc
    out: list[TraceRecord] = []
    present: set[tuple[int, int]] = set()
    pos, n, line_no = 0, len(data), 0
    if file is not None and n >= _WARM_MIN_BYTES:
        from . import spare

        spare.warm()  # a worker for the comparison that may follow imports while the headers are read (compare/pairs.py)
    while pos < n:
        end = data.find(b"\n", pos)
        end = n if end < 0 else end
        line_no += 1
        stop = end - 1 if end > pos and data[end - 1:end] == b"\r" else end
        if stop > pos and (data[pos:pos + 1] not in _BLANK or data[pos:stop].strip()):  # not a blank line
            rec = _read_line(data, pos, stop, f"{path} line {line_no}")
            rec._file = file
            present.add((rec["run_index"], rec["batch_size"]))
            if keep(rec):
                out.append(rec)
        pos = end + 1
    for rec in out[:1] + out[-1:]:
        rec.load()
    return out, present


def _read_line(data: bytes, start: int, end: int, where: str) -> TraceRecord:
    mark = data.find(_MARK, start, end)
    closing = data.rfind(b"}", start, end)
    if mark > start and closing > mark and not data[closing + 1:end].strip():
        try:
            header = json.loads(data[start:mark] + b"}")
        except ValueError:
            header = None
        if isinstance(header, dict) and header.keys().isdisjoint(_PAYLOAD_SET):
            check_header(header, "trace_record", where)
            problem = check_trace_record({**header, **_EMPTY_PAYLOAD})
            if problem:
                raise ArtifactError(f"{where}: schema violation: {problem}")
            return TraceRecord(header, data, mark, closing + 1, where)
    try:  # not laid out as the runner writes it: parse the whole line
        rec = json.loads(data[start:end])
    except ValueError as exc:
        raise ArtifactError(f"{where}: not valid JSON") from exc
    check_header(rec, "trace_record", where)
    problem = check_trace_record(rec)
    if problem:
        raise ArtifactError(f"{where}: schema violation: {problem}")
    return TraceRecord(rec, None, 0, 0, where)
