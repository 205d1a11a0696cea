"""Per-record facts are causes (issue 20): a check of a real llama-server whose repeats the server
answered from its prompt cache. The trace records the cached prompt tokens per request; where
they differ between two compared runs, the verdict names CACHE_VARIANCE (never RUN_VARIANCE,
"nothing recorded differs"), its next step names the cache switch, and verify re-derives the same
from the sealed trace. Asserts on the recorded counts, never on which run happened to be warm:
llama-server picks the slot."""

from __future__ import annotations

import json

import pytest

import detllm
from detllm.compare.verdict import check_comparisons, check_report

from .conftest import trace_records

PROMPTS = ["The capital of France is a city that", "Once upon a time there was a small", "def add(a, b):\n    return",
           "Numbers: 1 2 3 4 5 6 7 8 9 10 11"]


@pytest.mark.engine
def test_a_warm_repeat_of_a_cold_run_is_cache_variance(llama_served, cli, tmp_path):
    out = tmp_path / "served"
    args = ["check", "--backend", "openai", "--base-url", llama_served.url, "--model", "tiny", "--runs", "3",
            "--tier", "2", "--max-new-tokens", "24", "--out", out, "--no-progress"]
    for p in PROMPTS:
        args += ["--prompt", p + f" {tmp_path.name}"]  # a text this server has not seen: run 0 is cold
    res = cli(*args)
    recs = trace_records(out)
    cached = {r: [x["evidence"]["cached_prompt_tokens"] for x in recs if x["run_index"] == r] for r in range(3)}
    report = json.loads((out / "report.json").read_text())
    by_name = {c["name"]: c for c in report["comparisons"]}
    differs = {f"run_{r} vs run_0 @ batch 1": cached[r] != cached[0] for r in (1, 2)}
    assert any(differs.values()), f"the server reused no cached prompt tokens: {cached}"
    codes = [c["code"] for c in report["causes"] + report["info"]]
    assert "CACHE_VARIANCE" in codes, (codes, cached)
    cause = next(c for c in report["causes"] + report["info"] if c["code"] == "CACHE_VARIANCE")
    # it explains exactly the comparisons whose records differ in cached tokens, failing or not
    assert sorted(cause["evidence"]["comparisons"]) == sorted(n for n, d in differs.items() if d and by_name[n]["status"] != "PASS")
    assert {k: v["cached_prompt_tokens"] for k, v in cause["evidence"]["sides"].items()} == {
        f"run_{r}@batch_1": sum(cached[r]) for r in (0, 1, 2) if r == 0 or differs[f"run_{r} vs run_0 @ batch 1"]}
    # RUN_VARIANCE only for a failing comparison whose records agree on every per-record fact
    for c in report["causes"]:
        if c["code"] == "RUN_VARIANCE":
            assert not any(differs[n] for n in c["evidence"]["comparisons"]), (c, cached)
    assert res.exit_code == 1, res.output  # warm and cold prompt processing differ in logprobs on this server
    assert report["category"] == "CACHE_VARIANCE" and "--opt cache_prompt=false" in res.output, res.output
    res = cli("verify", out)
    assert res.exit_code == 0 and "(CACHE_VARIANCE)" in res.output, res.output


def _verdict(records):
    comps = check_comparisons(records, base_batch=1, runs=2, batch_sizes=(1,), tier=2, atol=0.0, floor=1e-4, drift=False)
    return check_report(comps, tier_requested=2, tier_effective=2, summary={}, records=records)


@pytest.mark.parametrize("left, right, code", [
    ({"cached_prompt_tokens": 0}, {"cached_prompt_tokens": 7}, "CACHE_VARIANCE"),
    ({"server_batch": {"in_flight": 1, "source": "/slots", "samples": 3, "server_busy_max": 1}},
     {"server_batch": {"in_flight": 1, "source": "/slots", "samples": 3, "server_busy_max": 3}}, "BATCH_VARIANCE"),
    ({"cached_prompt_tokens": 0}, {}, "RUN_VARIANCE"),  # not reported on one side: unknown, not different
    # 0 vs 1 busy with our 1 request in flight: the sampler missed or caught our own request, no other batch
    ({"server_batch": {"in_flight": 1, "source": "/slots", "samples": 3, "server_busy_max": 0}},
     {"server_batch": {"in_flight": 1, "source": "/slots", "samples": 3, "server_busy_max": 1}}, "RUN_VARIANCE"),
    ({"server_batch": {"in_flight": 1, "source": "/slots", "samples": 0, "server_busy_max": None}},
     {"server_batch": {"in_flight": 1, "source": "/slots", "samples": 3, "server_busy_max": 3}}, "RUN_VARIANCE"),
])
def test_each_per_record_fact_is_a_recorded_difference(tmp_path, left, right, code):
    """The records of a real failing check (a flip in run 1), given what a server would have said about
    each run: a fact that differs is the cause; one a side did not report is no difference."""
    out = detllm.check(backend="fake", runs=2, tier=2, options={"diverge": "prompt=0,pos=1,run=1"}, out=tmp_path / "c").out_dir
    records = trace_records(out)
    for r in records:
        r["evidence"] = dict(left if r["run_index"] == 0 else right)
    report = _verdict(records)
    assert report["category"] == code and [c["code"] for c in report["causes"]] == [code], report["causes"]


@pytest.mark.parametrize("busy, recorded, accepted", [
    ((0, 1), "BATCH_VARIANCE", True),  # sealed under the earlier rule: accepted, and said so
    ((0, 1), "CACHE_VARIANCE", False),  # any other category is an edit
    ((1, 1), "BATCH_VARIANCE", False),  # no busy difference at all: the earlier rule gave RUN_VARIANCE too
])
def test_verify_accepts_a_category_sealed_under_the_earlier_busy_rule(tmp_path, busy, recorded, accepted):
    """detllm once called any difference in sampled busy counts a batch difference; a folder it sealed
    that way re-derives under today's rule to another category. verify says so instead of calling the
    verdict edited, only where the trace holds exactly that case."""
    from detllm.core.errors import IntegrityError
    from detllm.pipeline.rederive import rederive_verdict

    out = detllm.check(backend="fake", runs=2, tier=2, options={"diverge": "prompt=0,pos=1,run=1"}, out=tmp_path / "c").out_dir
    trace = out / "trace.jsonl"
    lines = []
    for line in trace.read_text().splitlines():
        r = json.loads(line)
        r["evidence"] = {"server_batch": {"in_flight": 1, "source": "/slots", "samples": 3,
                                          "server_busy_max": busy[r["run_index"]]}}
        lines.append(json.dumps(r))
    trace.write_text("\n".join(lines) + "\n")
    report = json.loads((out / "report.json").read_text())
    assert report["category"] == "RUN_VARIANCE"
    report["category"] = recorded
    (out / "report.json").write_text(json.dumps(report))
    if accepted:
        said = rederive_verdict(out)
        assert "earlier rule" in said and "today's rule gives RUN_VARIANCE" in said, said
    else:
        with pytest.raises(IntegrityError, match="category"):
            rederive_verdict(out)
