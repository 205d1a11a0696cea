"""Magnitude in every verdict (issue 9): tie flip, confident flip, sampled step and
"tokens equal, logprobs differ" each get their own label; distribution measures; the
atol rule at a top-k boundary; one NaN rule for check and diff; JUnit's per-comparison cause."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import detllm
from detllm.runfolder.artifacts import validate
from detllm.compare.divergence import first_divergence
from detllm.compare.engine import compare
from detllm.core.hashing import canonical_json, sha256_bytes
from detllm.render.junit import render_junit
from detllm.render.markdown import render_markdown
from detllm.render.text import render_text


def rec(i: int, ids: list[int], lps=None, tops=None) -> dict:
    input_ids = [1, 2, 3]
    return {
        "schema_version": "2", "artifact_type": "trace_record", "run_index": 0, "batch_size": 1, "batch_position": 0,
        "prompt_index": i, "prompt_id": f"{i:064x}", "prompt_text": f"p{i}", "input_ids": input_ids,
        "input_ids_sha256": sha256_bytes(canonical_json(input_ids)), "token_ids": ids,
        "token_texts": [chr(65 + t % 26) for t in ids], "text": "".join(chr(65 + t % 26) for t in ids),
        "logprobs": lps, "top_logprobs": tops, "finish_reason": "length",
    }


def top(*pairs):
    return [[t, lp] for t, lp in pairs]


def div(a, b, **kw):
    kw.setdefault("check_logprobs", True)
    return first_divergence(a, b, comparison="c", left_label="L", right_label="R", **kw)


def comp(left, right, **kw):
    kw.setdefault("check_logprobs", True)
    return compare(left, right, name="c", kind="diff", left_label="L", right_label="R", required=True, **kw)


# ------------------------------------------------------------------ labels

def test_tie_flip_confident_flip_and_the_gap_between_the_two_competing_tokens():
    a = rec(0, [5, 7], [-0.1, -0.5], [top((5, -0.1)), top((7, -0.5), (8, -0.50002))])
    b = rec(0, [5, 8], [-0.1, -0.50001], [top((5, -0.1)), top((8, -0.50001), (7, -0.50002))])
    d = div(a, b, noise_floor=1e-4)
    m = d["magnitude"]
    assert m["label"] == "tie_flip" and d["near_tie"] is True, "both gaps below the floor"
    assert m["gap"]["left"] == pytest.approx(2e-5) and m["gap"]["right"] == pytest.approx(1e-5)
    # top-1 minus top-2 is not the gap that matters: on the left the runner-up (9) is a third token,
    # and the right's token 8 is 0.4 below: a confident flip, although both margins are tiny
    a2 = rec(0, [5, 7], [-0.1, -0.5], [top((5, -0.1)), top((7, -0.5), (9, -0.50001), (8, -0.9))])
    d2 = div(a2, b, noise_floor=1e-4)
    assert d2["left"]["margin"] == pytest.approx(1e-5) and d2["right"]["margin"] == pytest.approx(1e-5)
    assert d2["magnitude"]["label"] == "confident_flip" and d2["near_tie"] is False
    assert d2["magnitude"]["gap"]["left"] == pytest.approx(0.4)


def test_other_token_below_top_k_gives_a_lower_bound():
    a = rec(0, [5], [-0.1], [top((5, -0.1), (6, -3.0))])  # the right's token 8 is not in the left's top-2
    b = rec(0, [8], [-0.2], [top((8, -0.2), (5, -0.3))])
    m = div(a, b, noise_floor=1e-4)["magnitude"]
    assert m["gap_is_lower_bound"]["left"] is True and m["gap"]["left"] == pytest.approx(2.9)
    assert m["label"] == "confident_flip", "a lower bound above the floor is enough"


def test_sampled_step_uses_the_two_sampled_tokens_probabilities():
    a = rec(0, [5], [-1.0], [top((9, -0.5), (5, -1.0), (6, -1.2))])
    b = rec(0, [6], [-1.2], [top((9, -0.5), (5, -1.0), (6, -1.2))])
    d = div(a, b, noise_floor=1e-4, sampled=True)
    m = d["magnitude"]
    assert m["label"] == "sampled_step" and m["sampled"] is True
    assert m["probabilities"]["left"]["own"] == pytest.approx(math.exp(-1.0))
    assert m["probabilities"]["left"]["other"] == pytest.approx(math.exp(-1.2))
    assert m["distribution_moved"] is False, "same distribution on both sides: the samplers drew differently"


def test_tokens_equal_logprobs_differ_has_its_own_name_with_size_start_and_growth():
    tops = [top((5, -0.1), (6, -2.0))] * 8
    a = rec(0, [5] * 8, [-0.1] * 8, tops)
    lps = [-0.1, -0.1, -0.1 - 1e-7, -0.1 - 1e-6, -0.1 - 1e-6, -0.1 - 1e-5, -0.1 - 1e-5, -0.1 - 1e-4]
    b = rec(0, [5] * 8, lps, [top((5, lp), (6, -2.0)) for lp in lps])
    d = div(a, b, noise_floor=1e-4)
    assert d["kind"] == "logprob" and d["magnitude"]["label"] == "tokens_equal_logprobs_differ"
    assert d["magnitude"]["within_noise"] is True
    c = comp([a], [b], check_logprobs=False)  # tier 1: not a divergence, still named
    assert c["status"] == "PASS" and c["magnitude"]["label"] == "tokens_equal_logprobs_differ"
    e = c["drift"]["tokens_equal_logprobs_differ"]
    assert e["prompts"] == 1 and e["first"] == {"prompt_index": 0, "token_index": 2}
    assert e["max_abs_logprob_diff"] == pytest.approx(1e-4)
    growth = [q["max_abs_logprob_diff"] for q in e["growth"]]
    assert growth == sorted(growth) and growth[0] == 0.0 and growth[-1] == pytest.approx(1e-4), "it grows along the generation"


def test_each_label_reaches_report_json_txt_and_md(tmp_path):
    """A fake check whose runs diverge at a token, and a fake diff whose logprobs alone moved."""
    flip = detllm.check(backend="fake", tier=2, runs=2, max_new_tokens=6, out=tmp_path / "flip",
                        options={"diverge": "prompt=1,pos=2,run=1"}).report
    validate(flip, "report")
    assert flip["magnitude"]["label"] == "confident_flip"  # the fake's runner-up is 0.7 nats below
    assert "confident flip" in (tmp_path / "flip" / "report.txt").read_text()
    assert "**confident flip**" in (tmp_path / "flip" / "report.md").read_text()
    a = detllm.run(backend="fake", tier=2, max_new_tokens=6, out=tmp_path / "a").out_dir
    b = detllm.run(backend="fake", tier=2, max_new_tokens=6, out=tmp_path / "b", options={"diverge": "prompt=0,pos=3,what=logprob"}).out_dir
    out = detllm.diff(a, b, out=tmp_path / "d", tier=1)
    r = out.report
    validate(r, "report")
    assert r["status"] == "PASS" and r["magnitude"]["label"] == "tokens_equal_logprobs_differ"
    txt, md = (tmp_path / "d" / "report.txt").read_text(), (tmp_path / "d" / "report.md").read_text()
    assert "tokens equal, logprobs differ in 1 prompt(s)" in txt and "tokens equal, logprobs differ" in md


# ------------------------------------------------------------------ distribution measures

def test_distribution_measures_share_kl_and_percentiles():
    n = 10
    tops_a = [top((5, -0.1), (6, -2.4)) for _ in range(n)]
    a = rec(0, [5] * n, [-0.1] * n, tops_a)
    lps = [-0.1] * 8 + [-0.1 - 1e-3, -0.1 - 1e-2]
    b = rec(0, [5] * n, lps, [top((5, lp), (6, -2.4)) for lp in lps])
    d = comp([a, rec(1, [5, 6], [-0.1, -0.2], [top((5, -0.1)), top((6, -0.2))])],
             [b, rec(1, [5, 6], [-0.1, -0.2], [top((5, -0.1)), top((6, -0.2))])], check_logprobs=False)["drift"]
    assert d["same_top1_share"] == 1.0
    assert d["abs_logprob_diff_percentiles"]["p50"] == 0.0
    assert d["abs_logprob_diff_percentiles"]["p99"] == pytest.approx(1e-2) and d["max_abs_logprob_diff"] == pytest.approx(1e-2)
    assert d["kl_topk"]["max"] > 0 and d["kl_topk"]["mean"] < d["kl_topk"]["max"]


# ------------------------------------------------------------------ atol at a top-k boundary (item 8)

def test_atol_accepts_a_top_k_boundary_swap_within_tolerance():
    a = rec(0, [1], [-0.1], [top((1, -0.1), (2, -1.0), (3, -2.0))])
    b = rec(0, [1], [-0.1], [top((1, -0.1), (2, -1.0), (4, -2.0000005))])  # 3 and 4 traded places at the cut
    assert div(a, b, atol=0.0)["kind"] == "logprob", "bitwise: the id sets differ"
    assert div(a, b, atol=1e-6) is None, "each id missing on one side is within atol of that side's k-th value"
    far = rec(0, [1], [-0.1], [top((1, -0.1), (2, -1.0), (4, -2.5))])
    assert div(a, far, atol=1e-6)["kind"] == "logprob", "id 3 (-2.0) sits 0.5 above the other side's k-th (-2.5)"


def test_a_different_logprobs_count_compares_the_common_top_k():
    a = rec(0, [1], [-0.1], [top((1, -0.1), (2, -1.0))])
    b = rec(0, [1], [-0.1], [top((1, -0.1), (2, -1.0), (3, -2.0), (4, -2.1))])
    assert div(a, b) is None


# ------------------------------------------------------------------ NaN (item 9)

def test_one_nan_rule_for_in_memory_and_sanitised_records():
    nan = float("nan")
    mem = rec(0, [1, 2], [-0.1, nan], [top((1, -0.1)), top((2, nan))])  # what check holds in memory
    disk = json.loads(json.dumps(rec(0, [1, 2], [-0.1, None], [top((1, -0.1)), top((2, None))])))  # what diff reads
    number = rec(0, [1, 2], [-0.1, -0.2], [top((1, -0.1)), top((2, -0.2))])
    assert div(mem, disk) is None, "NaN is null once written: null equals null"
    for left in (mem, disk):
        d = div(left, number, atol=10.0)
        assert d is not None and d["kind"] == "logprob" and d["token_index"] == 1, "null vs a number differs under any atol"


# ------------------------------------------------------------------ JUnit (item 10)

def test_junit_testcase_carries_its_own_comparisons_cause(tmp_path):
    out = detllm.check(backend="fake", tier=1, runs=2, vary_batch=(1, 4), max_new_tokens=6, out=tmp_path / "c",
                       options={"diverge": "prompt=1,pos=2,run=1;prompt=3,pos=1,batch=4"})
    report = out.report
    assert [c["code"] for c in report["causes"]] == ["RUN_VARIANCE", "BATCH_VARIANCE"]
    root = ET.fromstring(render_junit(report).split("\n", 1)[1])
    types = {s.get("name"): [f.get("type") for f in s.iter("failure")] for s in root.iter("testsuite")}
    assert types["run_1 vs run_0 @ batch 1"] == ["RUN_VARIANCE"]
    assert types["batch 4 vs batch 1"] == ["BATCH_VARIANCE"], "not the report's top cause"


def test_renderers_read_reports_without_magnitude():
    report = json.loads((Path(__file__).parent / "fixtures" / "v1" / "check_fail" / "report.json").read_text())
    assert "RUN_VARIANCE" in render_text(report) and "RUN_VARIANCE" in render_markdown(report)


# ------------------------------------------------------------------ noise floors of what ran

@pytest.mark.parametrize("settings, quant, want", [
    ([{"name": "dtype", "value": "F32"}], "F32", 1e-4),
    ([{"name": "dtype", "value": "F32"}, {"name": "kv_type", "value": "f16"}], "F32", 2.0**-7),  # llama.cpp's default KV cache
    ([{"name": "dtype", "value": "F32"}, {"name": "kv_type", "value": "q8_0"}], "F32", 2.0**-4),
    ([{"name": "dtype", "value": "F32"}, {"name": "kv_type", "value": "f32"}, {"name": "flash_attn", "value": "on"}], "F32", 2.0**-7),
    ([{"name": "dtype", "value": "bfloat16"}, {"name": "kv_type", "value": "f16"}], None, 2.0**-4),
])
def test_noise_floor_follows_kv_cache_type_and_flash_attention(settings, quant, want):
    from detllm.compare.divergence import run_noise_floor

    assert run_noise_floor("auto", settings, quant) == pytest.approx(want)


def test_a_tie_flip_reaches_report_json_txt_and_md(tmp_path):
    """Two fake runs edited so that at one step the two competing tokens are 1e-5 apart on both
    sides, and each side picked the other: a numeric tie that broke the other way."""
    import shutil

    a = detllm.run(backend="fake", tier=2, max_new_tokens=6, out=tmp_path / "a").out_dir
    b = tmp_path / "b"
    shutil.copytree(a, b)
    for folder, (first, second) in ((a, (65, 66)), (b, (66, 65))):
        lines = [json.loads(x) for x in (folder / "trace.jsonl").read_text().splitlines()]
        r = next(x for x in lines if x["prompt_index"] == 1)
        r["token_ids"][3], r["token_texts"][3], r["logprobs"][3] = first, chr(first), -0.5
        r["top_logprobs"][3] = [[first, -0.5], [second, -0.50001], *r["top_logprobs"][3][2:]]
        r["text"] = "".join(r["token_texts"])
        (folder / "trace.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = detllm.diff(a, b, out=tmp_path / "d", tier=1)
    r = out.report
    validate(r, "report")
    assert r["magnitude"]["label"] == "tie_flip" and r["first_divergence"]["near_tie"] is True
    assert r["first_divergence"]["magnitude"]["gap"] == {"left": pytest.approx(1e-5), "right": pytest.approx(1e-5)}
    assert "tie flip" in (tmp_path / "d" / "report.txt").read_text()
    assert "**tie flip**" in (tmp_path / "d" / "report.md").read_text()
