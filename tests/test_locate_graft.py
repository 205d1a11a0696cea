"""locate's graft (the causal test of the located op) and its category (benign or bug) on real
transformers (hf `tiny`): an output perturbation at equal shapes is a numerical defect the graft
confirms; a weight edited in the model file is a different computation the graft confirms at op
level; two edited weights: partial, the second named; batch 1 vs 8: reduction order, one of many,
both ways (--graft both) and in txt, md, HTML and `report --format issue`. On the fake backend (no
graft): a clear not_grafted, the cache category, and a bad --graft refused before anything is written."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import detllm
from detllm.locate import locate
from detllm.locate.category import LABELS

PROMPT = ["The capital of France is"]


def _run(out, model="tiny", **options):
    detllm.run(backend="hf", model=model, max_new_tokens=2, tier=2, prompts=PROMPT, out=out, options=options)
    return out


def _edited(dst, weights):
    """A copy of tiny's model folder with one element of each named weight moved by 1e-3 of its RMS."""
    from safetensors.torch import load_file, save_file

    from detllm.models import local_folder, resolve_model

    shutil.copytree(local_folder(resolve_model("tiny"), None), dst)
    name = next(f for f in os.listdir(dst) if f.endswith(".safetensors"))
    state = load_file(dst / name)
    for key in weights:
        flat = state[key].view(-1)
        i = int(flat.abs().argmax())
        flat[i] += 1e-3 * float(state[key].float().pow(2).mean().sqrt())
    save_file(state, dst / name, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("graft") / "clean")


@pytest.mark.engine
def test_output_perturbation_at_equal_shapes_is_a_numerical_defect_the_graft_confirms(clean, tmp_path):
    moved = _run(tmp_path / "moved", perturb="model.layers.0.mlp.up_proj:output:1e-3@0")
    doc = locate(str(clean), str(moved), out=tmp_path / "loc", ops=False).doc
    assert doc["first_bitwise_op"]["module"] == "model.layers.0.mlp.up_proj"
    assert doc["category"]["name"] == "numerical_defect" and doc["line"].startswith("numerical defect: model.layers.0.mlp.up_proj")
    g = doc["graft"]["into_right"]
    assert g["outcome"] == "confirmed" and g["logits_max_abs_diff_before"] > 0 == g["logits_max_abs_diff_after"]
    assert doc["graft"]["reruns"] == 1 and "into_left" not in doc["graft"]  # one extra re-run by default, right side only


@pytest.mark.engine
def test_a_weight_edited_in_the_model_file_is_a_different_computation_confirmed_at_op_level(clean, tmp_path):
    model = _edited(tmp_path / "model", ["model.layers.0.self_attn.q_proj.weight"])
    doc = locate(str(clean), str(_run(tmp_path / "edited", model=str(model))), out=tmp_path / "loc").doc
    op = doc["first_bitwise_op"]["module"]
    assert op == "model.layers.0.self_attn.q_proj/torch.linear#0", op  # an op: grafted inside the function mode
    assert doc["category"]["name"] == "different_computation"
    assert any("parameters of model.layers.0.self_attn.q_proj differ" in d for d in doc["category"]["differs"])
    assert doc["graft"]["into_right"]["outcome"] == "confirmed"


@pytest.mark.engine
def test_two_edited_weights_graft_partial_and_name_the_second(clean, tmp_path):
    model = _edited(tmp_path / "model", ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"])
    doc = locate(str(clean), str(_run(tmp_path / "edited", model=str(model))), out=tmp_path / "loc", ops=False).doc
    assert doc["first_bitwise_op"]["module"] == "model.layers.0.self_attn.q_proj"
    g = doc["graft"]["into_right"]
    assert g["outcome"] == "partial" and g["next_op"]["module"] == "model.layers.1.mlp.down_proj", g
    assert g["shrink"] > 1 and 0 < g["logits_max_abs_diff_after"] < g["logits_max_abs_diff_before"]


@pytest.mark.engine
def test_batch_1_vs_8_is_reduction_order_and_one_of_many_both_ways(tmp_path, cli):
    folder = tmp_path / "check"
    detllm.check(backend="hf", model="tiny", max_new_tokens=2, tier=2, runs=2, vary_batch=(1, 8), out=folder)
    r = cli("locate", f"{folder}::batch_1", f"{folder}::batch_8", "--graft", "both")
    assert r.exit_code == 0, r.output
    doc = json.loads((folder / "locate.json").read_text())
    assert doc["category"]["name"] == "reduction_order" and "operand shapes differ" in doc["category"]["why"]
    for key in ("into_right", "into_left"):
        g = doc["graft"][key]
        assert g["outcome"] == "one_of_many" and g["ops_differing_after"] >= 1, g
        assert g["logits_max_abs_diff_after"] > 0  # the divergence stays: not "confirmed", and it moved: not "not the cause"
    assert doc["graft"]["reruns"] == 2
    first = r.stdout.splitlines()[0]
    assert first.startswith("LOCATED  reduction order: ") and "graft (left's output grafted into the right side): ONE OF MANY" in r.stdout
    assert "graft (" in (folder / "locate.md").read_text() and "ONE OF MANY" in (folder / "locate.txt").read_text()
    assert "ONE OF MANY" in cli("report", folder, "--format", "issue").stdout
    assert "ONE OF MANY" in cli("report", folder, "--format", "html").stdout
    detllm.verify(folder)  # locate.json (with category and graft) validated and sealed with the folder


def _fake(tmp_path, **opts):
    opts = {"diverge": "prompt=1,pos=2,batch=4,what=logprob", **opts}
    detllm.check(backend="fake", options=opts, vary_batch=(1, 4), runs=2, tier=2, max_new_tokens=6, out=tmp_path / "c")
    return tmp_path / "c"


def test_a_backend_that_does_not_graft_says_so_and_the_cache_category(tmp_path):
    folder = _fake(tmp_path, capture_module="model.layers.0.mlp.down_proj", capture_from_step="0")
    doc = locate(f"{folder}::batch_1", f"{folder}::batch_4").doc
    assert doc["graft"]["into_right"]["outcome"] == "not_grafted"
    assert "does not graft yet" in doc["graft"]["into_right"]["why"] and doc["graft"]["reruns"] == 0
    assert doc["category"]["name"] == "cache" and doc["category"]["written_at_step"] == 0
    assert doc["category"]["read_at_step"] == 2 and doc["line"].startswith("cache: ")


def test_graft_off_and_a_bad_graft_value(tmp_path, cli):
    folder = _fake(tmp_path)
    doc = locate(f"{folder}::batch_1", f"{folder}::batch_4", graft="off").doc
    assert "graft" not in doc and doc["category"] is not None
    r = cli("locate", f"{folder}::batch_1", f"{folder}::batch_4", "--graft", "sideways", "--out", tmp_path / "l")
    assert r.exit_code == 2 and "--graft is one of right, both, off" in r.stderr and not (tmp_path / "l").exists()
    r = cli("diff", f"{folder}::batch_1", f"{folder}::batch_4", "--out", tmp_path / "d", "--locate")  # diff --locate's line
    label = LABELS[json.loads((tmp_path / "d" / "locate.json").read_text())["category"]["name"]]
    assert r.exit_code == 0 and f"LOCATED  {label}: " in r.stdout, r.output
