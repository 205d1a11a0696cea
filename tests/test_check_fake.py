"""`check` verdicts on the fake backend: every status, the divergence named exactly."""

from __future__ import annotations

import json

import detllm
from detllm.pipeline.runner import plan_batches

from .conftest import assert_valid_run


def test_pass_writes_every_artifact(cli, tmp_path):
    out = tmp_path / "run"
    r = cli("check", "--backend", "fake", "--runs", "3", "--vary-batch", "1,2,8", "--tier", "2", "--out", out)
    assert r.exit_code == 0, r.output
    assert "detllm check: PASS" in r.stdout
    report = assert_valid_run(out)
    assert report["status"] == "PASS" and report["category"] == "PASS"
    names = [c["name"] for c in report["comparisons"]]
    assert names == ["run_1 vs run_0 @ batch 1", "run_2 vs run_0 @ batch 1", "batch 2 vs batch 1", "batch 8 vs batch 1"]
    lines = (out / "trace.jsonl").read_text().splitlines()
    assert len(lines) == 4 * (3 + 1 + 1)  # 4 prompts x (3 runs at batch 1 + batch 2 + batch 8)


def test_injected_token_divergence_names_prompt_index_and_tokens(cli, tmp_path):
    out = tmp_path / "run"
    r = cli("check", "--backend", "fake", "--opt", "diverge=prompt=2,pos=5,run=1", "--out", out)
    assert r.exit_code == 1, r.output
    assert "prompt 2, generated token 5" in r.stdout
    report = assert_valid_run(out, failed=True)
    d = report["first_divergence"]
    assert (report["status"], report["category"]) == ("FAIL", "RUN_VARIANCE")
    assert (d["prompt_index"], d["token_index"], d["kind"]) == (2, 5, "token")
    assert d["left"]["token_id"] != d["right"]["token_id"]
    assert d["left"]["token_text"] == chr(d["left"]["token_id"])
    assert f"id {d['left']['token_id']}" in r.stdout and f"id {d['right']['token_id']}" in r.stdout
    fd = json.loads((out / "diffs" / "first_divergence.json").read_text())
    assert fd["divergence"] == d


def test_batch_divergence_is_batch_variance(tmp_path):
    o = detllm.check(backend="fake", options={"diverge": "prompt=0,pos=2,batch=4"}, vary_batch=(1, 4), out=tmp_path / "r")
    assert o.exit_code == 1
    assert o.report["category"] == "BATCH_VARIANCE"
    assert o.report["first_divergence"]["comparison"] == "batch 4 vs batch 1"
    assert o.report["causes"][0]["evidence"]["batch_sizes"] == [1, 4]


def test_logprob_only_divergence_fails_tier_2_not_tier_1(tmp_path):
    spec = {"diverge": "prompt=1,pos=4,run=1,what=logprob"}
    t1 = detllm.check(backend="fake", options=spec, tier=1, out=tmp_path / "t1")
    t2 = detllm.check(backend="fake", options=spec, tier=2, out=tmp_path / "t2")
    assert t1.status == "PASS"
    assert t2.status == "FAIL"
    d = t2.report["first_divergence"]
    assert (d["kind"], d["token_index"]) == ("logprob", 4)
    assert 0 < d["logprob_abs_diff"] < 1e-5


def test_atol_absorbs_a_small_logprob_difference(tmp_path):
    spec = {"diverge": "prompt=1,pos=4,run=1,what=logprob"}
    o = detllm.check(backend="fake", options=spec, tier=2, atol=1e-5, out=tmp_path / "r")
    assert o.status == "PASS"
    assert json.loads((tmp_path / "r" / "run_config.json").read_text())["config"]["atol"] == 1e-5


def test_batch_logprob_drift_is_info_at_tier_2_and_failure_at_tier_3(tmp_path):
    opts = {"batch_drift": "1e-7", "batch_invariant": "true"}
    t2 = detllm.check(backend="fake", options=opts, tier=2, vary_batch=(1, 2), out=tmp_path / "t2")
    assert t2.status == "PASS"
    assert [c["status"] for c in t2.report["comparisons"] if c["kind"] == "batch"] == ["PASS", "INFO"]
    t3 = detllm.check(backend="fake", options=opts, tier=3, vary_batch=(1, 2), out=tmp_path / "t3")
    assert (t3.status, t3.report["category"]) == ("FAIL", "BATCH_VARIANCE")


def test_tier_0_records_without_a_verdict(tmp_path):
    o = detllm.check(backend="fake", options={"diverge": "prompt=0,pos=0,run=1"}, tier=0, out=tmp_path / "r")
    assert o.status == "RECORDED" and o.exit_code == 0
    assert o.report["comparisons"][0]["status"] == "INFO"


def test_strict_mode_refuses_unenforceable_tier_and_writes_nothing(cli, tmp_path):
    out = tmp_path / "run"
    r = cli("check", "--backend", "fake", "--tier", "3", "--mode", "strict", "--vary-batch", "1,2", "--out", out)
    assert r.exit_code == 3
    assert "tier 3 refused in strict mode" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_best_effort_downgrades_and_records_it(tmp_path):
    o = detllm.check(backend="fake", tier=3, vary_batch=(1, 2), out=tmp_path / "r")
    applied = json.loads((tmp_path / "r" / "determinism_applied.json").read_text())
    assert (applied["tier_requested"], applied["tier_effective"], applied["downgraded"]) == (3, 2, True)
    assert "enforces tier 2 at most" in applied["downgrade_reason"]
    assert o.report["tier"] == {"requested": 3, "effective": 2}


def test_sampling_is_seeded_per_request(tmp_path):
    a = detllm.run(backend="fake", temperature=0.8, seed=7, out=tmp_path / "a")
    b = detllm.run(backend="fake", temperature=0.8, seed=7, batch_size=4, out=tmp_path / "b")
    c = detllm.run(backend="fake", temperature=0.8, seed=8, out=tmp_path / "c")
    toks = [[json.loads(l)["token_ids"] for l in (p / "trace.jsonl").read_text().splitlines()] for p in (tmp_path / "a", tmp_path / "b", tmp_path / "c")]
    assert a.status == b.status == c.status == "RECORDED"
    assert toks[0] == toks[1], "same seed, same tokens, whatever the batch"
    assert toks[0] != toks[2]


def test_no_prompt_text_keeps_only_hashes(tmp_path):
    detllm.run(backend="fake", record_prompt_text=False, out=tmp_path / "r")
    blob = (tmp_path / "r").joinpath("trace.jsonl").read_text()
    assert "capital of France" not in blob
    rec = json.loads(blob.splitlines()[0])
    assert rec["prompt_text"] is None and rec["input_ids"] is None and len(rec["input_ids_sha256"]) == 64


def test_plan_batches_tops_up_with_fillers():
    assert plan_batches(5, 2) == [[0, 1], [2, 3], [4, -1]]
    assert plan_batches(2, 4) == [[0, 1, -1, -2]]


def test_reused_out_keeps_no_stale_files(tmp_path):
    out = tmp_path / "r"
    detllm.check(backend="fake", options={"diverge": "prompt=0,pos=0,run=1"}, out=out)
    assert (out / "diffs" / "first_divergence.json").exists()
    (out / "user-notes.txt").write_text("mine")
    detllm.check(backend="fake", out=out)
    assert not (out / "diffs").exists(), "a stale first_divergence.json survived"
    assert (out / "user-notes.txt").read_text() == "mine"
    assert_valid_run(out)


def test_json_flag_prints_report(cli, tmp_path):
    r = cli("check", "--backend", "fake", "--json", "--out", tmp_path / "r")
    assert r.exit_code == 0
    assert json.loads(r.stdout)["status"] == "PASS"


def test_report_command_renders_existing_folder(cli, tmp_path):
    detllm.check(backend="fake", options={"diverge": "prompt=0,pos=1,run=1"}, out=tmp_path / "r")
    r = cli("report", tmp_path / "r")
    assert r.exit_code == 0 and "FAIL [RUN_VARIANCE]" in r.stdout


def test_fake_injection_keeps_logprobs_consistent_with_top_k(tmp_path):
    detllm.run(backend="fake", options={"diverge": "prompt=0,pos=2"}, out=tmp_path / "r")
    rec = json.loads((tmp_path / "r" / "trace.jsonl").read_text().splitlines()[0])
    for tok, lp, top in zip(rec["token_ids"], rec["logprobs"], rec["top_logprobs"]):
        assert top[0] == [tok, lp], "greedy: the chosen token is the top-1 with its own logprob"


def test_env_capture_redacts_secrets_and_skips_per_process_ids():
    from detllm.runfolder.env import redact_env

    got = redact_env({"HF_TOKEN": "x", "OMP_NUM_THREADS": "2", "HF_ENDPOINT": "https://u:p@host", "HOME": "/root",
                      "VLLM_DIST_IDENT": "vllm_dist_1234", "MY_API_KEY": "k", "VLLM_API_KEY": "k"})
    assert got == {"HF_ENDPOINT": "<redacted>", "HF_TOKEN": "<redacted>", "OMP_NUM_THREADS": "2", "VLLM_API_KEY": "<redacted>"}


def test_tier_3_without_vary_batch_is_refused(cli, tmp_path):
    r = cli("check", "--backend", "fake", "--opt", "batch_invariant=true", "--tier", "3", "--out", tmp_path / "r")
    assert r.exit_code == 2 and "add --vary-batch" in r.stderr
    assert not (tmp_path / "r").exists()


def test_check_and_diff_share_one_noise_floor_rule():
    from detllm.compare.divergence import noise_floor, run_noise_floor

    gguf = [{"name": "dtype", "value": "Q4_1"}]
    assert run_noise_floor("float32", gguf, "Q4_1") == noise_floor("float32", "Q4_1") > noise_floor("float32")
    assert run_noise_floor("auto", [{"name": "dtype", "value": "float32"}], None) == noise_floor("float32")
    assert run_noise_floor("bfloat16", [], None) == noise_floor("bfloat16")
