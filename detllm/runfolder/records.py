"""Trace records: the fast check equivalent to schemas/trace_record.schema.json.

A 1,000-token record holds ~11,000 numbers; jsonschema takes ~170 ms on it, this check
about 1/100 of that. The TraceWriter (while a run writes), `diff` and `verify` all use it;
tests/test_integrity_fastcheck.py holds it to jsonschema's answers.
"""

from __future__ import annotations

import math
import re
from itertools import chain
from operator import itemgetter
from typing import Any

from .schema_io import READABLE_SCHEMA_VERSIONS, load_schema

_HEX64 = re.compile(r"[0-9a-f]{64}")
_TRACE_KEYS = frozenset(load_schema("trace_record")["required"])
# the optional keys each version's schema allows (evidence came in version 2, fresh_process later): a record
# is read under its own version's schema, so a version-1 record holding evidence is refused, as jsonschema does
_OPTIONAL_KEYS = {v: frozenset(load_schema("trace_record", v)["properties"]) - _TRACE_KEYS for v in READABLE_SCHEMA_VERSIONS}
_ANY_OPTIONAL = frozenset().union(*_OPTIONAL_KEYS.values())


def check_trace_record(rec: Any, prechecked: frozenset[str] = frozenset()) -> str | None:
    """schemas/trace_record.schema.json by hand, ~100x faster than jsonschema on long traces
    (tests/test_integrity_fastcheck.py holds the two to the same answers). Stricter in one way:
    Infinity/NaN are refused, since detllm never writes them. Fields in `prechecked` were
    validated on their text by scan_line. Returns the first problem or None."""
    if type(rec) is not dict:
        return "expected a JSON object"
    if rec.keys() != _TRACE_KEYS:
        allowed = _OPTIONAL_KEYS.get(rec.get("schema_version"), _ANY_OPTIONAL) if type(rec.get("schema_version")) is str else _ANY_OPTIONAL
        missing, extra = sorted(_TRACE_KEYS - rec.keys()), sorted(rec.keys() - _TRACE_KEYS - allowed)
        if missing or extra:
            return f"missing {missing}" if missing else f"unexpected {extra}"
        if "evidence" in rec and type(rec["evidence"]) is not dict:
            return "evidence is not an object"
    if type(rec["schema_version"]) is not str or rec["schema_version"] not in READABLE_SCHEMA_VERSIONS:
        return f"schema_version is not one of {list(READABLE_SCHEMA_VERSIONS)}"
    if rec["artifact_type"] != "trace_record" or type(rec["artifact_type"]) is not str:
        return "artifact_type is not 'trace_record'"
    for key, lo in (("run_index", 0), ("batch_size", 1), ("batch_position", 0), ("prompt_index", 0)):
        if not _int(rec[key], lo):
            return f"{key} is not an integer >= {lo}"
    for key in ("prompt_id", "input_ids_sha256"):
        if type(rec[key]) is not str or not _HEX64.fullmatch(rec[key]):
            return f"{key} is not a sha256 hex digest"
    if rec["prompt_text"] is not None and type(rec["prompt_text"]) is not str:
        return "prompt_text is not a string or null"
    if type(rec["text"]) is not str:
        return "text is not a string"
    if rec["finish_reason"] not in ("length", "stop") or type(rec["finish_reason"]) is not str:
        return "finish_reason is not 'length' or 'stop'"
    for key, nullable in (("input_ids", True), ("token_ids", False)):
        v = rec[key]
        if key not in prechecked and not ((nullable and v is None) or (type(v) is list and (_ints(v) or (not nullable and _ids(v))))):
            return f"{key} is not a list of integers >= 0" + (" or null" if nullable else " (or token strings)")
    texts = rec["token_texts"]
    if "token_texts" not in prechecked and (type(texts) is not list or not _types(texts) <= {str}):
        return "token_texts is not a list of strings"
    lps = rec["logprobs"]
    if "logprobs" not in prechecked and lps is not None and (type(lps) is not list or not _nums(lps)):
        return "logprobs is not a list of numbers or nulls, or null"
    tops = rec["top_logprobs"]
    if "top_logprobs" not in prechecked and tops is not None and not _tops(tops):
        return "top_logprobs is not a list of [[token_id >= 0 or token string, logprob or null], ...] per step, or null"
    return None


# The list checks run in C where they can (map, set, min): a 1,000-token top-5 record holds 11,000
# numbers. Each falls back to an element-by-element check when the fast form does not apply.

def _types(xs: list) -> set:
    return set(map(type, xs))


def _int(x: Any, lo: int) -> bool:
    # JSON Schema "integer" is any number with a zero fractional part (1.0 counts), never a bool
    return (type(x) is int and x >= lo) or (type(x) is float and x.is_integer() and x >= lo)


def _ints(xs: list) -> bool:
    if _types(xs) <= {int}:
        return not xs or min(xs) >= 0
    return all(_int(x, 0) for x in xs)


def _nums(xs: list) -> bool:
    """Numbers or nulls, finite."""
    kinds = _types(xs)
    if not kinds <= {float, int, type(None)}:
        return False
    return all(map(math.isfinite, xs if type(None) not in kinds else (x for x in xs if x is not None)))


def _tops(tops: Any) -> bool:
    if type(tops) is not list or not _types(tops) <= {list}:
        return False
    pairs = list(chain.from_iterable(tops))
    if not _types(pairs) <= {list} or not set(map(len, pairs)) <= {2}:
        return False
    return _ids(list(map(itemgetter(0), pairs))) and _nums(list(map(itemgetter(1), pairs)))


def _ids(xs: list) -> bool:
    """Token ids >= 0, or token strings where a served model gives no ids (each element either)."""
    if _types(xs) <= {str}:
        return True
    return _ints(xs) or all(type(x) is str or _int(x, 0) for x in xs)
