"""records.check_trace_record (and scan_line's patterns) are schemas/trace_record.schema.json
by hand: on every record here, valid and broken, as a dict or as a trace line, they give
jsonschema's answer (they may only be stricter about NaN/Infinity)."""

from __future__ import annotations

import copy
import json
import random

import pytest

import detllm
from detllm.runfolder.artifacts import READABLE_SCHEMA_VERSIONS, SCHEMA_VERSION, _validator
from detllm.core.hashing import canonical_json
from detllm.runfolder import tracescan
from detllm.runfolder.integrity import scan_line
from detllm.runfolder.records import check_trace_record


@pytest.fixture(params=["patterns", "long-path"])
def scan_path(request, monkeypatch) -> str:
    """Each scan_line test runs twice: as on short arrays (regular expressions), and with every
    array treated as long (simdjson + bytes.translate, tracescan._long_numbers_ok)."""
    if request.param == "long-path":
        monkeypatch.setattr(tracescan, "LONG_VALUE", 0)
    return request.param


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fast") / "run"
    detllm.run(backend="fake", tier=2, out=out, max_new_tokens=6, top_k=3)
    return json.loads((out / "trace.jsonl").read_text().splitlines()[0])


def schema_ok(rec) -> bool:
    # a record is read under its own version's schema (artifacts.validate); any other value is judged by the current one
    v = rec.get("schema_version") if isinstance(rec, dict) else None
    v = v if isinstance(v, str) and v in READABLE_SCHEMA_VERSIONS else SCHEMA_VERSION
    return next(iter(_validator("trace_record", v).iter_errors(rec)), None) is None


VALUES = [None, True, False, 0, -1, 1, 2.0, 2.5, -0.5, "", "x", "a" * 64, "length", "1", [], [1], [-1], [1.0], [None],
          [[1, -0.5]], [[1, None]], [[1]], [[1, 2, 3]], [[-1, 0.0]], [[True, 0.0]], [[1.5, 0.0]], [["1", 0.0]], [[]],
          [[[1, -0.5]]], [[[1, -0.5], [2, -1.0]]], [[[1]]], [[[1, "x"]]], [[[1, True]]], [["x"]], {}, {"a": 1}]


def mutations(rec: dict):
    """Every field replaced by every value, every field removed, an extra field, nested edits."""
    for key in rec:
        for v in VALUES:
            m = dict(rec)
            m[key] = copy.deepcopy(v)
            yield m
        m = dict(rec)
        del m[key]
        yield m
    yield {**rec, "extra": 1}
    for key in ("token_ids", "logprobs", "token_texts", "input_ids"):
        for v in (None, True, -1, 1.0, 1.5, "s", [], [1]):
            m = copy.deepcopy(rec)
            m[key][0] = v
            yield m
    for path in ((0, 0, 0), (0, 0, 1), (0, 0), (0,)):
        for v in (None, True, -1, 1.0, 1.5, "s", [], [1, 2], [1, 2, 3]):
            m = copy.deepcopy(rec)
            target = m["top_logprobs"]
            for p in path[:-1]:
                target = target[p]
            target[path[-1]] = v
            yield m


def fast_ok(m) -> bool:
    """Both fast paths: the parsed record, and the compact line the runner would write."""
    as_dict = check_trace_record(m) is None
    fields, prechecked, _ = scan_line(json.dumps(m, ensure_ascii=False, separators=(",", ":")).encode())
    as_line = check_trace_record(fields, prechecked) is None
    assert as_dict == as_line, m
    return as_dict


def test_fast_check_agrees_with_jsonschema_on_every_mutation(scan_path, record):
    assert fast_ok(record) and schema_ok(record)
    answers = []
    for m in mutations(record):
        ok = schema_ok(m)
        assert fast_ok(m) == ok, m
        answers.append(ok)
    assert len(answers) > 600 and 50 < sum(answers) < len(answers) - 50, "both answers, many times"


def test_fast_check_agrees_on_random_mutations(scan_path, record):
    rng = random.Random(1234)
    answers = set()
    for _ in range(2000):
        m = copy.deepcopy(record)
        for _ in range(rng.randint(1, 3)):
            key = rng.choice(sorted(m))
            target = m[key]
            if isinstance(target, list) and target and rng.random() < 0.6:
                i = rng.randrange(len(target))
                if isinstance(target[i], list) and target[i] and rng.random() < 0.5:
                    j = rng.randrange(len(target[i]))
                    target[i][j] = copy.deepcopy(rng.choice(VALUES))
                else:
                    target[i] = copy.deepcopy(rng.choice(VALUES))
            else:
                m[key] = copy.deepcopy(rng.choice(VALUES))
        ok = schema_ok(m)
        assert fast_ok(m) == ok, m
        answers.add(ok)
    assert answers == {True, False}, "the mutations reach both answers"


@pytest.mark.parametrize("text, ok", [
    ('"token_ids":[1.0,2]', True),  # an integer-valued float is a JSON Schema integer: parsed, accepted
    ('"token_ids":[01]', None),  # not JSON
    ('"token_ids":[-1]', False),
    ('"token_ids":[1, 2]', True),  # spaces: parsed instead of matched
    ('"logprobs":[-1e-300,-0.0,-0,null,12345678901234567.5]', True),
    ('"logprobs":[1e400]', False),  # overflows to Infinity: refused (stricter than the schema)
    ('"token_texts":["a\\u00e9\\"","\\ud83d"]', True),
    ('"token_texts":["tab\there"]', None),  # a raw control character: not JSON
    ('"top_logprobs":[[],[[1,null]]]', True),
    ('"top_logprobs":[[[1,-0.5,2]]]', False),
])
def test_scan_line_on_edge_cases(scan_path, record, text, ok):
    key = text.split('"')[1]
    base = {k: v for k, v in record.items() if k != key}
    line = ("{" + json.dumps(base, separators=(",", ":"))[1:-1] + "," + text + "}").encode()
    if ok is None:
        with pytest.raises(ValueError):
            scan_line(line)
        with pytest.raises(ValueError):
            json.loads(line)
        return
    fields, prechecked, _ = scan_line(line)
    assert (check_trace_record(fields, prechecked) is None) == ok
    if key != "logprobs" or ok:
        assert schema_ok(json.loads(line)) == ok


def test_fast_check_refuses_non_finite_numbers(record):
    m = copy.deepcopy(record)
    m["logprobs"][0] = float("inf")
    assert check_trace_record(m) is not None


def test_scan_line_guess_is_canonical_for_runner_lines(scan_path, record):
    line = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
    fields, prechecked, guess = scan_line(line)
    assert guess == canonical_json(record)
    assert prechecked == {"input_ids", "token_ids", "token_texts", "logprobs", "top_logprobs"}
    assert {k: v for k, v in fields.items() if k not in prechecked} == {k: v for k, v in record.items() if k not in prechecked}
    fields, prechecked, guess = scan_line(json.dumps(record).encode())  # ", " and ": " spacing
    assert fields == record and not prechecked and guess != canonical_json(record)  # verify re-serialises
    for bad in (b'{"a":1,}', b'{"a":1', b'{"a":1}x', b"{a:1}", b""):
        with pytest.raises(ValueError):
            scan_line(bad)


# ---------------------------------------------------------------- long arrays (tracescan._long_numbers_ok)


def _field_ok(record: dict, key: str, text: bytes) -> bool:
    """The reference: the value parsed by the json module, the record judged by check_trace_record."""
    try:
        value = json.loads(text)
        return check_trace_record({**record, key: value}) is None
    except (ValueError, OverflowError):  # not JSON; an integer too large to be a float
        return False


LONG_CASES = {
    "top_logprobs": [b"[]", b"[[]]", b"[[],[]]", b"[[[1,-0.5]]]", b"[[[0,0]],[[12,-1e-5],[3,2E+3]]]", b"[[[1,-0]]]",
                     b"[[[18446744073709551615,-1.5]]]", b"[[[18446744073709551616,-1.5]]]", b"[5]", b"[[5]]", b"[[[5]]]",
                     b"[[5,[1,2]]]", b"[[[1,2]],[3]]", b"[[[1,2]],5]", b"[[[01,-0.5]]]", b"[[[1,-01]]]", b"[[[-1,0.5]]]",
                     b"[[[1.0,0.5]]]", b"[[[1e2,0.5]]]", b"[[[1,1e400]]]", b"[[[1,-1.7976931348623159e308]]]",
                     b"[[[1,1.7976931348623157e308]]]", b"[[[1,0.5,2]]]", b"[[[1]]]", b"[[[,0.5]]]", b"[[[1,]]]",
                     b"[[[1,null]]]", b"[[[1,NaN]]]", b"[[[1,-.5]]]", b"[[[1,1.]]]", b"[[[1,1e]]]", b"[[[1,--1]]]",
                     b"[[[1,+1]]]", b"[[[1,0.5]] ]", b"[[[1,0.5]]],", b"[[[1,0.5]]][]", b"[[[1,0.5]],]", b"[[[[1,2]]]]",
                     b'[[["a",0.5]]]', b"[[[1,0.5]],[]]", b"[[[1,1e-400]]]", b"[[[1,100000000000000000000000]]]"],
    "logprobs": [b"[]", b"[-0.5,1e-5,0,-0]", b"[5]", b"[1,]", b"[,1]", b"[1e400]", b"[1,null]", b"[[1]]", b"[01]",
                 b"[1 ,2]", b"[100000000000000000000000]", b"[-.5]", b"[1]x"],
    "token_ids": [b"[]", b"[0,1,22]", b"[01]", b"[-1]", b"[1.0]", b"[1,,2]", b"[1,]", b"[,]", b"[18446744073709551616]",
                  b"[[1]]", b"[1e2]", b"[1]2"],
}


@pytest.mark.parametrize("key", sorted(LONG_CASES))
def test_long_path_accepts_only_valid_arrays(record, key):
    """Every array the long path accepts is valid by the reference (it may leave valid ones to it),
    on hand-made edge cases and on thousands of random edits of valid arrays."""
    rng = random.Random(7)
    cases = list(LONG_CASES[key])
    alphabet = b"0123456789-+.eE[],0 n\"1"
    valid_text = json.dumps(record[key], separators=(",", ":")).encode()
    for _ in range(4000):
        base = bytearray(valid_text)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(base))
            op = rng.random()
            if op < 0.4:
                base[at] = rng.choice(alphabet)
            elif op < 0.7:
                del base[at]
            else:
                base.insert(at, rng.choice(alphabet))
        cases.append(bytes(base))
    accepted = 0
    for text in cases:
        fast = tracescan._long_numbers_ok(key, text)
        assert not fast or _field_ok(record, key, text), text
        accepted += fast
    valid = sum(_field_ok(record, key, t) for t in cases)
    assert accepted > 20 and len(cases) - valid > 1000, "both answers, many times"


def test_runner_lines_take_the_long_path(record, monkeypatch):
    """On a record as the runner writes it the long path accepts every number array: the patterns
    are never consulted for them (so the tests above compare two real paths)."""
    big = copy.deepcopy(record)
    reps = 1 + tracescan.LONG_VALUE // 8
    for key in ("token_ids", "token_texts", "logprobs", "top_logprobs"):
        big[key] = big[key] * reps
    line = json.dumps(big, ensure_ascii=False, separators=(",", ":")).encode()
    for key in ("input_ids", "token_ids", "logprobs", "top_logprobs"):
        monkeypatch.setitem(tracescan._PATTERNS, key, __import__("re").compile(r"(?!)"))  # matches nothing
    fields, prechecked, guess = scan_line(line)
    assert {"token_ids", "logprobs", "top_logprobs"} <= prechecked
    assert check_trace_record(fields, prechecked) is None and guess == canonical_json(big)


@pytest.mark.parametrize("text", ["ascii", "non-ascii", "spaced", "not an object", "empty object"])
def test_scan_record_hashes_the_same_guess(record, text):
    """scan_record's pieces (views into an ASCII line) hash to scan_line's guess."""
    import hashlib

    rec = dict(record, prompt_text="caf\u00e9 \u2603") if text == "non-ascii" else record
    line = json.dumps(rec, ensure_ascii=False, separators=(", ", ": ") if text == "spaced" else (",", ":")).encode()
    if text in ("not an object", "empty object"):
        line = b"[1,2]" if text == "not an object" else b"{}"
    fields, prechecked, guess = scan_line(line)
    fields2, prechecked2, pieces = tracescan.scan_record(line)
    assert (fields2, prechecked2) == (fields, prechecked)
    assert tracescan.digest(pieces) == hashlib.sha256(guess).digest()
    assert (guess == canonical_json(rec)) == (text in ("ascii", "non-ascii"))
