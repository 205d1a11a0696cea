"""No vacuous PASS (issue 30): every axis a check varies is shown engaged, not engaged (UNVERIFIED)
or not observable (PASS marked), and every PASS states the binomial bound it proves. Unit tests on
the fake backend (which computes each batch together, or alone with alone=true); real-engine tests
on transformers' tiny model, fresh child processes and a real llama-server with one slot."""

from __future__ import annotations

import html
import json
import math

import pytest

import detllm
from detllm.pipeline.engagement import bound, needed
from tests.conftest import assert_valid_run, tiny_llama_server, trace_records


def _comp(report, name):
    return next(c for c in report["comparisons"] if c["name"] == name)


def test_the_bound_is_the_exact_binomial_one():
    assert needed(0.05) == 59 and needed(0.05, 0.99) == 90
    assert math.isclose(bound(4), 1 - 0.05 ** 0.25) and bound(4) > 0.52  # "below 53%" for 4 prompts
    assert round(bound(12), 4) == 0.2209 and bound(59) < 0.05 < bound(58)
    assert bound(0) == 1.0


def test_fake_batch_is_engaged_and_the_pass_states_its_bound(tmp_path, cli):
    out = tmp_path / "c"
    res = cli("check", "--backend", "fake", "--prompt", "a", "--prompt", "b", "--prompt", "c", "--vary-batch", "1,4",
              "--out", out, "--no-progress", "--html", tmp_path / "r.html")
    assert res.exit_code == 0, res.output
    report = assert_valid_run(out)
    assert report["status"] == "PASS"
    e = _comp(report, "batch 4 vs batch 1")["engagement"]
    assert e["answer"] == "engaged" and "at least 4 rows" in e["evidence"], e
    assert "engagement" not in _comp(report, "run_1 vs run_0 @ batch 1")  # an in-process repeat varies nothing
    assert report["bound"]["upper"] == round(1 - 0.05 ** (1 / 3), 6) and report["bound"]["prompts"] == 3
    line = "0 of 3 prompts diverged: divergence rate < 63.2% (95%), for prompts drawn like these"
    assert line in res.output and line in (out / "report.md").read_text() and line in (out / "report.txt").read_text()
    assert html.escape(line) in (tmp_path / "r.html").read_text()
    assert "(rate < 63.2% at 95%)" in res.output  # on each PASS comparison too


def test_not_engaged_is_unverified_and_strict_exits_3_after_sealing(tmp_path, cli, monkeypatch):
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    out = tmp_path / "c"
    res = cli("check", "--backend", "fake", "--prompt", "a", "--prompt", "b", "--vary-batch", "1,4", "--opt", "alone=true",
              "--mode", "strict", "--out", out, "--no-progress", "--junit", tmp_path / "j.xml")
    assert res.exit_code == 3, res.output
    report = assert_valid_run(out)  # written and sealed before the exit
    assert (report["status"], report["category"]) == ("UNVERIFIED", "UNVERIFIED")
    assert report["engagement"]["unverified"] == ["batch 4 vs batch 1"]
    assert _comp(report, "batch 4 vs batch 1")["engagement"]["answer"] == "not_engaged"
    assert "UNVERIFIED batch 4 vs batch 1: batch size not engaged: 2 of 2 records of batch 4 were computed alone" in res.output
    assert "warning: UNVERIFIED" in res.stderr
    assert "> **Warning:** UNVERIFIED" in summary.read_text()
    assert 'name="detllm.status" value="UNVERIFIED"' in (tmp_path / "j.xml").read_text()
    v = cli("verify", out)
    assert v.exit_code == 0 and "verdict re-derived from the trace: UNVERIFIED" in v.stdout, v.output
    # best-effort: the same check exits 0, with the warning
    res = cli("check", "--backend", "fake", "--prompt", "a", "--prompt", "b", "--vary-batch", "1,4", "--opt", "alone=true",
              "--out", tmp_path / "b", "--no-progress")
    assert res.exit_code == 0 and "warning: UNVERIFIED" in res.stderr, res.output
    outcome = detllm.check(backend="fake", prompts=["a", "b"], vary_batch=(1, 4), options={"alone": "true"}, mode="strict",
                           out=tmp_path / "api")
    assert (outcome.status, outcome.exit_code) == ("UNVERIFIED", 3)


def test_a_fail_needs_no_engagement(tmp_path):
    outcome = detllm.check(backend="fake", prompts=["a", "b"], vary_batch=(1, 4), mode="strict", out=tmp_path / "c",
                           options={"alone": "true", "diverge": "prompt=0,pos=1,batch=4"})
    assert (outcome.status, outcome.exit_code) == ("FAIL", 1)


def test_strict_refusal_before_running_is_still_exit_3(tmp_path, cli):
    res = cli("check", "--backend", "fake", "--tier", "3", "--vary-batch", "1,2", "--mode", "strict", "--out", tmp_path / "c")
    assert res.exit_code == 3 and not (tmp_path / "c").exists(), res.output


def test_max_rate_refused_before_anything_is_written(tmp_path, cli):
    res = cli("check", "--backend", "fake", "--prompt", "a", "--max-rate", "0.05", "--out", tmp_path / "c")
    assert res.exit_code == 2 and not (tmp_path / "c").exists(), res.output
    assert "--max-rate 0.05 needs 59 prompts" in res.stderr and len(res.stderr.strip().splitlines()) == 1


@pytest.mark.engine
def test_max_rate_fill_prompts_runs_59_prompts_on_tiny(tmp_path, cli):
    out = tmp_path / "c"
    res = cli("check", "--backend", "hf", "--model", "tiny", "--prompt", "The sky is", "--prompt", "One two three",
              "--prompt", "def f(x):", "--prompt", "Paris is", "--max-rate", "0.05", "--fill-prompts", "--runs", "2",
              "--max-new-tokens", "4", "--out", out, "--no-progress")
    assert res.exit_code == 0, res.output
    report = assert_valid_run(out)
    assert report["summary"]["prompts"] == 59
    b = report["bound"]
    assert b["fillers"]["yours"]["prompts"] == 4 and b["fillers"]["fillers"]["prompts"] == 55
    assert b["upper"] < 0.05 and b["max_rate"] == {"rate": 0.05, "met": True, "by": "your prompts plus seeded fillers (--fill-prompts)"}
    assert "0 of 4 of your prompts, 0 of 55 fillers diverged" in res.output
    config = json.loads((out / "run_config.json").read_text())["config"]
    assert config["user_prompts"] == 4 and config["fill_prompts"] is True


@pytest.mark.engine
def test_hf_batch_8_is_engaged_from_the_padded_batch_shape(tmp_path):
    outcome = detllm.check(backend="hf", model="tiny", prompts=[f"Count {i}:" for i in range(8)], vary_batch=(1, 8), runs=2,
                           max_new_tokens=4, out=tmp_path / "c")
    e = _comp(outcome.report, "batch 8 vs batch 1")["engagement"]
    assert e["answer"] == "engaged" and "at least 8 rows" in e["evidence"] and "padded batch shape" in e["evidence"], e
    at8 = [r for r in trace_records(tmp_path / "c") if r["batch_size"] == 8]
    assert {r["evidence"]["computed_with"]["rows"] for r in at8} == {8}


def test_fresh_process_repeats_record_their_pids(tmp_path):
    outcome = detllm.check(backend="fake", runs=2, fresh_process=1, out=tmp_path / "c")
    e = _comp(outcome.report, "run_1 (fresh process) vs run_0 @ batch 1")["engagement"]
    assert e["answer"] == "engaged" and e["axis"] == "fresh process", e
    recs = trace_records(tmp_path / "c")
    pids = {r["run_index"]: r["evidence"]["pid"] for r in recs}
    assert pids[0] != pids[1]


@pytest.fixture(scope="module")
def one_slot_server():
    """A real llama-server with ONE slot: it can never compute two requests together."""
    with tiny_llama_server(slots=1, ctx=2048) as srv:
        yield srv


@pytest.mark.engine
def test_one_slot_server_at_concurrency_8_is_unverified_strict_exit_3(one_slot_server, tmp_path, cli):
    out = tmp_path / "c"
    res = cli("check", "--backend", "openai", "--base-url", one_slot_server.url, "--model", "tiny", "--concurrency", "1,8",
              "--tier", "2", "--opt", "cache_prompt=false", "--mode", "strict", "--max-new-tokens", "16", "--runs", "2",
              "--out", out, "--no-progress")
    assert res.exit_code == 3, res.output
    report = assert_valid_run(out)
    assert report["status"] == "UNVERIFIED"
    e = _comp(report, "batch 8 vs batch 1")["engagement"]
    assert e["answer"] == "not_engaged" and e["axis"] == "concurrency", e
    assert "-np >= 8" in e["fix"]
    batch = next(r for r in trace_records(out) if r["batch_size"] == 8)["evidence"]["server_batch"]
    assert batch["server_slots"] == 1  # what /props reports: below the concurrency, so not sent again
    v = cli("verify", out)
    assert v.exit_code == 0 and "verdict re-derived from the trace: UNVERIFIED" in v.stdout, v.output



@pytest.mark.engine
def test_tier3_mode_without_its_kernels_running_is_not_engaged(tmp_path, monkeypatch):
    """The hf batch-invariant mode's live proof is the kernels' own call count per batch: with the
    count read as zero (as if the mode had been switched off after the capability was declared), the
    tier-3 batch comparison is shown not engaged and the check is UNVERIFIED, not PASS."""
    from detllm.backends.hf import invariant

    real = invariant.live_calls
    monkeypatch.setattr(invariant, "live_calls", lambda model: None if real(model) is None else (0, 0))
    outcome = detllm.check(backend="hf", model="tiny", prompts=["Hi", "def add(a, b):"], tier=3, mode="strict", runs=2,
                           vary_batch=(1, 2), max_new_tokens=3, options=(("batch_invariant", "true"),), out=tmp_path / "c")
    e = _comp(outcome.report, "batch 2 vs batch 1")["engagement"]
    assert (outcome.status, outcome.exit_code, e["axis"], e["answer"]) == ("UNVERIFIED", 3, "mode", "not_engaged"), e
