"""records.check_trace_record (and scan_line's patterns) are schemas/trace_record.schema.json
by hand: on every record here, valid and broken, as a dict or as a trace line, they give
jsonschema's answer (they may only be stricter about NaN/Infinity)."""

from __future__ import annotations

import copy
import json
import random

import pytest

import detllm
from detllm.artifacts import READABLE_SCHEMA_VERSIONS, SCHEMA_VERSION, _validator
from detllm.hashing import canonical_json
from detllm.integrity import scan_line
from detllm.records import check_trace_record


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


def test_fast_check_agrees_with_jsonschema_on_every_mutation(record):
    assert fast_ok(record) and schema_ok(record)
    answers = []
    for m in mutations(record):
        ok = schema_ok(m)
        assert fast_ok(m) == ok, m
        answers.append(ok)
    assert len(answers) > 600 and 50 < sum(answers) < len(answers) - 50, "both answers, many times"


def test_fast_check_agrees_on_random_mutations(record):
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
def test_scan_line_on_edge_cases(record, text, ok):
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


def test_scan_line_guess_is_canonical_for_runner_lines(record):
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
