"""Renderers read report.json alone: txt fits a screen, Markdown survives hostile token
text, JUnit is well-formed, and reports written before the diff fields existed render."""

from __future__ import annotations

import copy
import xml.etree.ElementTree as ET
from pathlib import Path

import detllm
from detllm.runfolder.artifacts import validate
from detllm.render.github import append_step_summary
from detllm.render.junit import render_junit
from detllm.render.markdown import render_markdown
from detllm.render.text import render_text

FIXTURES = Path(__file__).parent / "fixtures" / "diff"


def failing_report() -> dict:
    return detllm.diff(FIXTURES / "base", FIXTURES / "env_changed").report


def test_text_is_one_screen_and_names_cause_and_next_step():
    text = render_text(failing_report())
    lines = text.splitlines()
    assert len(lines) <= 24 and max(len(line) for line in lines) <= 300
    assert lines[0] == "detllm diff: FAIL [ENV_MISMATCH]"
    assert any(line.startswith("  1. ENV_MISMATCH: the environment differs: ") for line in lines)
    assert lines[-1].startswith("next: pin the libraries")


def test_markdown_sections_and_side_by_side_context():
    md = render_markdown(failing_report())
    for heading in ("# detllm diff: FAIL: ENV_MISMATCH", "## Causes, most likely first", "## First divergence",
                    "## Drift before the first divergence", "## Comparisons", "## Environment differences"):
        assert heading in md
    assert "| token | 33 `'!'` |" in md and "| margin (top-1 minus top-2) |" in md
    assert "*next*: pin the libraries" in md


def test_markdown_escapes_token_text_that_would_break_a_table():
    report = copy.deepcopy(failing_report())
    d = report["first_divergence"]
    d["left"]["token_text"] = "a|b`c\nd"
    d["common_prefix_text"] = "```\nfenced"
    md = render_markdown(report)
    row = next(line for line in md.splitlines() if line.startswith("| token |"))
    assert "`'a\\|b'c\\nd'`" in row, row  # pipe escaped, backtick made a quote, newline shown as \\n
    assert "````text\n```\nfenced\n````" in md, "a fence in the prefix cannot close the code block"


def test_junit_marks_a_divergence_the_tier_does_not_require_as_passing(tmp_path):
    o = detllm.check(backend="fake", tier=2, vary_batch=(1, 2), options={"batch_drift": "1e-6"}, max_new_tokens=4, runs=2,
                     out=tmp_path / "c")
    root = ET.fromstring(render_junit(o.report))
    info = next(s for s in root if s.get("name") == "batch 2 vs batch 1 (logprobs)")
    assert info.get("failures") == "0" and len(info) == 4
    assert all(c.find("system-out") is not None for c in info)
    assert root.get("failures") == "0" and o.report["status"] == "PASS"
    assert [c["code"] for c in o.report["info"]] == ["BATCH_VARIANCE"]


OLD_REPORT = {
    "schema_version": "1", "artifact_type": "report", "command": "check", "status": "FAIL", "category": "RUN_VARIANCE",
    "tier": {"requested": 1, "effective": 1},
    "causes": [{"code": "RUN_VARIANCE", "evidence": {"comparisons": ["run_1 vs run_0 @ batch 1"], "prompts_diverged": 1,
                                                     "first": {"prompt_index": 0, "token_index": 1, "kind": "token", "near_tie": False},
                                                     "recorded_differences": "none: same process"}}],
    "first_divergence": None,
    "comparisons": [{"name": "run_1 vs run_0 @ batch 1", "kind": "run", "left": "run_0@batch_1", "right": "run_1@batch_1",
                     "required": True, "status": "FAIL", "prompts_compared": 2, "prompts_diverged": 1, "first_divergence": None,
                     "divergences": [], "unmatched": {"left_only": [], "right_only": []},
                     "drift": {"available": True, "steps": 3, "max_abs_logprob_diff": 0.0, "mean_topk_overlap": 1.0,
                               "argmax_flips": 0, "per_prompt": [{"prompt_index": 0, "steps": 3, "max_abs_logprob_diff": 0.0}]}}],
    "summary": {"backend": "fake", "model": "fake", "prompts": 2, "runs": 2},
}


def test_reports_from_before_the_diff_fields_still_validate_and_render():
    validate(OLD_REPORT, "report")
    assert "RUN_VARIANCE" in render_text(OLD_REPORT)
    assert "# detllm check: FAIL: RUN_VARIANCE" in render_markdown(OLD_REPORT)
    ET.fromstring(render_junit(OLD_REPORT))


def test_step_summary_appends_and_is_silent_outside_actions(tmp_path):
    target = tmp_path / "s.md"
    report = failing_report()
    assert append_step_summary(report, {}) is None
    append_step_summary(report, {"GITHUB_STEP_SUMMARY": str(target)})
    append_step_summary(report, {"GITHUB_STEP_SUMMARY": str(target)})
    assert target.read_text().count("# detllm diff: FAIL") == 2
