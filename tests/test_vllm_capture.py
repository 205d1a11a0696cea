"""The vllm backend's capture (`detllm locate`) and its TEST-ONLY perturbation, on the real engine.

One vLLM engine for the module (the same key as tests/test_vllm.py's, so one per session): every
perturbation case runs on it through hooks installed with apply_model, and the test checks that
no case restarted it and that the clean engine is back bit for bit after each.
"""

from __future__ import annotations

import numpy as np
import pytest

from detllm.backends.base import CaptureSpec, Request
from detllm.backends.vllm import VLLMBackend, VLLMOptions
from detllm.core.config import Decoding
from detllm.core.errors import UsageError

from .test_vllm import need_vllm

PROMPTS = ("The capital of France is", "Once upon a time", "def add(a, b):")
GREEDY = Decoding(max_new_tokens=6)
ROW = 1  # the prompt under test: the middle of a batch of three
PER_LAYER = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn/attention",
             "self_attn.o_proj", "self_attn", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp/silu_and_mul",
             "mlp.down_proj", "mlp")
HF_NAMES = ["model.embed_tokens", *(n for i in range(2) for n in (*(f"model.layers.{i}.{m}" for m in PER_LAYER), f"model.layers.{i}")),
            "model.norm", "lm_head"]  # in execution order; "parent/op": a vLLM-only op
PERTURBATIONS = [  # (spec, step captured): each must first differ at its module
    ("model.embed_tokens:output:1e-3", 0),
    ("model.layers.0.input_layernorm:output:1e-3", 0),
    ("model.layers.0.self_attn.q_proj:output:1e-3", 0),
    ("model.layers.0.self_attn.k_proj:weight:1e-2", 0),
    ("model.layers.0.self_attn.v_proj:output:1e-3", 0),
    ("model.layers.0.self_attn.o_proj:weight:1e-2", 0),
    ("model.layers.0.mlp.gate_proj:output:1e-3@2", 2),
    ("model.layers.0:output:1e-3", 0),
    ("model.layers.1.post_attention_layernorm:weight:1e-1", 0),
    ("model.layers.1.mlp.up_proj:weight:1e-2", 0),
    ("model.layers.1.mlp.down_proj:output:1e-3@1", 1),
    ("model.layers.1.self_attn:output:1e-3", 0),
    ("model.norm:output:1e-3", 0),
    ("lm_head:weight:1e-1", 0),
]


@pytest.fixture(scope="module")
def backend():
    need_vllm()
    b = VLLMBackend("tiny", device="auto")
    b.engine()  # the module's one engine start (reused from tests/test_vllm.py's when it ran first)
    yield b
    b.close()


@pytest.fixture(scope="module")
def batch(backend):
    return [Request(i, tuple(backend.tokenize(t)), t) for i, t in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def clean(backend, batch):
    """The clean engine's generations and its captures at steps 0-2 (the baseline of every case)."""
    gens = backend.generate(batch, GREEDY, seed=0, n_logprobs=5, logprobs=True)
    caps = {s: backend.capture(batch, GREEDY, seed=0, n_logprobs=5, spec=CaptureSpec(step=s, row=ROW)) for s in (0, 1, 2)}
    return gens, caps


def first_difference(a, b) -> str | None:
    """The first tensor (a's execution order) whose output is not bitwise equal in b."""
    other = {t.name: t for t in b.tensors}
    for t in sorted(a.tensors, key=lambda t: t.order):
        if t.output.tobytes() != other[t.name].output.tobytes():
            return t.name
    return None


def hf_name(spec: str) -> str:
    return spec.rsplit(":", 2)[0]


# ------------------------------------------------------------------ capture


@pytest.mark.engine
def test_capture_is_in_hf_naming_with_the_row_shapes(backend, batch, clean):
    gens, caps = clean
    assert backend.capabilities().capture == "modules"
    prompt_len = len(batch[ROW].input_ids)
    for step, cap in caps.items():
        names = [t.name for t in sorted(cap.tensors, key=lambda t: t.order)]
        assert names == HF_NAMES
        assert [t.order for t in cap.tensors] == list(range(len(names)))
        rows = prompt_len if step == 0 else 1  # the prefill holds the prompt, a decode step one token
        total = sum(len(r.input_ids) for r in batch) if step == 0 else len(batch)
        by = {t.name: t for t in cap.tensors}
        assert by["model.layers.0.self_attn.q_proj"].output.shape == (rows, 128)
        assert by["model.layers.0.self_attn.q_proj"].output_shape == (total, 128), "the flattened batch as vLLM ran it"
        assert by["model.layers.1.mlp.gate_proj"].output.shape == (rows, 256)
        assert by["model.layers.1"].output.shape == (rows, 128) and by["model.layers.1"].kind == "layer"
        assert by["lm_head"].output.shape == (1, 512) and by["lm_head"].positions == [prompt_len + step - 1]
        assert by["model.layers.0.self_attn.o_proj"].ref_error is not None, "linears re-evaluated in float64"
        # the re-run reproduces the recorded batch, and the captured logits are the ones it sampled from
        for g, full in zip(cap.generations, gens):
            assert g.token_ids == full.token_ids[:step + 1] and g.logprobs == full.logprobs[:step + 1]
        logits = by["lm_head"].output[0].astype(np.float64)
        logp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        assert abs(logp[gens[ROW].token_ids[step]] - gens[ROW].logprobs[step]) < 1e-5
        assert cap.engine["dtype"] == "float32" and cap.engine["prefix_caching"] is False
        assert cap.engine["schedule"][-1]["requests"] == 3 and cap.engine["captured_forward_tokens"] == total
        assert any("silu_and_mul" in n for n in cap.notes) and any("hidden + residual" in n for n in cap.notes)


@pytest.mark.engine
def test_attention_reads_the_keys_and_values_earlier_steps_wrote(batch, clean):
    """At a decode step the attention op's inputs include the cached K/V: what the prompt's rows
    wrote at steps 0..s-1 of the re-run, each position tagged with the step that wrote it."""
    caps = clean[1]
    n = len(batch[ROW].input_ids)
    at = {s: {t.name: t for t in caps[s].tensors}["model.layers.1.self_attn/attention"] for s in (0, 1, 2)}
    assert at[0].input_names == ["query", "key", "value"] and at[0].cached_from_step is None
    assert at[2].input_names == ["query", "key", "value", "past_keys", "past_values"]
    assert at[2].cached_steps == [0] * n + [1] and at[2].cached_from_step == 0
    past_k, past_v = at[2].inputs[3:]
    assert past_k.shape == past_v.shape == (n + 1, 128)
    assert past_k[:n].tobytes() == at[0].inputs[1].tobytes() and past_v[n:].tobytes() == at[1].inputs[2].tobytes()
    block = {t.name: t for t in caps[2].tensors}["model.layers.1.self_attn"]  # HF's attention module: transformers' cache layout
    assert block.input_names == ["hidden_states", "past_keys", "past_values"] and block.cached_steps == [0] * n + [1]
    assert block.inputs[1].shape == (2, n + 1, 64), "[kv_heads, positions, head_dim]"
    assert block.inputs[1].transpose(1, 0, 2).reshape(n + 1, 128).tobytes() == past_k.tobytes()


@pytest.mark.engine
def test_layers_only_and_past_the_memory_bound_layer_boundaries_only(backend, batch, clean):
    boundaries = ["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"]
    full = {t.name: t for t in clean[1][0].tensors}
    for spec in (CaptureSpec(step=0, row=ROW, level="layers"), CaptureSpec(step=0, row=ROW, max_bytes=16 * 1024)):
        cap = backend.capture(batch, GREEDY, seed=0, n_logprobs=5, spec=spec)
        assert cap.level == "layers" and [t.name for t in cap.tensors] == boundaries
        assert [t.order for t in cap.tensors] == [0, 1, 2, 3]
        assert all(t.output.tobytes() == full[t.name].output.tobytes() for t in cap.tensors), "hooks change nothing"
    assert any("bound of 16384 bytes" in n for n in cap.notes)


@pytest.mark.engine
def test_residual_stream_and_split_projections_match_transformers(backend, batch, clean):
    """vLLM's hidden + residual at each layer boundary is HF's decoder-layer output; the slices of
    qkv_proj and gate_up_proj are HF's q/k/v and gate/up, same shapes, float32-close."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(backend.resolved.path, dtype=torch.float32).eval()
    names = ["model.layers.0", "model.layers.1", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
             "model.layers.1.self_attn.v_proj", "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj", "model.norm"]
    got: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(n).register_forward_hook(
        lambda m, a, o, n=n: got.__setitem__(n, (o[0] if isinstance(o, tuple) else o)[0].detach())) for n in names]
    with torch.inference_mode():
        model(torch.tensor([batch[ROW].input_ids]))
    for h in handles:
        h.remove()
    by = {t.name: t for t in clean[1][0].tensors}
    for n in names:
        ours, theirs = by[n].output, got[n].numpy()
        assert ours.shape == theirs.shape, n
        assert np.abs(ours - theirs).max() <= 1e-5 * max(1.0, np.abs(theirs).max()), n


# ------------------------------------------------------------------ perturbation


@pytest.mark.engine
@pytest.mark.parametrize("spec,step", PERTURBATIONS, ids=[p[0] for p in PERTURBATIONS])
def test_perturbation_first_differs_at_its_module_on_the_shared_engine(backend, batch, clean, spec, step):
    gens, caps = clean
    llm = backend.engine()
    hit = VLLMBackend("tiny", device="auto", options=VLLMOptions(perturb=spec))
    assert hit.engine() is llm, "a perturbation never restarts the engine"
    perturbed = hit.generate(batch, GREEDY, seed=0, n_logprobs=5, logprobs=True)
    assert perturbed[ROW].logprobs[step:] != gens[ROW].logprobs[step:], "the perturbed run differs at the logits"
    assert perturbed[ROW].logprobs[:step] == gens[ROW].logprobs[:step], "nothing moves before the perturbed step"
    cap = hit.capture(batch, GREEDY, seed=0, n_logprobs=5, spec=CaptureSpec(step=step, row=ROW))
    assert cap.engine["perturb"] is not None
    assert first_difference(caps[step], cap) == hf_name(spec)
    with hit.determinism(tier=2, seed=0, threads=None) as applied:
        assert [a.name for a in applied][0] == "perturb" and applied[0].requested == spec
    # the hooks (and a weight's GEMM handle) are gone: the clean engine is back, bit for bit
    assert backend.generate(batch, GREEDY, seed=0, n_logprobs=5, logprobs=True) == gens
    assert first_difference(caps[step], backend.capture(batch, GREEDY, seed=0, n_logprobs=5,
                                                        spec=CaptureSpec(step=step, row=ROW))) is None


def test_perturb_spec_is_checked_before_an_engine_starts():
    need_vllm()
    for bad, words in (("model.layers.0.mlp:input:1e-3", "'output' or 'weight'"), ("lm_head:output:2", "(0, 1]"),
                       ("model.norm:weight:1e-3@1", "@STEP")):
        with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            VLLMBackend("tiny", options=VLLMOptions(perturb=bad))


@pytest.mark.engine
def test_perturbing_what_vllm_fuses_or_lacks_is_a_usage_error(backend, batch, clean, cli, tmp_path):
    for spec, words in (("model.layers.0.mlp.act_fn:output:1e-3", "fuses act_fn"),
                        ("model.layers.0.self_attn.q_prj:output:1e-3", "did you mean 'model.layers.0.self_attn.q_proj'"),
                        ("model.layers.0.mlp/silu_and_mul:output:1e-3", "vLLM-only op"),
                        ("model.layers.0.self_attn.q_proj:weight:1e-30", "below the rounding")):
        b = VLLMBackend("tiny", device="auto", options=VLLMOptions(perturb=spec))
        with pytest.raises(UsageError) as err:
            b.generate(batch, GREEDY, seed=0, n_logprobs=5, logprobs=True)
        assert words in err.value.one_line(), err.value.one_line()
    res = cli("run", "--backend", "vllm", "--model", "tiny", "--prompt", "hi", "--max-new-tokens", "2",
              "--opt", "perturb=model.layers.0.mlp.act_fn:output:1e-3", "--out", tmp_path / "run")
    assert res.exit_code == 2 and "fuses act_fn" in res.output and not (tmp_path / "run").exists(), "refused before writing"
    assert backend.generate(batch, GREEDY, seed=0, n_logprobs=5, logprobs=True) == clean[0], "the refused probes left nothing"


@pytest.mark.engine
def test_capture_refuses_a_row_or_step_it_cannot_capture(backend, batch):
    with pytest.raises(UsageError, match="outside the batch"):
        backend.capture(batch, GREEDY, seed=0, n_logprobs=5, spec=CaptureSpec(step=0, row=3))
    filler = [*batch[:2], Request(-1, batch[2].input_ids)]
    with pytest.raises(UsageError, match="filler"):
        backend.capture(filler, GREEDY, seed=0, n_logprobs=5, spec=CaptureSpec(step=0, row=2))


def test_capture_needs_one_in_process_eager_worker():
    need_vllm()
    assert VLLMBackend("tiny", options=VLLMOptions(enforce_eager=False)).capabilities().capture == "none"


# ------------------------------------------------------------------ locate end to end


@pytest.fixture(scope="module")
def runs(backend, tmp_path_factory):
    """hf, vLLM and a perturbed vLLM run of the three prompts as one batch (tier 2, tiny float32)."""
    from typer.testing import CliRunner

    from detllm.cli import app

    root = tmp_path_factory.mktemp("vllm-locate")
    args = ["run", "--model", "tiny", "--tier", "2", "--max-new-tokens", "6", "--batch-size", "3",
            *(a for p in PROMPTS for a in ("--prompt", p))]
    for name, extra in (("hf", ["--backend", "hf"]), ("vllm", ["--backend", "vllm"]),
                        ("perturbed", ["--backend", "vllm", "--opt", "perturb=model.layers.1.mlp.down_proj:output:1e-3@2"])):
        res = CliRunner().invoke(app, [*args, *extra, "--out", str(root / name)])
        assert res.exit_code == 0, res.output
    return root


@pytest.mark.engine
def test_locate_names_a_perturbation_recorded_in_the_vllm_run(runs, cli):
    import json

    res = cli("locate", runs / "vllm", runs / "perturbed", "--out", runs / "loc-perturbed")
    assert res.exit_code == 0, res.output
    doc = json.loads((runs / "loc-perturbed" / "locate.json").read_text())
    assert doc["status"] == "located" and doc["left"]["reproduced"] and doc["right"]["reproduced"]
    op = doc["first_bitwise_op"]
    assert (op["module"], op["kind"], op["step"]) == ("model.layers.1.mlp.down_proj", "gemm", 2)
    assert doc["first_beyond_tolerance_op"]["module"] == "model.layers.1.mlp.down_proj"
    assert op["output_shape"] == {"left": [3, 128], "right": [3, 128]}, "vLLM's flattened decode step: one row per sequence"


@pytest.mark.engine
def test_locate_hf_against_vllm_aligns_every_module_by_hf_name(runs, cli):
    """hf vs vLLM on tiny float32: every layer boundary and module pairs up without a name map; the
    embedding agrees bitwise and the first output that differs is inside layer 0."""
    import json

    res = cli("locate", runs / "hf", runs / "vllm", "--out", runs / "loc-layers", "--layers-only")
    assert res.exit_code == 0, res.output
    doc = json.loads((runs / "loc-layers" / "locate.json").read_text())
    assert doc["left"]["reproduced"] and doc["right"]["reproduced"], doc["line"]
    rows = {r["module"]: r for r in doc["layers"]}
    assert list(rows) == ["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"]
    assert rows["model.embed_tokens"]["output_equal"] and all(r["shapes_match"] for r in rows.values())
    assert doc["first_differing"]["module"] == "model.layers.0"
    # one level down: every HF module pairs with vLLM's split, fused or deferred counterpart
    res = cli("locate", runs / "vllm", runs / "hf", "--out", runs / "loc-modules")
    assert res.exit_code == 0, res.output
    doc = json.loads((runs / "loc-modules" / "locate.json").read_text())
    assert doc["left"]["reproduced"] and doc["right"]["reproduced"], doc["line"]
    assert doc["captured"]["level"]["left"] == "modules" and doc["captured"]["tensors"] == 27
    assert sorted(doc["captured"]["only_left"]) == [f"model.layers.{i}.{op}" for i in range(2)
                                                    for op in ("mlp/silu_and_mul", "self_attn/attention")]
    assert {"model.layers.0.mlp.act_fn", "model.layers.1.mlp.act_fn"} <= set(doc["captured"]["only_right"])
    rows = doc["layers"]
    assert all(r["shapes_match"] for r in rows) and rows[0]["module"] == "model.embed_tokens" and rows[0]["output_equal"]
    assert doc["first_differing"]["module"].startswith("model.layers.0.")
    op = doc["first_bitwise_op"]  # inputs agree, output differs: layer 0 (or, compared finer, its attention block)
    assert doc["status"] == "located" and op["module"] in ("model.layers.0", "model.layers.0.self_attn"), doc["line"]
    assert op["output_shape"] == {"left": [19, 128], "right": [3, 7, 128]}, "vLLM's flattened batch, hf's padded one"
