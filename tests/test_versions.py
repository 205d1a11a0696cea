"""Run folders written by earlier detllm versions stay readable (detllm/versions.py).

tests/fixtures/v1/ holds folders written by the schema_version 1 code, committed as they
came out: a FAIL check, a PASS check, a sampled hf run, a diff folder and a pack.
"""

from __future__ import annotations

import json
from pathlib import Path

import detllm
from detllm.core import versions
from detllm.runfolder.artifacts import load_run, validate_folder

V1 = Path(__file__).parent / "fixtures" / "v1"


def test_v1_folders_validate_under_their_own_schemas():
    for name in ("check_fail", "check_pass", "run_hf_sampled", "diff_fail"):
        folder = V1 / name
        assert json.loads((folder / "report.json").read_text())["schema_version"] == "1"
        assert "report.json" in validate_folder(folder)


def test_v1_folders_verify_offline(cli):
    for target in ("check_fail", "check_pass", "run_hf_sampled", "check_fail.tar.gz"):
        r = cli("verify", V1 / target)
        assert r.exit_code == 0, (target, r.stdout, r.stderr)


def test_v1_report_renders(cli):
    r = cli("report", V1 / "check_fail")
    assert r.exit_code == 0 and "FAIL" in r.stdout and "RUN_VARIANCE" in r.stdout


def test_v1_run_config_reads_the_old_logprobs_name():
    run = load_run(V1 / "check_fail")
    cfg = detllm.RunConfig.from_json(run.run_config["config"])
    assert run.run_config["config"]["logprobs_top_k"] == 3 and cfg.logprobs == 3


def test_diff_within_v1_still_finds_the_divergence():
    out = detllm.diff(f"{V1 / 'check_fail'}::run_0@batch_1", f"{V1 / 'check_fail'}::run_1@batch_1")
    assert out.status == "FAIL" and out.report["causes"][0]["code"] == "RUN_VARIANCE"


def test_versioning_table_names_the_logprobs_rename():
    assert versions.is_redefined("run_config.config.logprobs", "1", "2")
    assert not versions.is_redefined("run_config.config.logprobs", "2", "2")
    assert not versions.is_redefined("run_config.config.seedless", "1", "2")


# ------------------------------------------------------------------ version 3 (R18, R8): folders of version 2 stay readable

V2 = Path(__file__).parent / "fixtures" / "v2"  # written by the schema_version 2 code (commit c2372c3), as they came out


def test_v2_folders_validate_under_their_own_schemas():
    for name in ("check_fail", "check_pass", "diff_fail"):
        folder = V2 / name
        assert json.loads((folder / "report.json").read_text())["schema_version"] == "2"
        assert "report.json" in validate_folder(folder)


def test_v2_folders_verify_by_their_own_chain(cli):
    for target in ("check_fail", "check_pass", "check_fail.tar.gz"):
        r = cli("verify", V2 / target)
        assert r.exit_code == 0, (target, r.stdout, r.stderr)
        assert "verdict not re-derived: written under schema_version 2" in r.stdout
    assert json.loads((V2 / "check_fail" / "manifest.json").read_text())["trace"]["chain"] == "detllm-trace-chain/1"


def test_a_v2_trace_edited_is_still_named(cli, tmp_path):
    import shutil

    folder = tmp_path / "v2"
    shutil.copytree(V2 / "check_fail", folder)
    lines = (folder / "trace.jsonl").read_text().splitlines()
    rec = json.loads(lines[1])
    rec["token_ids"][0] += 1
    lines[1] = json.dumps(rec)
    (folder / "trace.jsonl").write_text("\n".join(lines) + "\n")
    r = cli("verify", folder)
    assert r.exit_code == 6 and "trace.jsonl line 2" in r.stderr, r.output


def test_diff_within_v2_and_across_v2_and_v3():
    out = detllm.diff(f"{V2 / 'check_fail'}::run_0@batch_1", f"{V2 / 'check_fail'}::run_1@batch_1", tier=2)
    assert out.status == "FAIL" and out.report["causes"][0]["code"] == "RUN_VARIANCE"
    assert out.report["schema_version"] == versions.CURRENT == "5"


def test_the_in_version_changes_of_version_2_are_redefined_at_version_3():
    """Two meanings changed within version 2 (R18): the null in sensitivity.max_abs_logprob_diff, and
    token strings in token_ids; from version 3 on, such a change comes with a bump."""
    assert versions.is_redefined("report.sensitivity.max_abs_logprob_diff", "2", "3")
    assert not versions.is_redefined("report.sensitivity.max_abs_logprob_diff", "3", "3")
    assert any(c.field == "trace_record.token_ids" and "against the rule" in c.what for c in versions.EXTENDED)
    assert [c.since for c in versions.SEALED] == ["3", "5"]
    assert versions.READABLE == ("1", "2", "3", "4", "5")


def test_every_change_names_a_version_this_detllm_reads():
    """A change is dated by the first version with the new meaning; every table keeps the rule's shape."""
    for table in (versions.REDEFINED, versions.EXTENDED, versions.SEALED, versions.CONCLUDED):
        for c in table:
            assert c.since in versions.READABLE and c.since != "1", c
            assert c.field.split(".")[0] in ("run_config", "env", "trace_record", "report", "manifest", "diagnosis", "sweep",
                                              "train_config", "train_report", "train_replay", "train_diff", "fleet", "locate"), c


V4 = Path(__file__).parent / "fixtures" / "v4"  # written by the schema_version 4 code (commit 7930d5f), fake backend


def test_a_v4_check_folder_validates_and_its_verdict_is_still_re_derived(cli):
    """Version 5 changed no field a check reads (training's chain and locate's graft only), so a version-4
    check's verdict is re-derived from its trace, not only its bytes checked."""
    assert versions.verdict_rule_versions() == {"4", "5"}
    r = cli("verify", V4 / "check_pass")
    assert r.exit_code == 0 and "verdict re-derived from the trace: PASS" in r.stdout, r.output
    assert "not re-derived" not in r.stdout
