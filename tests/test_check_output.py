"""What a `check` prints, on the fake backend: each cause code once (an INFO comparison that finds
the cause of a failing one is folded into it), and a sensitivity line that never prints a
|dlogprob| of 0 that was not measured."""

from __future__ import annotations

import json

import detllm
from detllm.compare.verdict import check_comparisons, check_report
from detllm.render.text import sensitivity_line
from detllm.render.html import render_html
from detllm.render.issue import render_issue
from detllm.render.markdown import render_markdown
from detllm.render.text import render_text
from detllm.runfolder.schema_io import validate

from .conftest import assert_valid_run

# a token flip at batch 8 (required at tier 2) plus logprob drift per batch member (INFO at tier 2)
FLIP_AND_DRIFT = {"diverge": "prompt=0,pos=2,batch=8", "batch_drift": "0.001"}


def _codes(report: dict) -> list[str]:
    return [c["code"] for c in report["causes"] + report["info"]]


def test_batch_variance_is_listed_once_with_the_info_comparison_as_its_evidence(tmp_path):
    o = detllm.check(backend="fake", options=FLIP_AND_DRIFT, vary_batch=(1, 8), tier=2, out=tmp_path / "r")
    rep = assert_valid_run(tmp_path / "r", failed=True)
    assert o.exit_code == 1 and rep["category"] == "BATCH_VARIANCE"
    names = {c["name"]: c["status"] for c in rep["comparisons"]}
    assert names["batch 8 vs batch 1"] == "FAIL" and names["batch 8 vs batch 1 (logprobs)"] == "INFO"  # both found it
    assert _codes(rep) == ["BATCH_VARIANCE"], _codes(rep)
    ev = rep["causes"][0]["evidence"]
    assert ev["comparisons"] == ["batch 8 vs batch 1"] and ev["prompts_diverged"] == 1
    assert ev["not_required"]["comparisons"] == ["batch 8 vs batch 1 (logprobs)"]
    assert ev["not_required"]["prompts_diverged"] == 4 and ev["not_required"]["first"]["kind"] == "logprob"
    assert ev["not_repeated"] == "batch or run variance at batch 8 (not repeated)"

    txt = (tmp_path / "r" / "report.txt").read_text()
    assert txt.count("BATCH_VARIANCE:") == 1 and "did not fail the verdict" not in txt
    assert "not required at this tier, also differed: batch 8 vs batch 1 (logprobs), in 4 prompt(s)" in txt
    md = render_markdown(rep)
    assert md.count("**BATCH_VARIANCE**") == 1 and "did not fail the verdict" not in md
    html = render_html(rep)
    assert html.count("<code>BATCH_VARIANCE</code>") == 1 and "did not fail the verdict" not in html
    issue = render_issue(rep, tmp_path / "r")
    assert issue.count("`BATCH_VARIANCE` (") == 1 and "also differed: batch 8 vs batch 1 (logprobs)" in issue
    assert render_text(rep).count("BATCH_VARIANCE:") == 1


def test_info_without_a_matching_cause_stays_info(tmp_path):
    """Logprob drift across batch sizes with equal tokens at tier 2: a PASS whose info keeps BATCH_VARIANCE."""
    o = detllm.check(backend="fake", options={"batch_drift": "0.001"}, vary_batch=(1, 8), tier=2, out=tmp_path / "r")
    assert o.status == "PASS" and o.report["causes"] == []
    assert _codes(o.report) == ["BATCH_VARIANCE"] and "not_required" not in o.report["info"][0]["evidence"]


def test_a_token_flip_alone_prints_no_zero_logprob_figure(cli, tmp_path):
    r = cli("check", "--backend", "fake", "--opt", "diverge=prompt=0,pos=2,batch=8", "--vary-batch", "1,8",
            "--negative-control", "--no-progress", "--out", tmp_path / "r")
    assert r.exit_code == 1, r.output
    rep = assert_valid_run(tmp_path / "r", failed=True)
    # logprobs were compared up to the flips and none moved: a true 0 in report.json, said in words
    assert rep["sensitivity"] == {"drift_observed": True, "max_abs_logprob_diff": 0.0,
                                  "where": ["batch 8 vs batch 1", "negative control"]}
    assert rep["negative_control"]["max_abs_logprob_diff"] == 0.0
    md = (tmp_path / "r" / "report.md").read_text()
    for text in (r.stdout, md):
        assert "|dlogprob| 0" not in text, text
        assert "(tokens diverged; no logprob moved before them)" in text
        assert "(1/4 prompts, tokens diverged; no logprob moved before them)" in text


def test_logprobs_not_compared_gives_null_and_says_so(tmp_path):
    """Records without logprobs (a served model that returns none): the sensitivity has no figure at all."""
    detllm.check(backend="fake", options={"diverge": "prompt=1,pos=3,run=1"}, out=tmp_path / "r")
    records = [json.loads(line) for line in (tmp_path / "r" / "trace.jsonl").read_text().splitlines()]
    for rec in records:
        rec["logprobs"] = rec["top_logprobs"] = None
    comps = check_comparisons(records, base_batch=1, runs=3, batch_sizes=(1,), tier=1, atol=0.0, floor=None)
    rep = check_report(comps, tier_requested=1, tier_effective=1, summary={})
    assert rep["status"] == "FAIL"
    assert rep["sensitivity"] == {"drift_observed": True, "max_abs_logprob_diff": None, "where": ["run_1 vs run_0 @ batch 1"]}
    validate(json.loads(json.dumps(rep)), "report")
    assert sensitivity_line(rep["sensitivity"], None) == [
        "sensitivity: drift observed in run_1 vs run_0 @ batch 1 (logprobs not compared)"]
    same = check_report([c for c in comps if c["status"] == "PASS"], tier_requested=1, tier_effective=1, summary={})
    assert sensitivity_line(same["sensitivity"], None) == [
        "sensitivity: no drift observed anywhere (no token moved in any comparison; logprobs not compared)"]
