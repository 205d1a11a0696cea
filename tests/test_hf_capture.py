"""Integration: HFBackend.capture on the built-in tiny model through real transformers: the re-run
reproduces generate() bit for bit, batch 1 and batch 8 captures of one prompt align row-wise, decode
steps see the cached K/V, and the test-only --opt perturb is named by the capture and recorded."""

from __future__ import annotations

import json

import numpy as np
import pytest

import detllm
from detllm.backends.base import CaptureSpec, Request
from detllm.core.config import Decoding
from detllm.core.errors import UsageError
from detllm.core.prompts import FILLERS

pytestmark = pytest.mark.engine

TEXTS = ["The capital of France is", "def add(a, b):", "Once upon a time there was a", "x"]
DEC = Decoding(max_new_tokens=4)


@pytest.fixture(scope="module")
def hf():
    from detllm.backends.hf import HFBackend

    return HFBackend("tiny")


def _batch(backend, n):
    texts = (TEXTS + list(FILLERS))[:n]
    return [Request(i if i < len(TEXTS) else -1 - i, tuple(backend.tokenize(t)), t) for i, t in enumerate(texts)]


def _capture(backend, reqs, **spec):
    return backend.capture(reqs, DEC, seed=0, n_logprobs=3, spec=CaptureSpec(**spec))


@pytest.fixture(scope="module")
def step2(hf):
    """batch 8 and batch 1 captures of prompt 0 at decode step 2, every aten op too."""
    return (_capture(hf, _batch(hf, 8), step=2, row=0, level="ops"),
            _capture(hf, _batch(hf, 1), step=2, row=0, level="ops"))


def test_capabilities_declare_ops(hf):
    assert hf.capabilities().capture == "ops"


def test_the_re_run_reproduces_generate_bit_for_bit_up_to_the_step(hf, step2):
    reqs = _batch(hf, 8)
    gens = hf.generate(reqs, DEC, seed=0, n_logprobs=3, logprobs=True)
    cap = step2[0]
    for g, c in zip(gens, cap.generations):
        assert c.token_ids == g.token_ids[:3] and c.logprobs == g.logprobs[:3] and c.top_logprobs == g.top_logprobs[:3]
    assert cap.engine["padding_side"] == "left" and cap.engine["dtype"] == "float32" and cap.engine["perturb"] is None


def test_a_sampled_batch_is_re_run_with_the_same_draws(hf):
    sampled = Decoding(max_new_tokens=4, temperature=1.5, top_p=0.9)
    reqs = _batch(hf, 4)
    gens = hf.generate(reqs, sampled, seed=7, n_logprobs=3, logprobs=True)
    cap = hf.capture(reqs, sampled, seed=7, n_logprobs=3, spec=CaptureSpec(step=3, row=1, level="layers"))
    assert [c.token_ids for c in cap.generations] == [g.token_ids for g in gens]
    assert [c.logprobs for c in cap.generations] == [g.logprobs for g in gens]


def test_capturing_every_op_changes_no_bit_with_sdpa_attention():
    """Under a TorchDispatchMode the lm_head GEMM of a strided input moved by 1e-5 on CPU: ops are
    taken at the torch function level, and the re-run must still match generate() exactly."""
    from detllm.backends.hf import HFBackend, HFOptions

    sdpa = HFBackend("tiny", options=HFOptions(attn_implementation="sdpa"))
    reqs = _batch(sdpa, 4)
    gens = sdpa.generate(reqs, DEC, seed=0, n_logprobs=3, logprobs=True)
    cap = _capture(sdpa, reqs, step=1, row=3, level="ops")
    assert [c.logprobs for c in cap.generations] == [g.logprobs[:2] for g in gens]
    assert any(t.kind == "attention" and "/torch.scaled_dot_product_attention#" in t.name for t in cap.tensors)


def test_batch_1_and_batch_8_captures_align_row_wise(step2):
    c8, c1 = step2
    assert c8.level == c1.level == "ops"
    assert [t.name for t in c8.tensors] == [t.name for t in c1.tensors]
    assert "model.layers.0.mlp.down_proj/torch.linear#0" in {t.name for t in c8.tensors}
    for a, b in zip(c8.tensors, c1.tensors):
        assert a.output.shape == b.output.shape, a.name
        assert [x.shape for x in a.inputs] == [x.shape for x in b.inputs], a.name
        assert a.input_names == b.input_names and a.kind == b.kind
    by8, by1 = ({t.name: t for t in c.tensors} for c in step2)
    assert by8["model.layers.0.mlp.down_proj"].output_shape == (8, 1, 128)  # the whole batch as the engine saw it
    assert by1["model.layers.0.mlp.down_proj"].output_shape == (1, 1, 128)
    assert np.array_equal(by8["model.embed_tokens"].output, by1["model.embed_tokens"].output)  # a lookup: exact in any batch


def test_decode_attention_reads_the_rows_cached_kv_with_the_steps_that_wrote_it(hf, step2):
    c8, c1 = step2
    prompt = len(hf.tokenize(TEXTS[0]))
    for cap in step2:
        attn = next(t for t in cap.tensors if t.name == "model.layers.1.self_attn")
        keys = attn.inputs[attn.input_names.index("past_keys")]
        assert keys.shape == (2, prompt + 1, 64)  # heads x (prompt + step 1's token) x head_dim: no padding
        assert attn.cached_from_step == 0 and attn.cached_steps == [0] * prompt + [1]
        mask = attn.inputs[attn.input_names.index("attention_mask")]
        assert mask.shape[-1] == prompt + 2  # the row's real keys, this step's included
    k8 = next(t for t in c8.tensors if t.name == "model.layers.0.self_attn")
    k1 = next(t for t in c1.tensors if t.name == "model.layers.0.self_attn")
    assert k8.input_shapes[k8.input_names.index("past_keys")][0] == 8  # the whole batch's cache as the engine held it
    assert np.array_equal(k8.inputs[k8.input_names.index("past_keys")][:, :, :0], k1.inputs[k1.input_names.index("past_keys")][:, :, :0])


def test_prefill_capture_is_cut_to_the_real_positions(hf):
    reqs = _batch(hf, 8)
    cap = _capture(hf, reqs, step=0, row=3, reference=False)  # "x": one token, the most padded row
    down = next(t for t in cap.tensors if t.name == "model.layers.1.mlp.down_proj")
    width = max(len(r.input_ids) for r in reqs)
    assert down.output_shape == (8, width, 128) and down.output.shape == (1, 128)
    assert all(t.ref_error is None for t in cap.tensors)
    assert "ops (torch functions) not captured (level 'ops' asks for them)" in cap.notes


def test_layers_level_keeps_the_boundaries(hf):
    cap = _capture(hf, _batch(hf, 2), step=1, row=1, level="layers")
    assert cap.level == "layers"
    assert [t.name for t in cap.tensors] == ["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"]


@pytest.mark.parametrize("spec, says", [
    (dict(step=4, row=0), "past the 4 tokens"),
    (dict(step=0, row=1), "not in a batch of 1"),
    (dict(step=0, row=0, level="everything"), "level 'everything' is unknown"),
])
def test_a_capture_the_batch_cannot_honour_is_a_usage_error(hf, spec, says):
    with pytest.raises(UsageError, match=says):
        _capture(hf, _batch(hf, 1), **spec)


def test_with_batch_invariant_ops_no_module_differs_between_batch_1_and_8():
    from detllm.backends.hf import HFBackend, HFOptions

    inv = HFBackend("tiny", options=HFOptions(batch_invariant=True))
    with inv.determinism(tier=3, seed=0, threads=None):
        for step in (0, 2):
            c8 = _capture(inv, _batch(inv, 8), step=step, row=0, reference=False)
            c1 = _capture(inv, _batch(inv, 1), step=step, row=0, reference=False)
            assert [t.name for t in c8.tensors] == [t.name for t in c1.tensors]
            assert {t.kind for t in c8.tensors if t.name.endswith("down_proj")} == {"gemm"}  # BlockLinear stands in
            assert all(np.array_equal(a.output, b.output) for a, b in zip(c8.tensors, c1.tensors))
    assert c8.engine["batch_invariant"] is True


@pytest.fixture(scope="module")
def base_capture(hf):
    return _capture(hf, _batch(hf, 4), step=1, row=2)


@pytest.mark.parametrize("perturb", ["model.layers.1.mlp.down_proj:output:1e-3", "model.layers.0.self_attn.o_proj:output:1e-3",
                                     "model.layers.0.mlp.gate_proj:weight:1e-2", "lm_head:weight:1e-3"])
def test_a_perturbed_backend_is_located_by_its_capture(hf, base_capture, perturb):
    from detllm.backends.hf import HFBackend, HFOptions

    moved = HFBackend("tiny", options=HFOptions(perturb=perturb))
    cap = _capture(moved, _batch(moved, 4), step=1, row=2)
    base_lp = [g.logprobs for g in base_capture.generations]
    assert [g.logprobs for g in cap.generations] != base_lp  # the perturbation reaches the logits
    first = next(a for a, b in zip(cap.tensors, base_capture.tensors) if not np.array_equal(a.output, b.output))
    assert first.name == perturb.split(":")[0] and cap.engine["perturb"] == perturb
    again = hf.generate(_batch(hf, 4), Decoding(max_new_tokens=2), seed=0, n_logprobs=3, logprobs=True)
    assert [g.logprobs for g in again] == base_lp  # the shared model is unperturbed again


def test_a_perturbation_at_a_step_leaves_the_steps_before_it_alone(hf):
    from detllm.backends.hf import HFBackend, HFOptions

    reqs = _batch(hf, 2)
    base = hf.generate(reqs, DEC, seed=0, n_logprobs=3, logprobs=True)
    moved = HFBackend("tiny", options=HFOptions(perturb="model.norm:output:1e-3@2")).generate(
        reqs, DEC, seed=0, n_logprobs=3, logprobs=True)
    for b, m in zip(base, moved):
        assert m.logprobs[:2] == b.logprobs[:2] and m.logprobs[2] != b.logprobs[2]


def test_perturb_option_is_recorded_and_an_unknown_module_refused_before_writing(tmp_path):
    out = tmp_path / "r"
    detllm.run(backend="hf", model="tiny", max_new_tokens=2, options={"perturb": "model.norm:output:1e-3"}, out=out)
    cfg = json.loads((out / "run_config.json").read_text())
    assert cfg["config"]["options"] == {"perturb": "model.norm:output:1e-3"}
    assert cfg["backend_options"]["perturb"] == "model.norm:output:1e-3"
    applied = {s["name"]: s for s in json.loads((out / "determinism_applied.json").read_text())["settings"]}
    assert applied["perturb"]["value"] == "model.norm:output:0.001" and "TEST-ONLY" in applied["perturb"]["note"]
    bad = tmp_path / "bad"
    with pytest.raises(UsageError) as err:
        detllm.run(backend="hf", model="tiny", max_new_tokens=2, options={"perturb": "model.layers.1.mlp.dwn_proj:output:1e-3"},
                   out=bad)
    assert "did you mean 'model.layers.1.mlp.down_proj'" in err.value.one_line() and not bad.exists()


def test_the_prime_before_a_timed_capture_changes_no_bit(hf):
    """A timed capture (locate's first on a side) first sends one token through a model not yet primed,
    untimed (hf/capture._primed: a process's first forward pays a one-time set-up). Every generation and
    every captured tensor is that of a capture on a backend that was never primed."""
    from detllm.backends.hf import HFBackend

    fresh = HFBackend("tiny")
    fresh._primed = True  # never primed
    reqs = _batch(hf, 8)
    hf._primed = False
    primed = _capture(hf, reqs, step=1, row=0, level="modules", time_bare=True)
    assert hf._primed is True
    plain = _capture(fresh, reqs, step=1, row=0, level="modules", time_bare=True)
    assert [g.token_ids for g in primed.generations] == [g.token_ids for g in plain.generations]
    assert [g.logprobs for g in primed.generations] == [g.logprobs for g in plain.generations]
    assert [t.name for t in primed.tensors] == [t.name for t in plain.tensors]
    for a, b in zip(primed.tensors, plain.tensors):
        assert a.output.tobytes() == b.output.tobytes(), a.name
        assert [x.tobytes() for x in a.inputs] == [x.tobytes() for x in b.inputs], a.name
    assert "bare" in primed.seconds and "bare" in plain.seconds
