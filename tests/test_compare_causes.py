"""Every cause code from a committed fixture or a fake-backend scenario, with the
evidence asserted in report.json, and the ranking between causes."""

from __future__ import annotations

from pathlib import Path

import pytest

import detllm
from detllm.runfolder.artifacts import validate
from detllm.compare.causes import RANK, flat_diff, merge, rank

FIXTURES = Path(__file__).parent / "fixtures" / "diff"
BASE = FIXTURES / "base"


def codes(causes: list[dict]) -> list[str]:
    return [c["code"] for c in causes]


def diff(a, b, **kw) -> dict:
    report = detllm.diff(a, b, **kw).report
    validate(report, "report")
    return report


@pytest.fixture(scope="module")
def fake_runs(tmp_path_factory):
    """Fake runs differing in one recorded way each (tier 2, 6 tokens)."""
    root = tmp_path_factory.mktemp("causes")
    prompts = root / "other.txt"
    prompts.write_text("The capital of France is\nOnce upon a time\nsomething else entirely\n")

    def run(name: str, **kw):
        kw = {"backend": "fake", "tier": 2, "max_new_tokens": 6, **kw}
        detllm.run(out=root / name, **kw)
        return root / name

    return {
        "base": run("base"),
        "salted": run("salted", options={"salt": "other-weights"}),
        "shorter": run("shorter", max_new_tokens=4),
        "seed": run("seed", seed=7),
        "prompts": run("prompts", prompts=prompts),
        "check": detllm.check(backend="fake", tier=1, runs=2, vary_batch=(1, 4), max_new_tokens=6, out=root / "check",
                              options={"diverge": "prompt=1,pos=2,run=1;prompt=3,pos=1,batch=4"}).out_dir,
    }


def test_model_mismatch_names_the_weights(fake_runs):
    r = diff(fake_runs["base"], fake_runs["salted"])
    assert r["status"] == "FAIL" and r["category"] == "MODEL_MISMATCH"
    assert codes(r["causes"]) == ["MODEL_MISMATCH", "CONFIG_MISMATCH"], "the salt option is also a recorded difference"
    ev = r["causes"][0]["evidence"]
    assert ev["weights_sha256"]["left"] != ev["weights_sha256"]["right"]
    assert ev["files"][0]["file"] == "fake.weights" and ev["files_differing"] == 1
    assert r["causes"][1]["evidence"]["fields"] == [{"field": "backend_options.salt", "left": "", "right": "other-weights"}]


def test_config_mismatch_lists_the_settings(fake_runs):
    r = diff(fake_runs["base"], fake_runs["shorter"])
    assert (r["status"], r["category"]) == ("FAIL", "CONFIG_MISMATCH")
    assert r["first_divergence"]["kind"] == "length" and r["first_divergence"]["token_index"] == 4
    assert {"field": "config.decoding.max_new_tokens", "left": 6, "right": 4} in r["causes"][0]["evidence"]["fields"]


def test_a_difference_that_did_not_change_outputs_is_info_on_a_pass(fake_runs):
    r = diff(fake_runs["base"], fake_runs["seed"])  # greedy decoding ignores the seed
    assert (r["status"], r["category"], r["causes"]) == ("PASS", "PASS", [])
    assert codes(r["info"]) == ["CONFIG_MISMATCH"]
    fields = r["info"][0]["evidence"]["fields"] + r["info"][0]["evidence"]["applied"]
    assert {"field": "config.seed", "left": 0, "right": 7} in fields


def test_prompt_mismatch_lists_prompts_on_one_side_only(fake_runs):
    r = diff(fake_runs["base"], fake_runs["prompts"])
    assert (r["status"], r["category"]) == ("FAIL", "PROMPT_MISMATCH")
    ev = r["causes"][0]["evidence"]
    assert [p["prompt_text"] for p in ev["right_only"]] == ["something else entirely"]
    assert [p["prompt_index"] for p in ev["left_only"]] == [2, 3] and ev["left_only_count"] == 2
    assert ev["prompt_sets"]["left"]["source"] == "builtin"
    comp = r["comparisons"][0]
    assert comp["prompts_compared"] == 2 and comp["unmatched"] == {"left_only": [2, 3], "right_only": [2]}
    assert r["first_divergence"] is None, "the aligned prompts agree: nothing diverged, prompts are missing"


def test_run_variance_within_one_folder(fake_runs):
    r = diff(f"{fake_runs['check']}::run_0", f"{fake_runs['check']}::run_1")
    assert (r["category"], codes(r["causes"])) == ("RUN_VARIANCE", ["RUN_VARIANCE"])
    ev = r["causes"][0]["evidence"]
    assert ev["recorded_differences"].startswith("none") and ev["prompts_diverged"] == 1
    assert ev["first"] == {"prompt_index": 1, "token_index": 2, "kind": "token", "near_tie": False, "magnitude": "confident_flip"}
    assert r["info"] == []


def test_batch_variance_within_one_folder(fake_runs):
    r = diff(fake_runs["check"], f"{fake_runs['check']}::batch_4")
    assert (r["category"], codes(r["causes"])) == ("BATCH_VARIANCE", ["BATCH_VARIANCE"])
    ev = r["causes"][0]["evidence"]
    assert ev["batch_size"] == {"left": 1, "right": 4} and ev["batch_sizes"] == [1, 4] and ev["composition_changed"] == 4
    assert (r["first_divergence"]["prompt_index"], r["first_divergence"]["token_index"]) == (3, 1)


def test_run_variance_across_folders(tmp_path):
    r = diff(BASE, FIXTURES / "run_variance")
    assert codes(r["causes"]) == ["RUN_VARIANCE"] and r["info"] == []
    d = r["first_divergence"]
    assert (d["prompt_index"], d["token_index"], d["kind"]) == (1, 4, "token")


def test_env_mismatch_ignores_volatile_fields():
    r = diff(BASE, FIXTURES / "env_changed")
    assert codes(r["causes"]) == ["ENV_MISMATCH"]
    ev = r["causes"][0]["evidence"]
    fields = {d["field"] for d in ev["differences"]}
    assert fields == {"libraries.numpy", "cpu.usable_cores"}, "hostname, pid, captured_at and fingerprint are volatile"
    assert ev["count"] == 2 and ev["fingerprint"]["left"] != ev["fingerprint"]["right"]


def test_env_difference_with_equal_outputs_passes_with_info():
    r = diff(BASE, FIXTURES / "env_only")
    assert (r["status"], r["causes"], codes(r["info"])) == ("PASS", [], ["ENV_MISMATCH"])
    assert detllm.diff(BASE, FIXTURES / "env_only").exit_code == 0


def test_backend_mismatch_names_the_engine_version():
    r = diff(BASE, FIXTURES / "backend_changed")
    assert codes(r["causes"]) == ["BACKEND_MISMATCH"]
    ev = r["causes"][0]["evidence"]
    assert ev["backend"] == {"left": "fake", "right": "fake"}
    assert ev["engine"] == [{"field": "backend.version", "left": "1", "right": "2+fixture"}]


def test_tokenizer_mismatch_shows_the_differing_input_ids():
    r = diff(BASE, FIXTURES / "tokenizer_changed")
    assert codes(r["causes"]) == ["TOKENIZER_MISMATCH"]
    ev = r["causes"][0]["evidence"]
    assert ev["prompts_with_different_input_ids"] == 1 and ev["prompts_checked"] == 4
    ex = ev["examples"][0]
    assert ex["prompt_index"] == 2 and ex["first_difference"] == 3
    assert ex["right_input_ids"][3] == 7 and ex["left_input_ids"][3] != 7
    assert ev["tokenizer_sha256"]["right"] == "ab" * 32
    assert r["first_divergence"]["kind"] == "input_ids"


def test_cross_engine_diff_checks_input_ids_not_tokenizer_hashes():
    """Another engine hashes its tokenizer differently (GGUF metadata vs tokenizer files):
    equal input ids mean no TOKENIZER_MISMATCH; the engine outranks a format conversion."""
    r = diff(BASE, FIXTURES / "engine_llamacpp")
    assert codes(r["causes"]) == ["BACKEND_MISMATCH", "MODEL_MISMATCH"]
    assert r["causes"][0]["evidence"]["backend"] == {"left": "fake", "right": "llamacpp"}
    model = r["causes"][1]["evidence"]
    assert model["converted"] is True and model["format"] == {"left": "fake", "right": "gguf"}


def test_check_and_diff_share_the_cause_engine(fake_runs):
    """check's verdict comes from compare/causes/ too: the same codes and evidence keys."""
    rep = detllm.check(backend="fake", runs=2, vary_batch=(1, 4), max_new_tokens=6, out=fake_runs["base"].parent / "check2",
                       options={"diverge": "prompt=1,pos=2,run=1;prompt=3,pos=1,batch=4"}).report
    assert codes(rep["causes"]) == ["RUN_VARIANCE", "BATCH_VARIANCE"]
    run_ev = rep["causes"][0]["evidence"]
    assert run_ev["comparisons"] == ["run_1 vs run_0 @ batch 1"] and run_ev["first"]["token_index"] == 2
    assert rep["causes"][1]["evidence"]["batch_sizes"] == [1, 4]


def test_ranking_order_and_conversion_demotion():
    def cause(code, **ev):
        return {"code": code, "evidence": ev}

    shuffled = [cause(c) for c in reversed(RANK)]
    assert codes(rank(shuffled)) == list(RANK)
    converted = rank([cause("BACKEND_MISMATCH"), cause("MODEL_MISMATCH", converted=True), cause("ENV_MISMATCH")])
    assert codes(converted) == ["BACKEND_MISMATCH", "MODEL_MISMATCH", "ENV_MISMATCH"]
    merged = merge([cause("RUN_VARIANCE", comparisons=["a"], prompts_diverged=1),
                    cause("RUN_VARIANCE", comparisons=["b"], prompts_diverged=2)])
    assert merged == [cause("RUN_VARIANCE", comparisons=["a", "b"], prompts_diverged=3)]


def test_flat_diff_paths_and_absent_fields():
    got = flat_diff({"a": {"b": 1, "c": [1, 2]}, "x": True}, {"a": {"b": 2, "c": [1, 2]}, "x": 1, "y": None})
    assert got == [{"field": "a.b", "left": 1, "right": 2}, {"field": "x", "left": True, "right": 1},
                   {"field": "y", "left": "<absent>", "right": None}]
