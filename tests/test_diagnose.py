"""diagnose on the fake backend: divergences injected so that they follow a knob, and the
diagnosis must name that knob (or say plainly that nothing isolates it). Every probe is a
real child process running the real runner; only the engine is scripted."""

from __future__ import annotations

import json

import pytest

from detllm.api import make_config
from detllm.runfolder.artifacts import read_json
from detllm.diagnose import Budget, diagnose
from detllm.diagnose.evidence import outcome
from detllm.diagnose.needle import trial_plan
from detllm.diagnose.probes import plan
from detllm.core.errors import UsageError

BATCH8 = "prompt=0,pos=3,batch=8"


def fake(**opts):
    fields = {k: v for k, v in opts.items() if k in ("tier", "runs", "vary_batch", "threads")}
    options = {k: str(v) for k, v in opts.items() if k not in fields}
    fields.setdefault("tier", 2)
    fields.setdefault("runs", 2)
    return make_config(backend="fake", model="fake", max_new_tokens=6, options=options, **fields)


def knob(doc, name):
    return next(k for k in doc["knobs"] if k["knob"] == name)


def test_batch_divergence_that_follows_threads_is_isolated_and_confirmed(tmp_path):
    d = diagnose(fake(vary_batch=(1, 8), diverge=BATCH8, stable_threads=1), out=tmp_path / "d", budget=10, fresh_repeats=2)
    doc = read_json(tmp_path / "d" / "diagnosis.json", "diagnosis")  # schema-validated
    assert doc == d.doc
    assert doc["baseline"]["kinds"] == ["batch"] and doc["baseline"]["first"]["token_index"] == 3
    assert doc["knobs"][0]["knob"] == "batch composition" and doc["knobs"][0]["verdict"] == "follows"
    assert "batch sizes 8 differ" in doc["knobs"][0]["summary"]
    assert knob(doc, "threads")["verdict"] == "vanishes"
    assert doc["isolated"] is True
    ps = doc["passing_settings"]
    assert ps["settings"] == {"threads": 1} and ps["fresh_process_passes"] == ps["fresh_process_runs"] == 2
    assert "threads=1: PASS at tier 2 in 2/2 fresh-process checks" in doc["conclusion"]
    ladder = next(p for p in doc["probes"] if p["kind"] == "ladder")
    assert ladder["evidence"]["diverged_batch_sizes"] == [8]  # 2 and 4 hold: the injection is keyed on batch 8
    assert any(n["name"].startswith("fresh-process") and "isolated" in n["reason"] for n in doc["not_run"])
    text = (tmp_path / "d" / "diagnosis.txt").read_text()
    assert text.startswith("DIAGNOSIS fake fake at tier 2: diverges (batch)") and "passing: threads=1" in text
    assert "| batch composition | follows |" in (tmp_path / "d" / "diagnosis.md").read_text()


def test_nothing_isolates_it_is_said_plainly(tmp_path):
    doc = diagnose(fake(vary_batch=(1, 8), diverge=BATCH8), out=tmp_path / "d", only=["threads", "needle"]).doc
    assert doc["isolated"] is False and doc["passing_settings"] is None
    assert knob(doc, "threads")["verdict"] == "not_followed"
    assert "Nothing isolates it" in doc["conclusion"] and "batch size 1" in doc["conclusion"]
    needle = next(p for p in doc["probes"] if p["kind"] == "needle")
    sizes = {t["size"] for t in needle["evidence"]["trials"] if t["diverged"]}
    assert sizes and sizes <= {8}  # only a batch of 8 changes the prompt: the needle found exactly that


def test_tier3_downgraded_to_2_is_diagnosed_at_tier_3(tmp_path):
    """The fake enforces tier 2; the batch logprob drift tier 3 would fail on is what is diagnosed."""
    doc = diagnose(fake(tier=3, vary_batch=(1, 4), batch_drift=0.001, stable_threads=1), out=tmp_path / "d", only=["threads"],
                   fresh_repeats=2).doc
    assert doc["tier_requested"] == 3
    assert doc["baseline"]["kinds"] == ["batch"] and doc["baseline"]["first"]["kind"] == "logprob"
    assert doc["baseline"]["max_abs_logprob_diff"] == pytest.approx(0.003)
    assert knob(doc, "threads")["verdict"] == "vanishes"


def test_run_variance_in_one_process_is_not_a_fresh_process_effect(tmp_path):
    doc = diagnose(fake(runs=2, diverge="prompt=1,pos=2,run=1"), out=tmp_path / "d", only=["threads", "fresh_process"],
                   fresh_repeats=2).doc
    assert doc["baseline"]["kinds"] == ["run"]
    fresh = next(p for p in doc["probes"] if p["kind"] == "fresh_process")
    assert fresh["evidence"]["processes"] == 2 and fresh["outcome"] == "vanish"
    assert knob(doc, "process")["verdict"] == "not_followed"
    assert "Nothing isolates it" in doc["conclusion"] and "batch size 1" not in doc["conclusion"]


def test_a_passing_check_has_nothing_to_diagnose(tmp_path):
    doc = diagnose(fake(vary_batch=(1, 2)), out=tmp_path / "d").doc
    assert doc["probes"] == [] and doc["baseline"]["diverged"] is False
    assert doc["conclusion"].startswith("Nothing to diagnose")


def test_budget_stops_the_plan(tmp_path):
    doc = diagnose(fake(vary_batch=(1, 8), diverge=BATCH8), out=tmp_path / "d", budget=1).doc
    assert len(doc["probes"]) == 1 and doc["budget"]["probes_used"] == 1
    assert all("budget" in n["reason"] for n in doc["not_run"]) and doc["not_run"]


@pytest.mark.parametrize("text,probes,seconds", [("7", 7, None), ("90s", None, 90.0), ("2m", None, 120.0)])
def test_budget_parse(text, probes, seconds):
    assert Budget.parse(text) == Budget(probes=probes, seconds=seconds)


@pytest.mark.parametrize("bad", ["abc", "0", "-5s"])
def test_bad_budget_is_a_usage_error_before_anything_runs(cli, tmp_path, bad):
    r = cli("diagnose", "--budget", bad, "--out", tmp_path / "d", "--backend", "fake")
    assert r.exit_code == 2 and "--budget" in r.output and not (tmp_path / "d").exists()
    with pytest.raises(UsageError):
        Budget.parse(bad)


def test_cli_runs_the_check_then_diagnoses_its_folder(cli, tmp_path):
    r = cli("diagnose", "--backend", "fake", "--model", "fake", "--tier", "2", "--vary-batch", "1,8", "--max-new-tokens", "6",
            "--opt", f"diverge={BATCH8}", "--opt", "stable_threads=1", "--out", tmp_path / "d", "--probe", "threads",
            "--fresh-repeats", "2", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["source"]["kind"] == "check" and doc["source"]["status"] == "FAIL"
    assert doc["source"]["recorded_causes"] == ["BATCH_VARIANCE"]
    assert (tmp_path / "d" / "baseline" / "report.json").is_file()
    # the folder form: the same failing check folder, diagnosed again
    r2 = cli("diagnose", tmp_path / "d" / "baseline", "--out", tmp_path / "d2", "--probe", "ladder")
    assert r2.exit_code == 0, r2.output
    assert "DIAGNOSIS fake fake at tier 2: diverges (batch)" in r2.output


def test_cli_bad_check_options_leave_nothing(cli, tmp_path):
    r = cli("diagnose", "--backend", "nope", "--out", tmp_path / "d")
    assert r.exit_code == 2 and "unknown backend 'nope'" in r.output and not (tmp_path / "d").exists()


def test_cli_not_a_folder_is_exit_5(cli, tmp_path):
    (tmp_path / "empty").mkdir()
    r = cli("diagnose", tmp_path / "empty", "--out", tmp_path / "d")
    assert r.exit_code == 5 and "not a detllm run or diff folder" in r.output


def test_a_diff_across_batch_sizes_follows_the_batch_size(cli, tmp_path):
    run = tmp_path / "run"
    assert cli("check", "--backend", "fake", "--model", "fake", "--vary-batch", "1,8", "--max-new-tokens", "6",
               "--opt", f"diverge={BATCH8}", "--out", run).exit_code == 1
    assert cli("diff", f"{run}::batch_1", f"{run}::batch_8", "--out", tmp_path / "diff").exit_code == 1
    doc = diagnose(run_dir=tmp_path / "diff", out=tmp_path / "d").doc
    assert doc["source"]["kind"] == "diff" and doc["source"]["left"] == str(run)
    assert doc["baseline"]["kinds"] == ["diff"] and [p["kind"] for p in doc["probes"]] == ["rerun", "recorded"]
    assert doc["knobs"][0]["knob"] == "batch_size" and doc["knobs"][0]["verdict"] == "follows"
    assert doc["conclusion"].startswith("The divergence follows batch_size")


def test_a_diff_of_identically_recorded_sides_is_diagnosed_as_a_check(cli, tmp_path):
    run = tmp_path / "run"
    assert cli("check", "--backend", "fake", "--model", "fake", "--max-new-tokens", "6", "--opt", "diverge=prompt=1,pos=2,run=1",
               "--out", run).exit_code == 1
    assert cli("diff", f"{run}::run_0", f"{run}::run_1", "--out", tmp_path / "diff").exit_code == 1
    doc = diagnose(run_dir=tmp_path / "diff", out=tmp_path / "d", only=["threads"]).doc
    assert doc["source"]["kind"] == "diff" and doc["baseline"]["kinds"] == ["run"]
    assert (tmp_path / "d" / "baseline" / "report.json").is_file()


def test_a_diff_across_models_names_the_cause_without_probing(cli, tmp_path):
    for salt in ("", "x"):
        assert cli("run", "--backend", "fake", "--model", f"fake{salt}", "--max-new-tokens", "4", "--out", tmp_path / f"r{salt}").exit_code == 0
    assert cli("diff", tmp_path / "r", tmp_path / "rx", "--out", tmp_path / "diff").exit_code in (0, 1)
    doc = diagnose(run_dir=tmp_path / "diff", out=tmp_path / "d").doc
    assert doc["probes"] == [] and doc["skipped_knobs"][0]["knob"] == "model"


def test_plan_is_cheapest_first_and_says_what_it_skips():
    probes, skipped = plan(make_config(backend="llamacpp", model="tiny", tier=3, vary_batch=(1, 4)), ["batch"], tier=3)
    names = [p.name for p in probes]
    assert names[:2] == ["batch-size ladder", "threads=1"]
    assert {"kv_type=f32", "flash_attn=off", "ubatch=1"} <= set(names)
    assert [p.cost for p in probes] == sorted(p.cost for p in probes)
    assert {s["knob"] for s in skipped} >= {"dtype", "cache_prompt", "slots"}
    hf, hf_skipped = plan(make_config(backend="hf", model="tiny", tier=2, runs=2, dtype="bfloat16"), ["run"], tier=2)
    assert "dtype=float32" in [p.name for p in hf] and "attn_implementation=sdpa" in [p.name for p in hf]
    assert "needle in a batch" not in [p.name for p in hf]  # a run divergence: no batch probes
    assert any(s["knob"] == "torch.use_deterministic_algorithms" for s in hf_skipped)


def test_outcome_rules():
    base = {"diverged": True, "kinds": ["batch"], "first": {"prompt_index": 0, "token_index": 3, "kind": "token"},
            "max_abs_logprob_diff": 1e-3}
    assert outcome({**base, "diverged": False, "kinds": [], "first": None}, base) == "vanish"
    # the batch divergence is gone but a repeat now differs: it moved, it did not vanish (R5)
    assert outcome({**base, "kinds": ["run"], "first": {"prompt_index": 1, "token_index": 0, "kind": "token"}}, base) == "move"
    assert outcome(dict(base), base) == "persist"
    assert outcome({**base, "max_abs_logprob_diff": 1e-5}, base) == "move"
    assert outcome({**base, "first": {"prompt_index": 0, "token_index": 5, "kind": "token"}}, base) == "move"


def test_needle_plan_is_seeded_and_in_range():
    a = trial_plan(10, trials=20, max_size=8, seed=3)
    assert a == trial_plan(10, trials=20, max_size=8, seed=3) != trial_plan(10, trials=20, max_size=8, seed=4)
    assert all(2 <= t["size"] <= 8 and 0 <= t["position"] < t["size"] and len(t["others"]) == t["size"] - 1 for t in a)


def test_diagnose_never_imports_an_engine_in_the_calling_process(tmp_path):
    """Every probe runs in a worker process; the caller stays light (the hf case would load torch there)."""
    from tests.test_lazy_imports import run_probe

    got = run_probe(["diagnose", "--backend", "fake", "--model", "fake", "--vary-batch", "1,8", "--opt", f"diverge={BATCH8}",
                     "--max-new-tokens", "4", "--probe", "ladder", "--out", str(tmp_path / "d")])
    assert got.startswith("EXIT 0 HEAVY ") and not {"torch", "transformers", "vllm"} & set(got.split()[-1].split(","))
    assert (tmp_path / "d" / "diagnosis.json").is_file()  # numpy may come from the drift statistics; engines may not


# ------------------------------------------------------------------ issue 20: diagnose never claims more than it measured


def test_a_setting_whose_confirmation_the_budget_cut_is_unconfirmed(tmp_path):
    """threads=1 vanishes, then the budget allows one of three fresh-process confirmations: not a
    passing setting, and said so (R5, path 3; it used to read "PASS ... in 1/1")."""
    doc = diagnose(fake(vary_batch=(1, 8), diverge=BATCH8, stable_threads=1), out=tmp_path / "d", only=["threads"], budget=2,
                   fresh_repeats=3).doc
    probe = next(p for p in doc["probes"] if p["name"] == "threads=1")
    conf = probe["evidence"]["confirmation"]
    assert probe["outcome"] == "vanish" and conf["status"] == "unconfirmed"
    assert (conf["fresh_process_passes"], conf["fresh_process_runs"], conf["fresh_repeats"]) == (1, 1, 3)
    assert doc["passing_settings"] is None and doc["isolated"] is False
    assert "Minimal passing setting" not in doc["conclusion"]
    assert "unconfirmed: the --budget ended after 1/3 fresh-process checks" in doc["conclusion"]
    assert "1/1" not in (tmp_path / "d" / "diagnosis.txt").read_text()


def test_a_setting_that_fails_one_fresh_process_confirmation_is_not_passing(tmp_path, monkeypatch):
    """threads=1 vanishes, then the second of three fresh-process confirmations diverges (its process
    gets a repeat injection, as a flaky engine would): no passing setting, the rest of the
    confirmations are not run, and the knob only moved the divergence (R5, path 1; it used to read
    "Minimal passing setting: threads=1: FAIL ... in 2/3")."""
    import detllm.diagnose.core as core

    class FlakySecondProcess(core.Pool):
        def fresh(self, job, env=None):
            if job.get("out", "").endswith("confirm-threads=1-1"):
                opts = job["config"]["options"]
                job = {**job, "config": {**job["config"], "options": {**opts, "diverge": opts["diverge"] + ";prompt=1,pos=2,run=1"}}}
            return super().fresh(job, env)

    monkeypatch.setattr(core, "Pool", FlakySecondProcess)
    doc = diagnose(fake(vary_batch=(1, 8), diverge=BATCH8, stable_threads=1), out=tmp_path / "d", only=["threads"], fresh_repeats=3).doc
    probe = next(p for p in doc["probes"] if p["name"] == "threads=1")
    conf = probe["evidence"]["confirmation"]
    assert probe["outcome"] == "vanish" and conf["status"] == "failed"
    assert (conf["fresh_process_passes"], conf["fresh_process_runs"], conf["fresh_repeats"]) == (1, 2, 3)
    assert not (tmp_path / "d" / "probes" / "confirm-threads=1-2").exists()
    assert doc["passing_settings"] is None and doc["isolated"] is False
    assert knob(doc, "threads")["verdict"] == "moves"
    assert "Minimal passing setting" not in doc["conclusion"]
    assert "threads=1 vanished in the probe but failed its confirmation: PASS at tier 2 in 1/2 fresh-process checks" in doc["conclusion"]


def test_fresh_process_probe_of_a_check_recorded_with_negative_control(cli, tmp_path):
    """check --negative-control is check's alone; the fresh-process probe re-runs the settings as runs (R10)."""
    assert cli("check", "--backend", "fake", "--model", "fake", "--opt", "diverge=prompt=0,pos=1,run=1", "--negative-control",
               "--runs", "2", "--max-new-tokens", "4", "--out", tmp_path / "nc").exit_code == 1
    doc = diagnose(run_dir=tmp_path / "nc", out=tmp_path / "d", only=["fresh_process"], fresh_repeats=2).doc
    fresh = next(p for p in doc["probes"] if p["kind"] == "fresh_process")
    assert fresh["status"] == "ran", fresh.get("reason")
    assert fresh["evidence"]["processes"] == 2 and fresh["outcome"] == "vanish"  # run=1 of one process: no new process differs


def _threads_diff(cli, tmp_path):
    """Two fake runs, --threads 1 (stable: no batch drift) against the default (drift at batch 2)."""
    common = ("--backend", "fake", "--model", "fake", "--opt", "batch_drift=0.01", "--opt", "stable_threads=1", "--batch-size", "2",
              "--max-new-tokens", "4", "--tier", "2")
    assert cli("run", *common, "--threads", "1", "--out", tmp_path / "L").exit_code == 0
    assert cli("run", *common, "--out", tmp_path / "R").exit_code == 0
    assert cli("diff", tmp_path / "L", tmp_path / "R", "--out", tmp_path / "diff", "--tier", "2").exit_code == 1
    return tmp_path / "diff"


def test_a_diff_switches_threads_back_to_the_engine_default(cli, tmp_path):
    """The right side ran at the engine's default threads: the probe "threads=None" must run with
    threads unset, not with the left side's 1 (R6)."""
    doc = diagnose(run_dir=_threads_diff(cli, tmp_path), out=tmp_path / "d").doc
    probe = next(p for p in doc["probes"] if p["kind"] == "recorded")
    assert probe["name"] == "threads=None" and probe["setting"] == {"threads": None}
    ran = read_json(tmp_path / "d" / probe["folder"] / "run_config.json", "run_config")["config"]
    assert ran["threads"] is None
    assert probe["outcome"] == "follows" and knob(doc, "threads")["verdict"] == "follows"
    assert doc["conclusion"].startswith("The divergence follows threads")


def test_probe_selects_among_a_diffs_recorded_differences(cli, tmp_path):
    """--probe on a diff whose sides differ keeps the knobs named (the left side's re-run always
    runs); a knob that is not one of its recorded differences is one line, exit 2, nothing written."""
    common = ("--backend", "fake", "--model", "fake", "--max-new-tokens", "4", "--tier", "2", "--batch-size", "2",
              "--opt", "batch_drift=0.01", "--opt", "stable_threads=1")
    assert cli("run", *common, "--threads", "1", "--seed", "1", "--out", tmp_path / "L").exit_code == 0
    assert cli("run", *common, "--seed", "2", "--out", tmp_path / "R").exit_code == 0
    assert cli("diff", tmp_path / "L", tmp_path / "R", "--out", tmp_path / "diff", "--tier", "2").exit_code == 1
    doc = diagnose(run_dir=tmp_path / "diff", out=tmp_path / "d", only=["seed"]).doc
    assert [p["name"] for p in doc["probes"]] == ["left settings again", "seed=2"]
    assert doc["not_run"] == [{"name": "threads=None", "reason": "not selected by --probe"}]
    r = cli("diagnose", tmp_path / "diff", "--probe", "kv_type", "--out", tmp_path / "d2")
    assert r.exit_code == 2 and not (tmp_path / "d2").exists()
    assert r.output.count("\n") == 1 and "--probe 'kv_type' is not a recorded difference of this diff" in r.output
    assert "seed" in r.output and "threads" in r.output and "Traceback" not in r.output
