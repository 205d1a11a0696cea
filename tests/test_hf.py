"""Integration: the built-in tiny model through real transformers."""

from __future__ import annotations

import json

import pytest

import detllm
from detllm.core.hashing import sha256_file
from detllm.models import builtin_path

from .conftest import assert_valid_run

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def tiny_check(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "check"
    outcome = detllm.check(backend="hf", model="tiny", runs=2, vary_batch=(1, 2, 8), tier=2, max_new_tokens=8, out=out)
    return outcome


def test_check_passes_at_tier_2_with_every_artifact_valid(tiny_check):
    report = assert_valid_run(tiny_check.out_dir)
    assert tiny_check.exit_code == 0 and report["status"] == "PASS"
    assert report["tier"] == {"requested": 2, "effective": 2}
    batch = [c for c in report["comparisons"] if c["kind"] == "batch" and c["required"]]
    assert [c["name"] for c in batch] == ["batch 2 vs batch 1", "batch 8 vs batch 1"]


def test_batches_are_real_and_padding_never_traced(tiny_check):
    recs = [json.loads(l) for l in (tiny_check.out_dir / "trace.jsonl").read_text().splitlines()]
    at8 = [r for r in recs if r["batch_size"] == 8]
    assert sorted(r["batch_position"] for r in at8) == [0, 1, 2, 3]  # 4 prompts + 4 fillers, fillers not traced
    for r in recs:
        assert len(r["token_ids"]) == len(r["logprobs"]) == len(r["top_logprobs"]) == len(r["token_texts"]) <= 8
        assert all(len(step) == 5 for step in r["top_logprobs"])
        assert r["logprobs"][0] <= r["top_logprobs"][0][0][1]
    # batch size really changes the computation on this CPU: logprobs move, tokens do not
    drift = [c["drift"]["max_abs_logprob_diff"] for c in json.loads((tiny_check.out_dir / "report.json").read_text())["comparisons"] if c["kind"] == "batch"]
    assert max(drift) > 0


def test_run_config_hashes_the_real_files(tiny_check):
    cfg = json.loads((tiny_check.out_dir / "run_config.json").read_text())
    folder = builtin_path("tiny")
    weights = {w["file"]: w["sha256"] for w in cfg["model"]["weights"]}
    assert weights == {"model.safetensors": sha256_file(folder / "model.safetensors")}
    assert cfg["model"]["path"] == str(folder)
    applied = json.loads((tiny_check.out_dir / "determinism_applied.json").read_text())
    by_name = {s["name"]: s for s in applied["settings"]}
    assert by_name["torch.use_deterministic_algorithms"]["applied"] is True
    assert by_name["CUBLAS_WORKSPACE_CONFIG"]["applied"] is False  # CPU: recorded as not applied, not dropped
    env = json.loads((tiny_check.out_dir / "env.json").read_text())
    assert env["torch"]["version"].startswith("2.") and env["backend"]["name"] == "hf"
    assert env["torch"]["deterministic_algorithms"] is True  # captured while the run's settings were in effect


def test_api_leaks_no_global_state(tmp_path):
    import torch

    before = (torch.are_deterministic_algorithms_enabled(), torch.get_num_threads(), torch.get_rng_state())
    detllm.run(backend="hf", model="tiny", threads=1, max_new_tokens=2, out=tmp_path / "r")
    after = (torch.are_deterministic_algorithms_enabled(), torch.get_num_threads(), torch.get_rng_state())
    assert before[:2] == after[:2] and torch.equal(before[2], after[2])


def test_greedy_loop_matches_transformers_generate():
    import torch

    from detllm.backends.base import Request
    from detllm.backends.hf import HFBackend
    from detllm.core.config import Decoding

    b = HFBackend("tiny")
    texts = ["The capital of France is", "def add(a, b):", "Once"]
    reqs = [Request(i, tuple(b.tokenize(t)), t) for i, t in enumerate(texts)]
    got = b.generate(reqs, Decoding(max_new_tokens=10), seed=0, n_logprobs=3, logprobs=True)
    for req, gen in zip(reqs, got):
        ref = b.model.generate(torch.tensor([req.input_ids]), attention_mask=torch.ones(1, len(req.input_ids), dtype=torch.long),
                               max_new_tokens=10, do_sample=False)[0, len(req.input_ids):].tolist()
        assert gen.token_ids == ref[: len(gen.token_ids)]


def test_sampling_does_not_depend_on_batch_order():
    from detllm.backends.base import Request
    from detllm.backends.hf import HFBackend
    from detllm.core.config import Decoding

    b = HFBackend("tiny")
    reqs = [Request(i, tuple(b.tokenize(t)), t) for i, t in enumerate(["Once upon a time", "The quick brown", "42"])]
    d = Decoding(max_new_tokens=8, temperature=1.0, top_p=0.95, top_k=50)
    fwd = b.generate(reqs, d, seed=3, n_logprobs=2, logprobs=False)
    rev = b.generate(reqs[::-1], d, seed=3, n_logprobs=2, logprobs=False)[::-1]
    other = b.generate(reqs, d, seed=4, n_logprobs=2, logprobs=False)
    assert [g.token_ids for g in fwd] == [g.token_ids for g in rev], "same seed, same tokens, any batch order"
    assert [g.token_ids for g in fwd] != [g.token_ids for g in other]


def test_model_is_loaded_once_per_process(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from detllm.backends import hf

    hf.HFBackend("tiny")  # make sure it is cached
    calls = []
    real = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: calls.append(a) or real(*a, **k))
    detllm.run(backend="hf", model="tiny", max_new_tokens=1, out=tmp_path / "a")
    detllm.check(backend="hf", model="tiny", max_new_tokens=1, runs=2, out=tmp_path / "b")
    assert calls == []


def test_secrets_in_environment_are_redacted(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_SuperSecretValue1234567890")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    detllm.run(backend="hf", model="tiny", max_new_tokens=1, out=tmp_path / "r")
    env = json.loads((tmp_path / "r" / "env.json").read_text())
    assert env["env_vars"]["HF_TOKEN"] == "<redacted>" and env["env_vars"]["OMP_NUM_THREADS"] == "2"
    for f in (tmp_path / "r").rglob("*"):
        if f.is_file():
            assert b"SuperSecretValue" not in f.read_bytes(), f


def test_weights_edited_in_place_are_reloaded(tmp_path):
    """Same path, one weight changed: the second run must use the new weights (not a cached model)."""
    from safetensors.torch import load_file, save_file

    from detllm.models import export_model

    folder = export_model("tiny", tmp_path / "tiny")
    a = detllm.run(backend="hf", model=str(folder), tier=2, max_new_tokens=4, out=tmp_path / "a")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"][0] += 0.5
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    b = detllm.run(backend="hf", model=str(folder), tier=2, max_new_tokens=4, out=tmp_path / "b")
    cfg = [json.loads((o.out_dir / "run_config.json").read_text())["model"]["weights_sha256"] for o in (a, b)]
    lps = [json.loads((o.out_dir / "trace.jsonl").read_text().splitlines()[0])["logprobs"] for o in (a, b)]
    assert cfg[0] != cfg[1]
    assert lps[0] != lps[1], "the edited weights were not loaded"


def test_config_edited_in_place_is_a_model_mismatch_and_replay_refuses(tmp_path, cli):
    """Same weights, same path, config.json changed (rope_theta): MODEL_MISMATCH naming the config, replay exit 7."""
    from detllm.models import export_model

    folder = export_model("tiny", tmp_path / "tiny")
    a = detllm.run(backend="hf", model=str(folder), tier=2, max_new_tokens=4, out=tmp_path / "a")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters" if "rope_parameters" in cfg else "rope_theta"] = (
        {**cfg["rope_parameters"], "rope_theta": 77.0} if "rope_parameters" in cfg else 77.0)
    (folder / "config.json").write_text(json.dumps(cfg))
    b = detllm.run(backend="hf", model=str(folder), tier=2, max_new_tokens=4, out=tmp_path / "b")
    d = detllm.diff(a.out_dir, b.out_dir)
    assert d.report["category"] == "MODEL_MISMATCH", d.report["causes"]
    ev = d.report["causes"][0]["evidence"]
    assert ev["weights_sha256"]["left"] == ev["weights_sha256"]["right"] and ev["config_sha256"]["left"] != ev["config_sha256"]["right"]
    r = cli("replay", a.out_dir, "--out", tmp_path / "r")
    assert r.exit_code == 7 and "different config.json" in r.stderr
    assert not (tmp_path / "r").exists()
