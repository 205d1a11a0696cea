"""check --negative-control and the sensitivity line, on the fake backend: a control that does
not differ must make the verdict say the prompts were too few; one that differs is reported."""

from __future__ import annotations

import json

from tests.conftest import assert_valid_run

BASE = ("check", "--backend", "fake", "--model", "fake", "--max-new-tokens", "6", "--no-progress")


def test_control_that_does_not_differ_says_the_check_could_not_fail(cli, tmp_path):
    r = cli(*BASE, "--negative-control", "--out", tmp_path / "r")
    assert r.exit_code == 0, r.output
    rep = assert_valid_run(tmp_path / "r")
    assert rep["negative_control"]["ran"] and rep["negative_control"]["differed"] is False
    assert rep["sensitivity"] == {"drift_observed": False, "max_abs_logprob_diff": 0.0, "where": []}
    assert "too few to expose variance" in r.output and "no drift observed anywhere" in r.output
    assert "too few to expose variance" in (tmp_path / "r" / "report.md").read_text()


def test_control_that_differs_is_reported_and_seen_by_sensitivity(cli, tmp_path):
    r = cli(*BASE, "--negative-control", "--opt", "batch_drift=0.001", "--out", tmp_path / "r")
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    nc = rep["negative_control"]
    assert nc["differed"] is True and nc["batch_size"] == 8 and nc["prompts_differed"] == 4 and nc["token_divergences"] == 0
    assert abs(nc["max_abs_logprob_diff"] - 0.007) < 1e-9  # 7 fillers x 0.001
    assert rep["sensitivity"]["where"] == ["negative control"] and "differed as it should" in r.output


def test_sensitivity_sees_drift_a_tier_does_not_require(cli, tmp_path):
    """Tier 1 across batch sizes: tokens agree (PASS) but logprobs moved, and the report says so."""
    r = cli(*BASE, "--vary-batch", "1,4", "--opt", "batch_drift=0.001", "--out", tmp_path / "r")
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["status"] == "PASS" and "negative_control" not in rep
    assert rep["sensitivity"]["drift_observed"] and rep["sensitivity"]["where"] == ["batch 4 vs batch 1"]
    assert "sensitivity: drift observed in batch 4 vs batch 1" in r.output


def test_negative_control_is_refused_for_run(cli, tmp_path):
    r = cli("run", "--backend", "fake", "--negative-control", "--out", tmp_path / "r")
    assert r.exit_code == 2 and "belongs to check" in r.output and not (tmp_path / "r").exists()
