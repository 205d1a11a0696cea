"""What a CI job reads from a check (docs/ci.md): --version, --json's out_dir, the tier that was
requested but not checked (stderr in CI, step summary, JUnit), a step summary that cannot be
written (a warning, never another exit code), and a FAIL's next step (`detllm diagnose RUN`)."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

from detllm.core.versions import CURRENT

from .conftest import assert_valid_run

NOT_CI = {"CI": "", "GITHUB_STEP_SUMMARY": ""}  # the tests may run inside a CI job: these tests set both themselves


def test_version_names_the_installed_release_and_schema(cli):
    r = cli("--version")
    assert r.exit_code == 0, r.output
    assert r.stdout == f"detllm {metadata.version('detllm')} (writes run folders of schema_version {CURRENT})\n"
    # the console entry point too, as a CI log runs it
    p = subprocess.run([sys.executable, "-m", "detllm", "--version"], capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout, p.stderr) == (0, r.stdout, "")


def test_json_names_the_run_folder_it_wrote_by_default(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no --out: the folder is a new one under artifacts/, which only out_dir names
    r = cli("check", "--backend", "fake", "--json", "--max-new-tokens", "4", env=NOT_CI)
    assert r.exit_code == 0, r.output
    printed = json.loads(r.stdout)
    out = Path(printed.pop("out_dir"))
    assert out.parent == Path("artifacts") and out.name.startswith("check-")
    assert printed == assert_valid_run(tmp_path / out), "the rest is report.json, as before"


def test_downgraded_tier_is_a_warning_in_ci_the_step_summary_and_junit(cli, tmp_path):
    summary = tmp_path / "summary.md"
    args = ("check", "--backend", "fake", "--tier", "3", "--vary-batch", "1,2", "--max-new-tokens", "4")
    warning = "tier 3 requested, tier 2 checked (best-effort mode downgraded it; pass --mode strict to fail instead)"
    r = cli(*args, "--out", tmp_path / "ci", "--junit", tmp_path / "j.xml",
            env={"CI": "true", "GITHUB_STEP_SUMMARY": str(summary)})
    assert r.exit_code == 0, r.output  # best-effort: still a PASS, but it says what it checked
    assert r.stderr == f"detllm: warning: {warning}\n"
    assert summary.read_text().startswith(f"> **Warning:** {warning}\n\n# detllm check: PASS")
    for suite in ET.parse(tmp_path / "j.xml").getroot().iter("testsuite"):
        props = {p.get("name"): p.get("value") for p in suite.iter("property")}
        assert props == {"detllm.tier_requested": "3", "detllm.tier_checked": "2", "detllm.warning": warning}
        assert suite.get("tests") == str(len(suite.findall("testcase")))
    # outside CI, stderr stays quiet; a check at the tier asked for has no warning anywhere
    assert cli(*args, "--out", tmp_path / "local", env=NOT_CI).stderr == ""
    r = cli("check", "--backend", "fake", "--tier", "2", "--out", tmp_path / "t2", "--junit", tmp_path / "t2.xml",
            env={"CI": "true", "GITHUB_STEP_SUMMARY": str(tmp_path / "t2.md")})
    assert (r.exit_code, r.stderr) == (0, "")
    assert "Warning" not in (tmp_path / "t2.md").read_text()
    assert not list(ET.parse(tmp_path / "t2.xml").getroot().iter("properties"))


def test_unwritable_step_summary_warns_and_keeps_the_verdict(cli, tmp_path):
    target = tmp_path / "no-such-dir" / "summary.md"
    r = cli("check", "--backend", "fake", "--out", tmp_path / "r", "--max-new-tokens", "4",
            env={"CI": "", "GITHUB_STEP_SUMMARY": str(target)})
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("detllm check: PASS")
    assert r.stderr == (f"detllm: warning: $GITHUB_STEP_SUMMARY ({target}) cannot be written (No such file or directory): "
                        "no step summary; the verdict stands\n")
    # a FAIL keeps its exit code too
    r = cli("check", "--backend", "fake", "--opt", "diverge=prompt=0,pos=1,run=1", "--out", tmp_path / "f",
            env={"CI": "", "GITHUB_STEP_SUMMARY": str(target)})
    assert r.exit_code == 1 and r.stdout.startswith("detllm check: FAIL") and "GITHUB_STEP_SUMMARY" in r.stderr


def test_a_check_fail_names_diagnose_on_its_folder_and_diagnose_takes_it(cli, tmp_path):
    out = tmp_path / "fail"
    r = cli("check", "--backend", "fake", "--opt", "diverge=prompt=0,pos=1,run=1", "--out", out, env=NOT_CI)
    assert r.exit_code == 1
    nxt = [line for line in r.stdout.splitlines() if line.startswith("next: ")]
    assert nxt == [f"next: detllm diagnose {out} (finds the setting that makes it stop); "
                   "the engine is nondeterministic at this setting: set --threads, or look for atomics/async kernels"]
    assert "raise --tier" not in r.stdout
    assert "next: detllm diagnose RUN_DIR " in (out / "report.txt").read_text()  # the folder's own copy names no path
    # the suggested command runs as printed
    d = cli(*nxt[0].removeprefix("next: ").split(" (")[0].split()[1:], "--out", tmp_path / "diag", env=NOT_CI)
    assert d.exit_code == 0, d.output
    assert (tmp_path / "diag" / "diagnosis.json").is_file()




def test_the_issue_text_installs_this_detllm_from_its_repository(tmp_path):
    """Not PyPI's `detllm` (the older 0.1, which cannot read these packs): the install that
    tests/test_ci_action.py and tests/test_install.py run, with the extra the run's engine needs."""
    from detllm.commands.report import render_path

    import detllm

    fixtures = Path(__file__).parent / "fixtures" / "diff"
    detllm.check(backend="fake", out=tmp_path / "check", max_new_tokens=4, options={"diverge": "prompt=0,pos=1,run=1"})
    detllm.diff(fixtures / "base", fixtures / "engine_llamacpp", out=tmp_path / "diff")
    for folder, extra in ((tmp_path / "check", "."), (tmp_path / "diff", "'.[hf]'")):  # fake: no extra; llamacpp's built-in GGUF: hf
        text = render_path(folder, "issue")
        assert f"With detllm from its repository (in a clone: `pip install -c constraints.txt {extra}`; " in text
        assert "pip install detllm" not in text
def test_the_diagnose_step_is_in_the_step_summary_md_and_html_too(cli, tmp_path):
    """A check FAIL's first next step is `detllm diagnose RUN_DIR` in every rendering a CI user reads:
    the step summary (markdown), report.md and the HTML page; a PASS and a diff name none."""
    summary = tmp_path / "summary.md"
    out = tmp_path / "fail"
    r = cli("check", "--backend", "fake", "--opt", "diverge=prompt=0,pos=1,run=1", "--out", out,
            env={"CI": "true", "GITHUB_STEP_SUMMARY": str(summary)})
    assert r.exit_code == 1
    step = "`detllm diagnose RUN_DIR` finds the setting that makes it stop"
    assert step in summary.read_text() and step in (out / "report.md").read_text()
    html = cli("report", out, "--format", "html")
    assert "next: <code>detllm diagnose RUN_DIR</code> finds the setting" in html.stdout
    ok = cli("check", "--backend", "fake", "--out", tmp_path / "pass", env=NOT_CI)
    assert ok.exit_code == 0 and "detllm diagnose" not in (tmp_path / "pass" / "report.md").read_text()
