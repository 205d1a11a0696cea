"""Run folders written by earlier detllm versions stay readable (detllm/versions.py).

tests/fixtures/v1/ holds folders written by the schema_version 1 code, committed as they
came out: a FAIL check, a PASS check, a sampled hf run, a diff folder and a pack.
"""

from __future__ import annotations

import json
from pathlib import Path

import detllm
from detllm import versions
from detllm.artifacts import load_run, validate_folder

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
