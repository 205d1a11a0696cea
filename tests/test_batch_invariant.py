"""Proof of `hf --opt batch_invariant=true` (tier 3 on CPU) with real transformers.

Tier-3 checks across batch sizes 1-16 pass bitwise on both built-in models with the mode; the
same prompts recorded without it fail a tier-3 diff (the negative control); sampling and random
batch compositions never change a sequence; nothing of the mode outlives its run.
"""

from __future__ import annotations

import json
import random

import pytest

from detllm.core.prompts import FILLERS

from .conftest import assert_valid_run, trace_records

pytestmark = pytest.mark.engine

LONG = ("In the harbour town the lamps were lit one by one as the fishing boats came home, and the old "
        "keeper of the lighthouse counted them from his window, writing each name in a book that his "
        "grandmother had started sixty years before, when the harbour still had a ferry, a bakery, a school "
        "and a market every Thursday where farmers sold apples, cheese, wool and honey to the sailors.")
PROMPTS = ["Hi", "def add(a, b):", LONG, LONG[:150]]  # 1 to ~100 tokens; batches are topped up with the fillers
SIZES = "1,2,3,5,8,16"
MODELS = {"tiny": 10, "smollm2-135m": 4}  # model -> max_new_tokens (smollm2: 135M params on 2 cores)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bi") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


@pytest.mark.parametrize("model", list(MODELS))
def test_tier3_check_passes_bitwise_with_the_mode_and_the_control_fails_without(cli, tmp_path, prompt_file, model):
    n = str(MODELS[model])
    out = tmp_path / "check"
    res = cli("check", "--model", model, "--prompts", prompt_file, "--tier", "3", "--mode", "strict", "--runs", "2",
              "--vary-batch", SIZES, "--max-new-tokens", n, "--opt", "batch_invariant=true", "--out", out)
    assert res.exit_code == 0, res.output
    report = assert_valid_run(out)
    assert report["status"] == "PASS" and report["tier"] == {"requested": 3, "effective": 3}
    batch = [c for c in report["comparisons"] if c["kind"] == "batch"]
    assert len(batch) == 5 and all(c["required"] for c in batch)
    # the mode's live proof from the process that served the check: the invariant kernels' own call counts
    for c in batch:
        assert c["engagement"]["answer"] == "engaged" and "batch-invariant kernels ran for every record" in c["engagement"]["evidence"], c
    # bitwise, not within a tolerance: every record equals its batch-1 record exactly
    recs = trace_records(out)
    ref = {r["prompt_index"]: r for r in recs if r["batch_size"] == 1 and r["run_index"] == 0}
    for r in recs:
        base = ref[r["prompt_index"]]
        assert (r["token_ids"], r["logprobs"], r["top_logprobs"]) == (base["token_ids"], base["logprobs"], base["top_logprobs"])
    assert {r["batch_size"] for r in recs} == {1, 2, 3, 5, 8, 16}
    applied = json.loads((out / "determinism_applied.json").read_text())
    ops = {s["name"]: s for s in applied["settings"] if s["name"].startswith("batch_invariant.")}
    assert {"batch_invariant.linear", "batch_invariant.attention", "batch_invariant.rms_norm",
            "batch_invariant.log_softmax"} <= set(ops) and all(s["applied"] for s in ops.values())
    assert applied["capabilities"]["batch_invariant"] is True

    # negative control: the same prompts without the mode, then a tier-3 diff of batch 1 vs 16
    plain = tmp_path / "plain"
    res = cli("run", "--model", model, "--prompts", prompt_file, "--vary-batch", "1,16", "--max-new-tokens", n, "--out", plain)
    assert res.exit_code == 0, res.output
    res = cli("diff", f"{plain}::run_0@batch_1", f"{plain}::run_0@batch_16", "--tier", "3")
    assert res.exit_code == 1, res.output
    assert "FAIL" in res.output


def test_sampling_gives_the_same_tokens_at_every_batch_size(tmp_path, prompt_file):
    import detllm

    outcome = detllm.check(backend="hf", model="tiny", prompts=prompt_file, tier=3, mode="strict", runs=2,
                           vary_batch=(1, 3, 8), temperature=0.8, max_new_tokens=12, options=(("batch_invariant", "true"),),
                           out=tmp_path / "s")
    assert outcome.exit_code == 0 and outcome.status == "PASS"
    recs = trace_records(tmp_path / "s")
    by_prompt: dict[int, set] = {}
    for r in recs:
        by_prompt.setdefault(r["prompt_index"], set()).add(tuple(r["token_ids"]))
    assert all(len(v) == 1 for v in by_prompt.values())
    greedy = detllm.run(backend="hf", model="tiny", prompts=prompt_file, max_new_tokens=12, out=tmp_path / "g")
    sampled = {r["prompt_index"]: r["token_ids"] for r in recs}
    assert any(r["token_ids"] != sampled[r["prompt_index"]] for r in trace_records(greedy.out_dir))  # it really sampled


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_random_batch_compositions_never_change_one_prompts_logprobs(attn):
    from detllm.backends.base import Request
    from detllm.backends.hf import HFBackend, HFOptions
    from detllm.core.config import Decoding

    b = HFBackend("tiny", options=HFOptions(batch_invariant=True, attn_implementation=attn))
    rng = random.Random(14)
    target = Request(0, tuple(b.tokenize("The capital of France is")), "x")
    pool = [tuple(b.tokenize(t)) for t in (*FILLERS, LONG, "a", "b c")]
    decoding = Decoding(max_new_tokens=6)
    with b.determinism(tier=3, seed=0, threads=None):
        alone = b.generate([target], decoding, seed=0, n_logprobs=4, logprobs=True)[0]
        for trial in range(10):
            others = [Request(-1, rng.choice(pool)[: rng.randint(1, 60)]) for _ in range(rng.randint(1, 11))]
            pos = rng.randint(0, len(others))
            batch = others[:pos] + [target] + others[pos:]
            got = b.generate(batch, decoding, seed=0, n_logprobs=4, logprobs=True)[pos]
            assert (got.token_ids, got.logprobs, got.top_logprobs) == (alone.token_ids, alone.logprobs, alone.top_logprobs), \
                f"trial {trial}: batch of {len(batch)}, position {pos}"


def test_nothing_of_the_mode_outlives_its_run(tmp_path):
    import torch
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import detllm
    from detllm.backends.hf import invariant as hf_invariant
    from detllm.backends.hf import HFBackend

    model = HFBackend("tiny").model  # the process-wide cached model both modes share
    before = detllm.run(backend="hf", model="tiny", vary_batch=(1, 4), max_new_tokens=6, out=tmp_path / "a")
    modules = [(n, type(m)) for n, m in model.named_modules()]
    detllm.check(backend="hf", model="tiny", tier=3, mode="strict", runs=2, vary_batch=(1, 4), max_new_tokens=6,
                 options=(("batch_invariant", "true"),), out=tmp_path / "mode")
    assert [(n, type(m)) for n, m in model.named_modules()] == modules
    assert all(type(m) is torch.nn.Linear for n, m in model.named_modules() if n.endswith(("proj", "lm_head")))
    assert model.config._attn_implementation == "eager"
    assert hf_invariant.ATTENTION_NAME not in ALL_ATTENTION_FUNCTIONS
    assert hf_invariant.ATTENTION_NAME not in ALL_MASK_ATTENTION_FUNCTIONS
    assert not any(m._forward_pre_hooks for m in model.modules())
    assert not any("_detllm_invariant" in m.__dict__ for m in model.modules())
    after = detllm.run(backend="hf", model="tiny", vary_batch=(1, 4), max_new_tokens=6, out=tmp_path / "b")
    strip = lambda recs: [(r["batch_size"], r["token_ids"], r["logprobs"], r["top_logprobs"]) for r in recs]  # noqa: E731
    assert strip(trace_records(after.out_dir)) == strip(trace_records(before.out_dir))  # plain runs bit for bit as before
    drift = [r["logprobs"] for r in trace_records(after.out_dir) if r["prompt_index"] == 0]
    assert drift[0] != drift[1]  # and plain hf is still not batch invariant: the mode is really gone


def test_without_the_mode_strict_tier3_is_refused_naming_the_option(cli, tmp_path):
    res = cli("check", "--model", "tiny", "--tier", "3", "--mode", "strict", "--runs", "2", "--vary-batch", "1,2",
              "--out", tmp_path / "x")
    assert res.exit_code == 3
    assert "batch_invariant=true" in res.output and not (tmp_path / "x").exists()


def test_an_uncovered_op_refuses_tier3_and_names_it(cli, tmp_path):
    from detllm.backends.hf import invariant as hf_invariant
    from detllm.backends.hf import HFBackend

    model = HFBackend("tiny").model
    ops = hf_invariant.coverage(model, "flash_attention_2", "cpu")
    assert [op.name for op in hf_invariant.uncovered(ops)] == ["attention"]
    assert "flash_attention_2" in ops[0].how
    # an architecture the mode has not read: GPT-2 (Conv1D projections), refused before anything is written
    gpt2 = _tiny_gpt2(tmp_path / "gpt2")
    res = cli("check", "--model", gpt2, "--tier", "3", "--mode", "strict", "--runs", "2", "--vary-batch", "1,2",
              "--opt", "batch_invariant=true", "--out", tmp_path / "y")
    assert res.exit_code == 3, res.output
    assert "gpt2" in res.output and "architecture" in res.output and not (tmp_path / "y").exists()


def _tiny_gpt2(folder):
    import shutil

    from transformers import GPT2Config, GPT2LMHeadModel

    from detllm.models import builtin_path

    src = builtin_path("tiny")
    GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=64, n_embd=32, n_layer=1, n_head=2)).save_pretrained(folder)
    for f in src.iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy(f, folder / f.name)
    return folder
