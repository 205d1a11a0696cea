"""integrity.check_trace_record is schemas/trace_record.schema.json by hand: on every record
here, valid and broken, it gives jsonschema's answer (it may only be stricter about NaN/Infinity)."""

from __future__ import annotations

import copy
import json
import random

import pytest

import detllm
from detllm.artifacts import _validator
from detllm.hashing import canonical_json
from detllm.integrity import check_trace_record, parse_line


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fast") / "run"
    detllm.run(backend="fake", tier=2, out=out, max_new_tokens=6, top_k=3)
    return json.loads((out / "trace.jsonl").read_text().splitlines()[0])


def schema_ok(rec) -> bool:
    return next(iter(_validator("trace_record").iter_errors(rec)), None) is None


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


def test_fast_check_agrees_with_jsonschema_on_every_mutation(record):
    assert check_trace_record(record) is None and schema_ok(record)
    answers = []
    for m in mutations(record):
        ok = schema_ok(m)
        assert (check_trace_record(m) is None) == ok, m
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
        assert (check_trace_record(m) is None) == ok, m
        answers.add(ok)
    assert answers == {True, False}, "the mutations reach both answers"


def test_fast_check_refuses_non_finite_numbers(record):
    m = copy.deepcopy(record)
    m["logprobs"][0] = float("inf")
    assert check_trace_record(m) is not None


def test_parse_line_guess_is_canonical_for_runner_lines(record):
    line = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
    rec, guess = parse_line(line)
    assert rec == record and guess == canonical_json(record)
    spaced = json.dumps(record).encode()
    rec, guess = parse_line(spaced)
    assert rec == record and guess != canonical_json(record)  # verify then falls back to canonical_json
    for bad in (b'{"a":1,}', b'{"a":1', b'{"a":1}x', b"{a:1}", b""):
        with pytest.raises(ValueError):
            parse_line(bad)
