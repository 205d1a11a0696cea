"""`detllm diff` and `detllm report` from the command line and the Python API: selections,
exit codes, refusals before anything is written, the output folder, CI outputs, no torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import detllm
from detllm.runfolder.artifacts import validate_folder
from detllm.commands.diff import Selection
from detllm.core.errors import ArtifactError, UsageError

FIXTURES = Path(__file__).parent / "fixtures" / "diff"
BASE, RUNVAR = FIXTURES / "base", FIXTURES / "run_variance"


def test_pass_and_fail_exit_codes(cli):
    r = cli("diff", BASE, BASE)
    assert r.exit_code == 0 and r.stdout.startswith("detllm diff: PASS"), r.output
    r = cli("diff", BASE, RUNVAR)
    assert r.exit_code == 1, r.output
    assert "FAIL [RUN_VARIANCE]" in r.stdout and "prompt 1, generated token 4" in r.stdout


def test_writes_nothing_without_out(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert detllm.diff(BASE, RUNVAR).out_dir is None
    assert list(tmp_path.iterdir()) == []


def test_out_folder_holds_valid_reports(cli, tmp_path):
    out = tmp_path / "d"
    r = cli("diff", BASE, RUNVAR, "--out", out)
    assert r.exit_code == 1, r.output
    assert {"report.json", "report.txt", "report.md", "diffs", "manifest.json"} <= {p.name for p in out.iterdir()}
    assert set(validate_folder(out)) == {"report.json", "diffs/first_divergence.json", "manifest.json"}
    report = json.loads((out / "report.json").read_text())
    assert report["command"] == "diff" and report["summary"]["left"]["folder"] == str(BASE)
    fd = json.loads((out / "diffs" / "first_divergence.json").read_text())
    assert fd["divergence"] == report["first_divergence"]
    assert cli("diff", BASE, BASE, "--out", out).exit_code == 0, "an earlier diff folder is re-used without --force"
    assert not (out / "diffs").exists(), "a PASS leaves no stale first_divergence.json"


def test_refuses_a_foreign_out_and_an_input_folder_before_writing(cli, tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    r = cli("diff", BASE, RUNVAR, "--out", foreign)
    assert r.exit_code == 2 and "not empty and is not a detllm diff folder" in r.stderr
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    copy = tmp_path / "copy"
    shutil.copytree(BASE, copy)
    r = cli("diff", copy, RUNVAR, "--out", copy)
    assert r.exit_code == 2 and "is one of the folders being compared" in r.stderr
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in BASE.iterdir())


@pytest.mark.parametrize(("arg", "code", "text"), [
    ("{base}::run_x", 2, "cannot read the selection 'run_x'"),
    ("{base}::batch_1@run_0", 2, "cannot read the selection"),
    ("{base}::run_3", 2, "has no records for run_3@batch_1 (it holds run_0@batch_1)"),
    ("{tmp}", 5, "is not a detllm run folder"),
    ("{tmp}/missing", 5, "is not a folder"),
])
def test_bad_sides_are_one_line_errors(cli, tmp_path, arg, code, text):
    r = cli("diff", arg.format(base=BASE, tmp=tmp_path), BASE)
    assert r.exit_code == code, r.output
    assert text in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.output


def test_unreadable_schema_version_is_an_artifact_error(cli, tmp_path):
    future = tmp_path / "future"
    shutil.copytree(BASE, future)
    cfg = json.loads((future / "run_config.json").read_text())
    (future / "run_config.json").write_text(json.dumps({**cfg, "schema_version": "99"}))
    r = cli("diff", BASE, future)
    assert r.exit_code == 5 and "schema_version '99' is not one this detllm reads" in r.stderr
    with pytest.raises(ArtifactError):
        detllm.diff(BASE, future)


def test_a_pack_is_a_side(tmp_path):
    from detllm.runfolder.integrity import seal
    from detllm.commands.pack import create_pack

    sealed = tmp_path / "sealed"
    shutil.copytree(BASE, sealed)
    seal(sealed)
    pack = create_pack(sealed, tmp_path / "base.tar.gz")
    r = detllm.diff(f"{pack}::run_0@batch_1", RUNVAR).report
    assert r["category"] == "RUN_VARIANCE" and r["summary"]["left"]["label"] == "base.tar.gz::run_0@batch_1"


def test_selection_syntax():
    assert Selection.parse("a/b") == Selection(Path("a/b"))
    assert Selection.parse("a::b::run_2") == Selection(Path("a::b"), 2, None), "the last :: separates"
    assert Selection.parse("x::batch_8") == Selection(Path("x"), None, 8)
    assert Selection.parse("x::run_1@batch_8") == Selection(Path("x"), 1, 8)
    for bad in ("x::", "::run_1", "x::run_", "x::batch_8@run_1", "x::run_1@8"):
        with pytest.raises(UsageError):
            Selection.parse(bad)


def test_api_arguments_are_checked_before_reading(tmp_path):
    with pytest.raises(UsageError, match="--tier must be 1, 2 or 3"):
        detllm.diff(tmp_path / "nope", BASE, tier=0)
    with pytest.raises(UsageError, match="--atol"):
        detllm.diff(tmp_path / "nope", BASE, atol=-1)


def test_tier_default_atol_and_downgrade(tmp_path):
    o = detllm.diff(BASE, BASE)
    assert o.report["tier"] == {"requested": 2, "effective": 2}, "the lower tier the two sides were recorded at"
    assert o.report["comparisons"][0]["logprobs_compared"] is True
    one = detllm.run(backend="fake", model="fake", max_new_tokens=8, logprobs=3, tier=2, out=tmp_path / "r",
                     options={"max_tier": "1"})  # downgraded to tier 1, logprobs still recorded
    assert detllm.diff(BASE, one.out_dir).report["tier"] == {"requested": 1, "effective": 1}
    assert detllm.diff(BASE, one.out_dir, tier=2).report["tier"] == {"requested": 2, "effective": 2}
    blind = tmp_path / "blind"
    shutil.copytree(BASE, blind)
    applied = json.loads((blind / "determinism_applied.json").read_text())
    applied["capabilities"]["logprobs"] = False
    (blind / "determinism_applied.json").write_text(json.dumps(applied))
    o = detllm.diff(BASE, blind, tier=2)
    assert o.report["tier"] == {"requested": 2, "effective": 1}, "no logprobs on one side: tokens only"
    assert o.report["comparisons"][0]["logprobs_compared"] is False
    nudged = detllm.run(backend="fake", model="fake", max_new_tokens=8, logprobs=3, tier=2, out=tmp_path / "n",
                        options={"diverge": "prompt=0,pos=1,what=logprob"})
    assert detllm.diff(BASE, nudged.out_dir).report["first_divergence"]["kind"] == "logprob"
    relaxed = detllm.diff(BASE, nudged.out_dir, atol=1e-5)
    assert relaxed.report["status"] == "PASS" and relaxed.report["summary"]["atol"] == 1e-5
    assert relaxed.report["comparisons"][0]["atol"] == 1e-5
    assert detllm.diff(BASE, nudged.out_dir, tier=1).report["status"] == "PASS"


def test_junit_has_one_testcase_per_prompt(cli, tmp_path):
    xml = tmp_path / "junit.xml"
    r = cli("diff", BASE, RUNVAR, "--junit", xml)
    assert r.exit_code == 1
    root = ET.parse(xml).getroot()
    cases = root.findall("./testsuite/testcase")
    assert [c.get("name") for c in cases] == ["prompt 0", "prompt 1", "prompt 2", "prompt 3"]
    failed = [c for c in cases if c.find("failure") is not None]
    assert [c.get("name") for c in failed] == ["prompt 1"]
    assert failed[0].find("failure").get("type") == "RUN_VARIANCE"
    assert root.get("tests") == "4" and root.get("failures") == "1"


def test_prompts_on_one_side_only_fail_as_junit_testcases(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("The capital of France is\nsomething new\n")
    other = detllm.run(backend="fake", model="fake", max_new_tokens=8, logprobs=3, tier=2, prompts=prompts, out=tmp_path / "o")
    detllm.diff(BASE, other.out_dir, junit=tmp_path / "j.xml")
    root = ET.parse(tmp_path / "j.xml").getroot()
    failures = [c.find("failure").get("type") for c in root.iter("testcase") if c.find("failure") is not None]
    assert failures == ["PROMPT_MISMATCH"] * 4, "3 prompts only on the left, 1 only on the right"


def test_github_step_summary_is_appended_for_diff_and_check(cli, tmp_path):
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    env = {"GITHUB_STEP_SUMMARY": str(summary)}
    assert cli("diff", BASE, RUNVAR, env=env).exit_code == 1
    assert cli("check", "--backend", "fake", "--out", tmp_path / "c", "--junit", tmp_path / "c.xml", env=env).exit_code == 0
    text = summary.read_text()
    assert text.startswith("earlier step\n")
    assert "# detllm diff: FAIL: RUN_VARIANCE" in text and "# detllm check: PASS" in text
    assert ET.parse(tmp_path / "c.xml").getroot().get("failures") == "0"


def test_report_renders_a_diff_folder_in_every_format(cli, tmp_path):
    out = tmp_path / "d"
    detllm.diff(BASE, FIXTURES / "env_changed", out=out)
    md = cli("report", out, "--format", "md", "--junit", tmp_path / "r.xml")
    assert md.exit_code == 0 and md.stdout == (out / "report.md").read_text()
    assert "## Environment differences" in md.stdout and "`libraries.numpy`" in md.stdout
    txt = cli("report", out)
    assert txt.stdout == (out / "report.txt").read_text()
    js = cli("report", out, "--format", "json")
    assert json.loads(js.stdout) == json.loads((out / "report.json").read_text())
    assert (tmp_path / "r.xml").is_file()
    assert cli("report", out, "--format", "xml").exit_code == 2, "an unknown format is a usage error"


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "drift.png"
    detllm.diff(BASE, RUNVAR, plot=png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_matplotlib_is_one_line_before_anything_runs(cli, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    r = cli("diff", BASE, RUNVAR, "--plot", tmp_path / "p.png", "--out", tmp_path / "d")
    assert r.exit_code == 2 and "--plot needs matplotlib" in r.stderr and "detllm[plot]" in r.stderr
    assert not (tmp_path / "d").exists() and not (tmp_path / "p.png").exists()


PROBE = """
import sys
from typer.testing import CliRunner
from detllm.cli import app
r = CliRunner().invoke(app, {args!r})
print("EXIT", r.exit_code, "TORCH", "torch" in sys.modules, "TRANSFORMERS", "transformers" in sys.modules)
"""


def test_diff_imports_no_torch(tmp_path):
    args = ["diff", str(BASE), str(RUNVAR), "--out", str(tmp_path / "d"), "--junit", str(tmp_path / "j.xml")]
    out = subprocess.run([sys.executable, "-c", PROBE.format(args=args)], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "EXIT 1 TORCH False TRANSFORMERS False", out.stderr
