"""Reading trace.jsonl fast for `verify`: one line -> its fields, a canonical-JSON guess, and
which of its big arrays were validated on their text instead of being parsed.

Owns the text-level checks of a trace line's number arrays (regular expressions, and for
long arrays simdjson plus byte counts) and the line reader that hashes every byte it reads.
Every check here is *sufficient*: whatever it does not accept is parsed with the json module
and judged by records.check_trace_record, so the speed changes, never the answer
(tests/test_integrity_fastcheck.py holds both paths to jsonschema's answers). Does not own
the chain or the manifest (integrity.py).
"""

from __future__ import annotations

import hashlib
import json
import queue
import re
import threading
from pathlib import Path
from typing import Any, Iterator

_DECODER = json.JSONDecoder()
_WS = " \t\n\r"
PRECHECKED = object()  # stands in for a value validated by its pattern and left unparsed

# Patterns for the big arrays of a trace record, on compact JSON text. A match proves the value
# is valid JSON *and* valid for its field in schemas/trace_record.schema.json (the numbers are
# finite: at most 16 integer digits, exponents up to e+99); anything they do not match (spaces,
# 1.0 as an id, ...) is parsed and checked in full instead. Possessive quantifiers: no backtracking.
_INT = r"(?:0|[1-9][0-9]*+)"
_NUM = r"(?:-?+(?:0|[1-9][0-9]{0,15}+)(?:\.[0-9]++)?+(?:[eE](?:-[0-9]{1,3}+|\+?+[0-9]{1,2}+))?+|null)"
_STR = r'"(?:[^"\\\x00-\x1f]++|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*+"'
_PAIR = rf"\[{_INT},{_NUM}\]"
_STEP = rf"\[(?:{_PAIR}(?:,{_PAIR})*+)?+\]"
_PATTERNS = {
    "input_ids": re.compile(rf"null|\[(?:{_INT}(?:,{_INT})*+)?+\]"),
    "token_ids": re.compile(rf"\[(?:{_INT}(?:,{_INT})*+)?+\]"),
    "token_texts": re.compile(rf"\[(?:{_STR}(?:,{_STR})*+)?+\]"),
    "logprobs": re.compile(rf"null|\[(?:{_NUM}(?:,{_NUM})*+)?+\]"),
    "top_logprobs": re.compile(rf"null|\[(?:{_STEP}(?:,{_STEP})*+)?+\]"),
}

# ---------------------------------------------------------------- long number arrays
# The patterns above match ~150 MB/s; a 1,000-token top-5 record's top_logprobs is ~140 KB. For
# values this long the text is checked instead in three C passes: simdjson parses it (valid
# JSON, every number a finite double or a 64-bit integer: it refuses 1e400 and bigger integers),
# bytes.translate drops its digits, and a pattern reads the shape off what is left (~1/4 of it).
LONG_VALUE = 4096  # characters; shorter values keep the patterns (and simdjson is never imported)
_DIGITS = b"0123456789"
_NUMBER_CHARS = b"0123456789-.eE+"
_LP_MARKS = rb"\[,[-.eE+]*+\]"  # one [id,logprob] pair without its digits
_STEP_MARKS = rb"\[(?:%s(?:,%s)*+)?+\]" % (_LP_MARKS, _LP_MARKS)
_TOPS_MARKS = re.compile(rb"\[(?:%s(?:,%s)*+)?+\]" % (_STEP_MARKS, _STEP_MARKS))
_local = threading.local()  # a simdjson parser per thread: one parser holds one document at a time


def _json_ok(value: bytes) -> bool:
    """simdjson accepts `value` as one JSON document (finite numbers only, 64-bit integers)."""
    parser = getattr(_local, "parser", None)
    if parser is None:
        import simdjson  # lazy: only traces with long arrays need it

        parser = _local.parser = simdjson.Parser()
    try:
        parser.parse(value)  # the document is dropped at once, so the parser can take the next
    except Exception:  # ValueError (not JSON, NUMBER_ERROR), RuntimeError (BIGINT_ERROR), ...
        return False
    return True


def _long_numbers_ok(key: str, value: bytes) -> bool:
    """Whether `value` (the compact text of field `key`) is valid for its field by the schema.
    False means "not shown here", never "invalid": the caller parses the value then."""
    if key in ("token_ids", "input_ids"):  # digits and commas in one [...]: non-negative integers
        return value.translate(None, _DIGITS + b",") == b"[]" and _json_ok(value)
    if key == "logprobs":  # numbers and commas in one [...]: a flat list of (finite) numbers
        return value.translate(None, _NUMBER_CHARS + b",") == b"[]" and _json_ok(value)
    if key != "top_logprobs":
        return False
    # what is left of each [id,logprob] pair once the digits go: "[,-.]", "[,-.e-]", ...; the
    # pattern allows nothing but number characters, commas and the three levels of brackets. A
    # pair's id leaves nothing, so it was digits only: an integer >= 0 (JSON has no leading zeros).
    # In valid JSON an element is never empty, so each "[,...]" is an array of exactly two numbers.
    marks = value.translate(None, _DIGITS)
    if _TOPS_MARKS.fullmatch(marks) is None:
        return False
    if b"[]" in marks and marks.count(b"[]") != value.count(b"[]"):
        return False  # an empty step or list, or a step or list holding one integer ("[5]" leaves "[]")
    return _json_ok(value)


def _long_value_end(key: str, s: str, i: int, body: bytes | None) -> int | None:
    """Where the long number array of `key` starting at s[i] ends, if its text was shown valid
    by _long_numbers_ok; None otherwise. Such an array holds no '"', so in compact JSON it ends
    right before the ',"' of the next key, or before the closing '}' when it is the last field.
    `body`: the line's bytes when it is ASCII (then an offset in s is one in body)."""
    if key not in ("token_ids", "input_ids", "logprobs", "top_logprobs") or s[i:i + 1] != "[":
        return None
    j = s.find('"', i)
    if j < 0:
        k = len(s) - 1
        while k > i and s[k] in _WS:
            k -= 1
        end = k if s[k] == "}" else -1
    else:
        end = j - 1 if s[j - 1] == "," else -1
    if end - i < LONG_VALUE:
        return None
    if body is not None:
        value = body[i:end]
    else:
        try:
            value = s[i:end].encode("ascii")
        except UnicodeEncodeError:
            return None
    return end if _long_numbers_ok(key, value) else None


# ---------------------------------------------------------------- one line


def scan_line(body: bytes) -> tuple[Any, frozenset[str], bytes]:
    """One trace line -> (its fields, the fields already validated, a guess at its canonical JSON).

    Parsing ~11,000 numbers per 1,000-token record dominates verify, so the big arrays are
    checked on their text (`_PATTERNS`, or _long_numbers_ok for long ones) and left unparsed
    (value PRECHECKED); every other value is parsed. The guess is the line's own `"key":value`
    spans sorted by key: for the compact lines the runner writes it is exactly
    hashing.canonical_json(record). verify trusts a guess only when its digest lands on the
    manifest's chain and re-serialises otherwise, so the guess changes the speed, never the
    answer. Raises ValueError when the line is not JSON."""
    fields, prechecked, spans, s = _scan(body)
    return fields, prechecked, body if spans is None else _guess(spans, s)


def _guess(spans: list[tuple[str, int, int]], s: str) -> bytes:
    return ("{" + ",".join(s[a:b] for _, a, b in sorted(spans)) + "}").encode("utf-8")


def scan_record(body: bytes) -> tuple[Any, frozenset[str], list[bytes | memoryview]]:
    """scan_line with the guess as the pieces it is made of (digest(pieces) is its sha256). An
    ASCII line (what the runner writes for ASCII text) gives views into its own bytes: the guess
    is never copied."""
    fields, prechecked, spans, s = _scan(body)
    if spans is None:
        return fields, prechecked, [body]
    if len(s) != len(body):  # not ASCII: offsets in s are not offsets in body
        return fields, prechecked, [_guess(spans, s)]
    view, pieces = memoryview(body), []
    for _, a, b in sorted(spans):
        pieces += (b",", view[a:b])
    pieces[:1] = [b"{"]  # the first "," (or nothing: "{}")
    return fields, prechecked, pieces + [b"}"]


def digest(pieces: list[bytes | memoryview]) -> bytes:
    """sha256 of the pieces joined (hashlib releases the GIL on the long ones)."""
    sha = hashlib.sha256()
    for piece in pieces:
        sha.update(piece)
    return sha.digest()


def _scan(body: bytes) -> tuple[Any, frozenset[str], list[tuple[str, int, int]] | None, str]:
    """(fields, prechecked, the `"key":value` spans in s, s): the work of scan_line; spans is
    None when the line is not a JSON object (then fields is whatever it parses to)."""
    s = body.decode("utf-8")
    ascii_body = body if len(s) == len(body) else None  # one byte per character: offsets agree
    i, n = 0, len(s)
    while i < n and s[i] in _WS:
        i += 1
    if i >= n or s[i] != "{":
        return json.loads(s), frozenset(), None, s  # not an object: check_trace_record names it
    fields: dict[str, Any] = {}
    prechecked: set[str] = set()
    spans: list[tuple[str, int, int]] = []
    i += 1
    while True:
        while i < n and s[i] in _WS:
            i += 1
        if i < n and s[i] == "}" and not spans:
            i += 1
            break
        if i >= n or s[i] != '"':
            raise ValueError("expected a key")
        start = i
        key, i = json.decoder.scanstring(s, i + 1)
        while i < n and s[i] in _WS:
            i += 1
        if i >= n or s[i] != ":":
            raise ValueError("expected ':'")
        i += 1
        while i < n and s[i] in _WS:
            i += 1
        end = _long_value_end(key, s, i, ascii_body)
        if end is None and key in _PATTERNS:
            m = _PATTERNS[key].match(s, i)
            end = None if m is None else m.end()
        if end is not None:
            fields[key], i = PRECHECKED, end
            prechecked.add(key)
        else:
            try:
                fields[key], i = _DECODER.scan_once(s, i)
            except StopIteration as exc:
                raise ValueError("expected a value") from exc
            prechecked.discard(key)  # a repeated key: the last value is the one that counts
        spans.append((key, start, i))
        while i < n and s[i] in _WS:
            i += 1
        if i < n and s[i] == ",":
            i += 1
            continue
        if i < n and s[i] == "}":
            i += 1
            break
        raise ValueError("expected ',' or '}'")
    if s[i:].strip(_WS):
        raise ValueError("extra data after the object")
    return fields, frozenset(prechecked), spans, s


# ---------------------------------------------------------------- the file


_CHUNK = 4 << 20  # bytes per read of the trace


class Lines:
    """Streams a file line by line (bytes, newline stripped) while hashing every byte read.
    Reads 4 MiB at a time; a file longer than that is hashed on a second thread (hashlib lets
    go of the GIL on large buffers) while the caller works on its lines."""

    def __init__(self, path: Path) -> None:
        self.path, self.sha, self.size = path, hashlib.sha256(), 0

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        n, pending = 0, []  # pending: the pieces of a line that started in an earlier read
        hasher: _Hasher | None = None
        try:
            with open(self.path, "rb") as f:
                while chunk := f.read(_CHUNK):
                    self.size += len(chunk)
                    if hasher is None and len(chunk) == _CHUNK:
                        hasher = _Hasher(self.sha)
                    (hasher.put if hasher is not None else self.sha.update)(chunk)
                    pos = 0
                    while (nl := chunk.find(b"\n", pos)) >= 0:
                        n += 1
                        if pending:
                            pending.append(chunk[pos:nl])
                            line, pending = b"".join(pending), []
                        else:
                            line = chunk[pos:nl]
                        yield n, line
                        pos = nl + 1
                    if pos < len(chunk):
                        pending.append(chunk[pos:])
            if pending:
                yield n + 1, b"".join(pending)  # a last line without a newline
        finally:
            if hasher is not None:
                hasher.finish()  # self.sha holds every byte read once the loop is left


class _Hasher:
    """sha.update on another thread, in order; a bounded queue keeps at most 8 reads (32 MiB) waiting."""

    def __init__(self, sha: Any) -> None:
        self.queue: queue.Queue[bytes | None] = queue.Queue(maxsize=8)
        self.thread = threading.Thread(target=self._run, args=(sha,), name="detllm-sha256", daemon=True)
        self.thread.start()

    def _run(self, sha: Any) -> None:
        while (chunk := self.queue.get()) is not None:
            sha.update(chunk)

    def put(self, chunk: bytes) -> None:
        self.queue.put(chunk)

    def finish(self) -> None:
        self.queue.put(None)
        self.thread.join()
