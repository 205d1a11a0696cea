"""artifacts.TraceWriter: validated lines, NaN as null, the chain digests, nothing complete-looking on abort."""

from __future__ import annotations

import hashlib
import json

import pytest

from detllm.runfolder import artifacts
from detllm.core.errors import ArtifactError
from detllm.core.hashing import canonical_json, sha256_bytes, sha256_text


def record(**over):
    rec = artifacts.stamp("trace_record", {
        "run_index": 0, "batch_size": 1, "batch_position": 0, "prompt_index": 0, "prompt_id": sha256_text("p"),
        "prompt_text": "p", "input_ids": [1, 2], "input_ids_sha256": sha256_bytes(canonical_json([1, 2])),
        "token_ids": [5, 6], "token_texts": ["a", "b"], "text": "ab", "logprobs": [-0.5, float("nan")],
        "top_logprobs": [[[5, -0.5], [7, -1.0]], [[6, float("-inf")], [8, -2.0]]], "finish_reason": "length",
    })
    rec.update(over)
    return rec


def test_lines_are_valid_nan_is_null_and_digests_chain_the_canonical_json(tmp_path):
    w = artifacts.TraceWriter(tmp_path)
    w.write(record())
    w.write(record(prompt_index=1, logprobs=[-0.5, -0.25]))
    path = w.finish()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["logprobs"] == [-0.5, None] and lines[0]["top_logprobs"][1][0] == [6, None]
    for rec in lines:
        artifacts.validate(rec, "trace_record")
    assert w.digests == [hashlib.sha256(canonical_json(rec)).digest() for rec in lines]


def test_a_bad_record_is_refused_and_abort_leaves_no_trace(tmp_path):
    w = artifacts.TraceWriter(tmp_path)
    with pytest.raises(ArtifactError, match="trace.jsonl line 1: schema violation"):
        w.write(record(token_ids=[-1, 6]))
    w.abort()
    assert not (tmp_path / "trace.jsonl").exists()


def test_each_value_encoded_once_gives_json_dumps_lines_and_canonical_digests(tmp_path):
    """The line is json.dumps of the record in its own key order and the digest is over canonical_json,
    though each value is encoded once for both: evidence nested out of order, non-ASCII text and a
    fresh_process flag included."""
    from detllm.core.versions import CURRENT

    recs = [record(logprobs=[-0.5, -0.25], top_logprobs=[[[5, -0.5]], [[6, -0.25]]]),
            record(schema_version=CURRENT, prompt_index=1, text="é ☃ \"q\"\n", token_texts=["é", "☃"], logprobs=[-0.1, -0.2],
                   top_logprobs=None, evidence={"timing_ms": [1.0, 2.5], "server_batch": {"source": None, "in_flight": 2},
                                                "route": "/completions", "cache": {"side": "warm", "b": [{"z": 1, "a": 2}]}},
                   fresh_process=True)]
    w = artifacts.TraceWriter(tmp_path)
    for r in recs:
        w.write(r)
    lines = w.finish().read_text(encoding="utf-8").splitlines()
    assert lines == [json.dumps(r, ensure_ascii=False, separators=(",", ":"), allow_nan=False) for r in recs]
    assert lines[1].index('"server_batch"') < lines[1].index('"route"'), "the line keeps the record's own order"
    assert w.digests == [hashlib.sha256(canonical_json(r)).digest() for r in recs]
