"""`detllm locate` end to end on real transformers (hf `tiny`, in-process, one model load): 21 test-only
perturbations (module outputs and weights, recorded in the run's config so locate's re-run applies them
on the perturbed side only), each first shown to move the logits, then named by locate; 20 identical
repeats captured at a step locate nothing; real batch variance (batch 1 vs 8) is located to an op with
its shapes, and with batch_invariant=true no op differs; model files changed since the run: exit 7."""

from __future__ import annotations

import json
import shutil

import pytest

import detllm
from detllm.locate import locate
from detllm.locate.sides import compared_tier, first_step, load, resolve

pytestmark = pytest.mark.engine

PROMPT = ["The capital of France is"]
CASES = [  # (module, what is perturbed); 1e-3 of the RMS, one element (detllm.core.perturb); lm_head's weight 1e-1 (below, no
    # logprob moves); a q_proj or k_proj output moved by one element (1e-3..1e-1) never reached the logits of tiny here
    ("model.embed_tokens", "output"), ("model.layers.0.input_layernorm", "output"),
    ("model.layers.0.self_attn.q_proj", "weight"), ("model.layers.0.self_attn.k_proj", "weight"),
    ("model.layers.0.self_attn.v_proj", "output"), ("model.layers.0.self_attn.o_proj", "output"),
    ("model.layers.0.mlp.act_fn", "output"), ("model.layers.1.post_attention_layernorm", "output"),
    ("model.layers.1.mlp.up_proj", "output"), ("model.norm", "output"), ("model.layers.1.self_attn", "output"),
    ("model.layers.0.mlp.gate_proj", "weight"), ("model.layers.0.mlp.down_proj", "weight"),
    ("model.layers.1.self_attn.q_proj", "weight"), ("model.layers.1.self_attn.v_proj", "weight"),
    ("model.layers.1.self_attn.o_proj", "weight"), ("model.layers.1.mlp.down_proj", "weight"), ("lm_head", "weight"),
    ("model.layers.0.post_attention_layernorm", "weight"), ("model.layers.1.input_layernorm", "weight"),
    ("model.layers.1.mlp.gate_proj", "output@1"),  # at the first decode step only
]


def _run(out, **options):
    return detllm.run(backend="hf", model="tiny", max_new_tokens=2, tier=2, prompts=PROMPT, out=out, options=options)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    out = tmp_path_factory.mktemp("locate_hf") / "clean"
    _run(out)
    return out


@pytest.mark.parametrize("module, what", CASES, ids=[f"{m}:{w}" for m, w in CASES])
def test_perturbation_is_named(clean, tmp_path, module, what):
    target, _, at = what.partition("@")
    spec = f"{module}:{target}:{'1e-1' if module == 'lm_head' else '1e-3'}" + (f"@{at}" if at else "")
    moved = tmp_path / "perturbed"
    _run(moved, perturb=spec)
    left, right = load(*resolve(str(clean), str(moved))[:2])
    differs = first_step(left, right, tier=compared_tier(left, right))
    assert differs is not None and differs.what in ("token", "logprob", "top_logprobs"), "the perturbation must move the logits"
    assert differs.step == int(at) if at else differs.step >= 0
    ops = CASES.index((module, what)) % 5 == 0  # every 5th case descends into aten ops too (a second re-run per side)
    doc = locate(str(clean), str(moved), out=tmp_path / "loc", reference=False, ops=ops).doc
    op = doc["first_bitwise_op"]
    assert doc["status"] == "located", doc["line"]
    assert op["module"] == module or op["module"].startswith(module + "/"), (spec, op["module"])
    assert op["step"] <= differs.step and doc["right"]["options"]["perturb"] == spec  # earlier: cached K/V carried it and "perturb" not in doc["left"]["options"]
    assert doc["cost"]["reruns"]["left"] <= 2 and doc["cost"]["reruns"]["right"] <= 2
    assert doc["left"]["reproduced"] and doc["right"]["reproduced"]


def test_perturbation_is_beyond_tolerance_with_float64_reference(clean, tmp_path):
    moved = tmp_path / "perturbed"
    _run(moved, perturb="model.layers.1.mlp.down_proj:weight:1e-3")
    doc = locate(str(clean), str(moved), out=tmp_path / "loc", ops=False).doc
    assert doc["first_bitwise_op"]["module"] == "model.layers.1.mlp.down_proj"
    beyond = doc["first_beyond_tolerance_op"]
    assert beyond is not None and beyond["module"] == "model.layers.1.mlp.down_proj"
    assert beyond["max_abs_diff"] > beyond["tolerance"] > 0  # the float64 reference evaluated on demand, the weight edited again
    assert all(r["output_equal"] for r in doc["layers"] if r["order"] < beyond_order(doc, beyond["module"]))
    timed = doc["cost"]["rerun_seconds"]  # each side's re-run with capture and without it (its captured step's forward again)
    for side in ("left", "right"):
        assert all(v > 0 for k in ("without_capture", "with_capture") for v in timed[side][k]), timed
    assert set(timed["overhead"]) == {"wall", "cpu"}
    from detllm.render.locate import render_text

    assert "re-runs without capture" in render_text(doc)


def beyond_order(doc, module):
    return next(r["order"] for r in doc["layers"] if r["module"] == module)


def test_identical_repeats_locate_nothing(tmp_path):
    folder = tmp_path / "repeats"
    detllm.check(backend="hf", model="tiny", max_new_tokens=2, tier=2, runs=21, prompts=PROMPT, out=folder)
    for k in range(1, 21):  # 20 control pairs, each captured at the prefill although nothing recorded differs
        doc = locate(f"{folder}::run_0", f"{folder}::run_{k}", step=0, out=tmp_path / f"l{k}", ops=False, reference=False).doc
        assert doc["status"] == "not_located" and doc["first_bitwise_op"] is None and doc["first_differing"] is None, doc["line"]
        assert doc["layers"] and all(r["output_equal"] for r in doc["layers"])


@pytest.fixture(scope="module")
def batch_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("locate_batch") / "check"
    detllm.check(backend="hf", model="tiny", max_new_tokens=2, tier=2, runs=2, vary_batch=(1, 8), out=out)
    return out


def test_real_batch_variance_is_located_to_an_op_with_shapes(batch_folder, cli):
    r = cli("locate", f"{batch_folder}::batch_1", f"{batch_folder}::batch_8", "--no-reference")
    assert r.exit_code == 0, r.output
    doc = json.loads((batch_folder / "locate.json").read_text())
    assert doc["status"] == "located" and doc["step"]["step"] == 0, doc["line"]
    op = doc["first_bitwise_op"]
    assert op["output_shape"]["left"][0] == 1 and op["output_shape"]["right"][0] == 8  # the whole batch each engine saw
    assert op["kind"] in ("gemm", "attention", "norm", "softmax", "activation", "rotary", "embedding", "other")
    assert doc["growth"] and doc["growth"][-1]["kind"] == "logits"
    assert "LOCATED" in r.stdout and op["module"] in r.stdout
    detllm.verify(batch_folder)  # locate.json sealed with the folder


def test_ops_until_the_layer_found_name_what_every_op_names(batch_folder, tmp_path, monkeypatch):
    """The ops re-run records ops only until the decoder layer holding the module the modules re-run found
    completes: on real batch variance the op named, its tolerance, the category and the graft (outcome,
    next op, counts) are those of a capture of every op; the rows after that layer are modules only."""
    from detllm.locate import core

    sel = (f"{batch_folder}::batch_1", f"{batch_folder}::batch_8")
    cut = locate(*sel, out=tmp_path / "cut").doc
    monkeypatch.setattr(core, "_through", lambda tensors, name: None)  # every op, as before
    every = locate(*sel, out=tmp_path / "every").doc
    assert cut["captured"]["ops_through"] == "model.layers.0" and "ops_through" not in every["captured"]
    assert cut["first_bitwise_op"] == every["first_bitwise_op"] and cut["category"] == every["category"]
    assert cut["graft"]["into_right"] == every["graft"]["into_right"], (cut["graft"], every["graft"])
    end = next(r["order"] for r in cut["layers"] if r["module"] == "model.layers.0")
    assert not any("/torch." in r["module"] for r in cut["layers"] if r["order"] > end)
    assert any(r["module"] == "model.layers.1.mlp.down_proj" for r in cut["layers"])  # modules go on to the logits
    assert any(r["module"].startswith("model.layers.1.") and "/torch." in r["module"] for r in every["layers"])
    assert any("ops after model.layers.0 completed" in n for n in cut["not_captured"])


def _asked(monkeypatch):
    """What each capture re-run is asked for, in order (both sides each time): (level, float64 inputs, guide)."""
    from detllm.locate import core

    asked, real = [], core.reruns.capture
    monkeypatch.setattr(core.reruns, "capture", lambda r, step, **kw: asked.append(
        (kw["level"], kw["reference"], kw.get("guide", False))) or real(r, step, **kw))
    return asked


def test_the_guide_changes_no_finding(batch_folder, tmp_path, monkeypatch):
    """The modules capture an ops capture follows is a guide: no float64 inputs, and inside each decoder
    layer only the attentions (the ops capture records every module again, with its inputs). On real batch
    variance the op named, its tolerance, the first op beyond it, the category, every row and the graft
    are those of a locate whose first capture took every module with its float64 inputs."""
    from detllm.locate import core

    sel = (f"{batch_folder}::batch_1", f"{batch_folder}::batch_8")
    asked = _asked(monkeypatch)
    guided = locate(*sel, out=tmp_path / "guided").doc
    assert asked == [("modules", False, True)] * 2 + [("ops", True, False)] * 2
    monkeypatch.setattr(core, "_guide", lambda *a, **k: False)
    full = locate(*sel, out=tmp_path / "full").doc
    assert asked[4:] == [("modules", True, False)] * 2 + [("ops", True, False)] * 2
    assert guided["first_bitwise_op"]["tolerance"] is not None  # evaluated: on the ops capture's float64 inputs
    for key in ("status", "line", "first_bitwise_op", "first_beyond_tolerance_op", "category", "layers", "not_captured",
                "captured", "growth"):
        assert guided[key] == full[key], key
    assert guided["graft"]["into_right"] == full["graft"]["into_right"]


def test_a_guide_no_ops_capture_follows_is_taken_again_as_every_module(batch_folder, tmp_path, monkeypatch):
    """Past the memory bound no ops capture follows, so the guide would be final: every module is captured
    again, with float64 inputs (a second re-run), and the finding, tolerance included, is a modules-only
    locate's."""
    sel = (f"{batch_folder}::batch_1", f"{batch_folder}::batch_8")
    asked = _asked(monkeypatch)
    bounded = locate(*sel, out=tmp_path / "bounded", max_bytes=20_000, graft="off").doc
    assert asked == [("modules", False, True)] * 2 + [("modules", True, False)] * 2
    assert bounded["cost"]["reruns"] == {"left": 2, "right": 2} and bounded["left"]["level"] == "layers"
    assert any("(it passed the memory bound): every module was captured again" in n for n in bounded["not_captured"])
    modules = locate(*sel, out=tmp_path / "modules", max_bytes=20_000, graft="off", ops=False).doc
    assert bounded["first_bitwise_op"]["tolerance"] is not None
    assert bounded["first_bitwise_op"] == modules["first_bitwise_op"]
    assert bounded["first_beyond_tolerance_op"] == modules["first_beyond_tolerance_op"]
    assert bounded["layers"] == modules["layers"]


def test_batch_invariant_mode_no_op_differs(tmp_path):
    out = tmp_path / "inv"
    detllm.check(backend="hf", model="tiny", max_new_tokens=2, tier=3, runs=2, vary_batch=(1, 8), out=out,
                 options={"batch_invariant": "true"})
    doc = locate(f"{out}::batch_1", f"{out}::batch_8", out=tmp_path / "l").doc
    assert doc["status"] == "no_difference"
    doc = locate(f"{out}::batch_1", f"{out}::batch_8", step=0, out=tmp_path / "l2", reference=False).doc
    assert doc["status"] == "not_located" and doc["first_differing"] is None, doc["line"]


def test_model_files_changed_since_the_run_exit_7(tmp_path, cli):
    from detllm.models import local_folder, resolve_model

    model = tmp_path / "model"
    shutil.copytree(local_folder(resolve_model("tiny"), None), model)
    out = tmp_path / "run"
    detllm.run(backend="hf", model=str(model), max_new_tokens=1, tier=2, prompts=PROMPT, out=out)
    detllm.run(backend="hf", model=str(model), max_new_tokens=1, tier=2, prompts=PROMPT, out=tmp_path / "moved",
               options={"perturb": "model.layers.1.mlp.down_proj:weight:1e-3"})
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4:] = bytes(4)  # the last float of the last tensor set to 0.0: same size, other weights
    weights.write_bytes(bytes(data))
    r = cli("locate", out, tmp_path / "moved", "--out", tmp_path / "l")
    assert r.exit_code == 7, r.output
    assert "weights" in r.stderr and r.stderr.startswith("detllm: error:") and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "l").exists()


def test_different_max_new_tokens_compare_the_steps_both_have(clean, tmp_path):
    """Review E5: one side recorded a 3rd token the other was never asked for; steps 0-1 are bitwise
    equal, so there is nothing to locate (no step that does not exist is asked of a re-run), and it says why."""
    longer = tmp_path / "longer"
    detllm.run(backend="hf", model="tiny", max_new_tokens=3, tier=2, prompts=PROMPT, out=longer)
    doc = locate(str(longer), str(clean), out=tmp_path / "loc").doc
    assert doc["status"] == "no_difference" and "every step both recorded" in doc["line"], doc["line"]
    assert any("different --max-new-tokens (3 vs 2)" in n for n in doc["not_captured"]), doc["not_captured"]
    assert doc["cost"] == {} and doc["step"] is None  # nothing re-run
