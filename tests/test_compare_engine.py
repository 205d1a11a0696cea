"""The comparison engine: first divergence of each kind, noise floors, drift, and the
fast trace reader (byte-identical payloads settled unparsed, with the same answers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import detllm
from detllm.compare.divergence import NOISE_FLOORS, first_divergence, noise_floor
from detllm.compare.engine import align, compare, drift
from detllm.compare.trace import TraceRecord, load_records, payload_shape, same_output
from detllm.core.errors import ArtifactError
from detllm.core.hashing import canonical_json, sha256_bytes

FIXTURES = Path(__file__).parent / "fixtures" / "diff"


def rec(i: int, ids: list[int], lps: list[float] | None = None, tops=None, input_ids=(1, 2, 3), pid: str | None = None) -> dict:
    input_ids = list(input_ids)
    return {
        "schema_version": "1", "artifact_type": "trace_record", "run_index": 0, "batch_size": 1, "batch_position": 0,
        "prompt_index": i, "prompt_id": pid or f"{i:064x}", "prompt_text": f"p{i}", "input_ids": input_ids,
        "input_ids_sha256": sha256_bytes(canonical_json(input_ids)), "token_ids": ids,
        "token_texts": [chr(65 + t % 26) for t in ids], "text": "".join(chr(65 + t % 26) for t in ids),
        "logprobs": lps, "top_logprobs": tops, "finish_reason": "length",
    }


def top(*pairs: tuple[int, float]) -> list[list]:
    return [[t, lp] for t, lp in pairs]


def div(a: dict, b: dict, **kw):
    kw.setdefault("check_logprobs", True)
    return first_divergence(a, b, comparison="c", left_label="L", right_label="R", **kw)


def test_token_divergence_reports_both_sides_logprobs_of_both_tokens():
    tops_a = [top((5, -0.1), (6, -2.0)), top((7, -0.5), (8, -0.6))]
    tops_b = [top((5, -0.1), (6, -2.0)), top((8, -0.55), (7, -0.58))]
    a = rec(0, [5, 7], [-0.1, -0.5], tops_a)
    b = rec(0, [5, 8], [-0.1, -0.55], tops_b)
    d = div(a, b, noise_floor=0.05)
    assert (d["kind"], d["token_index"], d["common_prefix_text"]) == ("token", 1, "F")
    assert (d["left"]["token_id"], d["left"]["logprob"], d["left"]["other_logprob"]) == (7, -0.5, -0.6)
    assert (d["right"]["token_id"], d["right"]["logprob"], d["right"]["other_logprob"]) == (8, -0.55, -0.58)
    assert d["left"]["margin"] == pytest.approx(0.1) and d["right"]["margin"] == pytest.approx(0.03)
    assert d["left"]["top_logprobs"] == tops_a[1] and d["right"]["top_logprobs"] == tops_b[1]
    # the gap between the two competing tokens, on each side: left 0.1, right 0.03
    assert d["magnitude"]["gap"]["left"] == pytest.approx(0.1) and d["magnitude"]["gap"]["right"] == pytest.approx(0.03)
    assert d["magnitude"]["label"] == "confident_flip" and d["near_tie"] is False, "the left gap 0.1 is above the floor 0.05"
    assert div(a, b, noise_floor=0.2)["magnitude"]["label"] == "tie_flip", "both gaps below the floor"
    assert div(a, b, noise_floor=0.2)["near_tie"] is True
    assert div(a, b, noise_floor=None)["magnitude"]["label"] == "unclassified"


def test_length_divergence_when_one_side_stops():
    d = div(rec(0, [1, 2, 3]), rec(0, [1, 2]), check_logprobs=False)
    assert (d["kind"], d["token_index"]) == ("length", 2)
    assert d["right"]["token_id"] is None and d["left"]["token_id"] == 3


def test_logprob_divergence_is_bitwise_by_default_and_atol_absorbs_it():
    a = rec(0, [1, 2], [-0.5, -0.25], [top((1, -0.5)), top((2, -0.25))])
    b = rec(0, [1, 2], [-0.5, -0.25 + 1e-7], [top((1, -0.5)), top((2, -0.25 + 1e-7))])
    d = div(a, b)
    assert (d["kind"], d["token_index"]) == ("logprob", 1) and d["logprob_abs_diff"] == pytest.approx(1e-7)
    assert div(a, b, atol=1e-6) is None
    assert div(a, b, check_logprobs=False) is None, "tier 1 compares token ids only"


def test_topk_difference_alone_is_a_logprob_divergence():
    a = rec(0, [1], [-0.5], [top((1, -0.5), (4, -1.0))])
    b = rec(0, [1], [-0.5], [top((1, -0.5), (9, -1.0))])
    assert div(a, b)["kind"] == "logprob"


def test_input_ids_divergence_names_the_first_differing_id():
    d = div(rec(0, [1], input_ids=(1, 2, 3)), rec(0, [1], input_ids=(1, 9, 3)))
    assert d["kind"] == "input_ids" and d["input_ids"] == {"left": [1, 2, 3], "right": [1, 9, 3], "first_difference": 1}


@pytest.mark.parametrize(("dtype", "quant", "want"), [
    ("float32", None, 1e-4), ("bfloat16", None, 2**-4), ("float16", None, 2**-7), ("auto", None, None),
    ("float32", "Q4_1", 2**-4), ("float32", "F16", 2**-7), ("float32", "F32", 1e-4), ("bfloat16", "F32", 2**-4),
])
def test_noise_floor_takes_the_noisier_of_dtype_and_quantization(dtype, quant, want):
    assert noise_floor(dtype, quant) == want
    assert NOISE_FLOORS["float32"] < NOISE_FLOORS["float16"] < NOISE_FLOORS["bfloat16"]


def test_align_pairs_by_prompt_id_and_occurrence_not_line_order():
    left = [rec(0, [1], pid="a" * 64), rec(1, [2], pid="b" * 64), rec(2, [3], pid="a" * 64)]
    right = [rec(5, [3], pid="a" * 64), rec(1, [2], pid="b" * 64), rec(0, [1], pid="a" * 64), rec(7, [4], pid="c" * 64)]
    pairs, lo, ro = align(left, right)
    assert [(a["prompt_index"], b["prompt_index"]) for a, b in pairs] == [(0, 0), (1, 1), (2, 5)]
    assert lo == [] and [r["prompt_index"] for r in ro] == [7]


def test_drift_stops_at_the_divergence_and_counts_the_divergent_step_for_topk():
    a = rec(0, [1, 2, 3], [-0.1, -0.2, -0.3], [top((1, -0.1), (5, -3)), top((2, -0.2), (5, -3)), top((3, -0.3), (4, -0.4))])
    b = rec(0, [1, 2, 4], [-0.1, -0.2004, -0.35], [top((1, -0.1), (5, -3)), top((2, -0.2004), (6, -3)), top((4, -0.35), (3, -0.36))])
    d = drift([(a, b)])
    p = d["per_prompt"][0]
    assert p["steps"] == 3, "steps 0-1 agree, step 2 diverges from the same context"
    assert p["max_abs_logprob_diff"] == pytest.approx(4e-4), "the divergent step's different tokens are not compared"
    assert p["argmax_flips"] == 1
    assert p["mean_topk_overlap"] == pytest.approx((1 + 0.5 + 1) / 3)
    assert d["max_abs_logprob_diff_by_position"] == pytest.approx([0.0, 4e-4])


def test_drift_is_unavailable_without_logprobs():
    assert drift([(rec(0, [1]), rec(0, [1]))]) == {"available": False}


def _write_trace(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))


def test_fast_reader_settles_identical_payloads_unparsed_with_the_same_answers(tmp_path):
    tops = [top((t, -0.1 * t), (t + 1, -0.1 * t - 1)) for t in (1, 2, 3)]
    records = [rec(i, [1, 2, 3], [-0.1, -0.2, -0.3], tops) for i in range(3)]
    other = [dict(r) for r in records]
    other[1] = rec(1, [1, 2, 9], [-0.1, -0.2, -0.35], tops[:2] + [top((9, -0.35), (3, -0.36))])
    _write_trace(tmp_path / "a.jsonl", records)
    _write_trace(tmp_path / "b.jsonl", other)
    fast_a, _ = load_records(tmp_path / "a.jsonl")
    fast_b, _ = load_records(tmp_path / "b.jsonl")
    assert isinstance(fast_a[1], TraceRecord) and "token_ids" not in fast_a[1].keys(), "middle records stay unparsed"
    assert same_output(fast_a[0], fast_b[0]) and not same_output(fast_a[1], fast_b[1])
    assert payload_shape(fast_a[1]) == (3, True, True)
    kw = dict(name="n", kind="diff", left_label="L", right_label="R", required=True, check_logprobs=True)
    assert compare(fast_a, fast_b, **kw) == compare(records, other, **kw)
    assert fast_a[1]["token_ids"] == [1, 2, 3], "a payload field parses on first access"


def test_served_records_equal_but_for_their_evidence_are_settled_unparsed(tmp_path, monkeypatch):
    """A served engine's records carry evidence (timings, retries) after finish_reason, different for
    every request, and unknown input ids where the server tokenized the text: two such records with
    the same generated fields are settled as identical without being parsed, with the answers the
    walk gives; a logprob that differs, or a differing evidence before finish_reason, is still walked."""
    from detllm.compare import engine
    from detllm.core.versions import CURRENT
    from detllm.compare.represent import EMPTY_IDS_SHA256, comparable

    words = [" a", " b", " c"]
    tops = [top((w, -0.1 * t), (w + "x", -0.1 * t - 1)) for t, w in enumerate(words, 1)]

    def served(i: int, lps: list[float], ms: float) -> dict:  # a server that gave token strings, no ids
        r = rec(i, [1, 2, 3], lps, tops, input_ids=())
        r.update(schema_version=CURRENT, input_ids=None, input_ids_sha256=EMPTY_IDS_SHA256, token_ids=words, token_texts=words)
        r["evidence"] = {"prompt_as": "text", "retries": 0, "timing_ms": [0.5, ms], "tokens_as": "strings"}
        return r

    records = [served(i, [-0.1, -0.2, -0.3], 10.0 + i) for i in range(4)]
    other = [served(i, [-0.1, -0.2, -0.3], 20.0 + i) for i in range(4)]
    other[1] = served(1, [-0.1, -0.2, -0.31], 21.0)
    _write_trace(tmp_path / "a.jsonl", records)
    _write_trace(tmp_path / "b.jsonl", other)
    fast_a, _ = load_records(tmp_path / "a.jsonl")
    fast_b, _ = load_records(tmp_path / "b.jsonl")
    assert same_output(fast_a[0], fast_b[0]) and not same_output(fast_a[1], fast_b[1])
    kw = dict(name="n", kind="diff", left_label="L", right_label="R", required=True, check_logprobs=True)
    walked = compare(records, other, **kw)  # plain dicts: every pair walked
    assert walked["prompts_diverged"] == 1 and walked["first_divergence"]["prompt_index"] == 1
    calls = []
    real = engine.first_divergence
    monkeypatch.setattr(engine, "first_divergence", lambda a, b, **k: calls.append(a["prompt_index"]) or real(a, b, **k))
    assert compare(fast_a, fast_b, **kw) == walked
    assert calls == [1], "only the pair whose generated fields differ is walked"
    unparsed = comparable(list(zip(fast_a, fast_b)))[2]  # records 0 and 3 were parsed as a sample
    assert "token_ids" not in unparsed[0].keys() and unparsed[0]["input_ids_sha256"] is None
    assert unparsed[0]["token_ids"] == words and unparsed[0]["input_ids_sha256"] is None, "read on demand, ids still unknown"
    # evidence that is not where the runner writes it (before finish_reason) is compared with the payload
    moved = tmp_path / "moved.jsonl"
    moved.write_text("".join(json.dumps({**{k: v for k, v in r.items() if k not in ("finish_reason", "evidence")},
                                         "evidence": r["evidence"], "finish_reason": "length"}, separators=(",", ":")) + "\n"
                             for r in records))
    moved_b = tmp_path / "moved_b.jsonl"
    moved_b.write_text(moved.read_text().replace('"timing_ms":[0.5,10.0]', '"timing_ms":[0.5,99.0]'))
    (ma, *_), _ = load_records(moved)
    (mb, *_), _ = load_records(moved_b)
    assert not same_output(ma, mb)


def test_fast_reader_accepts_other_key_orders(tmp_path):
    r = rec(0, [1, 2], [-0.1, -0.2], [top((1, -0.1)), top((2, -0.2))])
    shuffled = {k: r[k] for k in reversed(list(r))}
    _write_trace(tmp_path / "t.jsonl", [shuffled])
    got, present = load_records(tmp_path / "t.jsonl")
    assert dict(got[0]) == r and present == {(0, 1)}


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda line: line.replace('"schema_version":"1"', '"schema_version":"9"'), "schema_version '9'"),
    (lambda line: line.replace('"batch_size":1', '"batch_size":0'), "batch_size"),
    (lambda line: line[:-40], "not valid JSON"),
])
def test_fast_reader_refuses_a_bad_header_naming_the_line(tmp_path, mutate, message):
    lines = [json.dumps(rec(i, [1, 2], [-0.1, -0.2]), separators=(",", ":")) for i in range(3)]
    lines[1] = mutate(lines[1])
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ArtifactError, match="line 2") as exc:
        load_records(tmp_path / "t.jsonl")
    assert message in str(exc.value)


def test_a_bad_payload_is_refused_when_it_is_read(tmp_path):
    good = [rec(i, [1, 2], [-0.1, -0.2]) for i in range(3)]
    bad = [dict(r) for r in good]
    bad[1] = {**good[1], "token_ids": [1, -2]}
    _write_trace(tmp_path / "a.jsonl", good)
    _write_trace(tmp_path / "b.jsonl", bad)
    a, _ = load_records(tmp_path / "a.jsonl")
    b, _ = load_records(tmp_path / "b.jsonl")  # headers are fine; the middle payload is not read yet
    with pytest.raises(ArtifactError, match="line 2: schema violation: token_ids"):
        compare(a, b, name="n", kind="diff", left_label="L", right_label="R", required=True, check_logprobs=False)


def test_first_and_last_records_are_validated_in_full(tmp_path):
    records = [rec(i, [1, 2]) for i in range(3)]
    records[2] = {**records[2], "token_texts": [1, 2]}
    _write_trace(tmp_path / "t.jsonl", records)
    with pytest.raises(ArtifactError, match="line 3: schema violation: token_texts"):
        load_records(tmp_path / "t.jsonl")


def test_check_reports_drift_per_prompt_and_by_position(tmp_path):
    o = detllm.check(backend="fake", tier=2, vary_batch=(1, 2), options={"batch_drift": "1e-6"}, max_new_tokens=6, out=tmp_path / "r")
    batch = next(c for c in o.report["comparisons"] if c["name"] == "batch 2 vs batch 1")
    assert batch["drift"]["max_abs_logprob_diff"] == pytest.approx(1e-6)
    assert len(batch["drift"]["per_prompt"]) == 4 and len(batch["drift"]["max_abs_logprob_diff_by_position"]) == 6
    assert batch["prompts"] == [0, 1, 2, 3] and batch["logprobs_compared"] is False and batch["atol"] == 0.0


def test_the_generated_span_ends_before_the_evidence_that_follows_finish_reason(tmp_path):
    """Where a record's generated fields end (what same_output compares): right before an evidence that
    follows its finish_reason, else at the payload's end; a record without evidence is never read as far
    as an evidence-shaped string (trace._generated_end finds the last finish_reason from the end)."""
    from detllm.compare.trace import _generated_end
    from detllm.core.versions import CURRENT

    plain = {**rec(0, [1, 2], [-0.1, -0.2], [top((1, -0.1)), top((2, -0.2))]), "schema_version": CURRENT}
    served = {**plain, "prompt_index": 1, "evidence": {"prompt_as": "text", "retries": 0, "timing_ms": [0.5, 3.0],
                                                       "tokens_as": "strings"}}
    _write_trace(tmp_path / "t.jsonl", [plain, served])
    got, _ = load_records(tmp_path / "t.jsonl")
    for r in got:
        line = r._src[r._start:r._end]
        end = _generated_end(r) - r._start
        if "evidence" in r.keys() or b'"evidence"' in line:
            assert line[end:].startswith(b',"evidence":') and line[:end].endswith(b'"finish_reason":"length"')
        else:
            assert end == len(line)
