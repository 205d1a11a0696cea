"""diagnose does not contradict the check it diagnoses (issue 31 §3): on real transformers (hf `tiny`), a
check that PASSes at tier 2 while its logprobs moved with the batch size (BATCH_VARIANCE recorded) is
not "every comparison agreed": diagnose says what was recorded and how to diagnose it, and `--tier 3`
diagnoses that drift with its probes."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def drifting(tmp_path_factory):
    import detllm

    out = tmp_path_factory.mktemp("drift") / "run"
    detllm.check(backend="hf", model="tiny", vary_batch=(1, 8), runs=2, tier=2, max_new_tokens=4, out=out)
    rep = json.loads((out / "report.json").read_text())
    assert rep["status"] == "PASS" and any(c["status"] == "INFO" and c["prompts_diverged"] for c in rep["comparisons"]), rep
    return out


def test_diagnose_says_what_the_passing_check_recorded(drifting, tmp_path, cli):
    r = cli("diagnose", drifting, "--out", tmp_path / "d")
    assert r.exit_code == 0, r.output
    assert "every comparison agreed" not in r.stdout
    assert "batch 8 vs batch 1 (logprobs)" in r.stdout and "BATCH_VARIANCE" in r.stdout and "--tier 3" in r.stdout, r.stdout


def test_diagnose_at_tier_3_probes_the_logprob_drift(drifting, tmp_path, cli):
    r = cli("diagnose", drifting, "--tier", "3", "--probe", "ladder", "--out", tmp_path / "d")
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "d" / "diagnosis.json").read_text())
    assert doc["tier_requested"] == 3 and doc["baseline"]["diverged"], doc["baseline"]
    ladder = next(p for p in doc["probes"] if p["name"] == "batch-size ladder")
    assert ladder["outcome"] == "follows", ladder


def test_diagnose_tier_and_atol_are_checked(drifting, tmp_path, cli):
    for args, words in ((["--tier", "4"], "--tier"), (["--atol", "-1"], "atol")):
        r = cli("diagnose", drifting, *args, "--out", tmp_path / "d")
        assert r.exit_code == 2 and words in r.stderr and not (tmp_path / "d").exists(), r.output
