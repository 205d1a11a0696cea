"""More of locate's graft on real transformers (hf `tiny`): "confirmed" decided from the first divergent
token when the logits still differ (an embedding row edited in the model file flips token 1, a small
output perturbation downstream stays); the graft under `--prefill` (the decode's step s against the
prefill's last position), where grafting the prefill's q_proj into the decode changes nothing; a real "not the
cause" (a one-ulp q_proj difference the attention rounds away); the cache category on hf, its graft judged at
the step where the traces differ."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import detllm
from detllm.locate import locate

pytestmark = pytest.mark.engine

PROMPT = ["The capital of France is"]  # tiny generates 348, 119; at step 1 the runner-up (241) is 0.33 nats behind


def _embedding_row_replaced(dst, row: int, by: int):
    """A copy of tiny's model folder whose embedding row `row` is row `by`'s: the token generated at step 0
    (348) reads another vector at step 1; the prompt never reads that row, so step 0 is untouched."""
    from safetensors.torch import load_file, save_file

    from detllm.models import local_folder, resolve_model

    shutil.copytree(local_folder(resolve_model("tiny"), None), dst)
    name = next(f for f in os.listdir(dst) if f.endswith(".safetensors"))
    state = load_file(dst / name)
    state["model.embed_tokens.weight"][row] = state["model.embed_tokens.weight"][by].clone()
    save_file(state, dst / name, metadata={"format": "pt"})
    return dst


def test_confirmed_by_the_first_divergent_token_when_the_logits_still_differ(tmp_path):
    common = dict(backend="hf", max_new_tokens=2, tier=2, prompts=PROMPT)
    detllm.run(model="tiny", out=tmp_path / "clean", **common)
    model = _embedding_row_replaced(tmp_path / "model", 348, 119)
    detllm.run(model=str(model), out=tmp_path / "edited", options={"perturb": "model.layers.1.mlp.down_proj:output:1e-3@1"}, **common)
    doc = locate(str(tmp_path / "clean"), str(tmp_path / "edited"), out=tmp_path / "loc", ops=False).doc
    assert doc["step"]["what"] == "token" and doc["step"]["step"] == 1, doc["step"]
    assert doc["first_bitwise_op"]["module"] == "model.embed_tokens"
    g = doc["graft"]["into_right"]
    assert g["outcome"] == "confirmed" and g["confirmed_by"] == "token", g
    assert g["token"] == {"step": 1, "other_side": doc["step"]["left"], "before": doc["step"]["right"], "after": doc["step"]["left"]}
    # the perturbation downstream is still there: the logits differ, and the op that still differs is named
    assert 0 < g["logits_max_abs_diff_after"] < g["logits_max_abs_diff_before"]
    assert "model.layers.1.mlp.down_proj" in g["why"] and "no longer diverges" in g["why"]


def test_graft_under_prefill_one_of_many_and_a_real_not_the_cause(tmp_path, cli):
    run = tmp_path / "run"
    detllm.run(backend="hf", model="tiny", max_new_tokens=6, tier=2, prompts=PROMPT, out=run)
    r = cli("locate", run, "--prefill", "--graft", "both", "--no-ops", "--out", tmp_path / "loc")
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "loc" / "locate.json").read_text())
    assert doc["source"] == "prefill vs decode" and doc["status"] == "located", doc["line"]
    s, g = doc["step"]["step"], doc["graft"]
    assert g["step"] == s and g["reruns"] == 2 and "the prefill's last position" in g["positions"]
    # into the prefill: the decode's one position written over the prefill's last (the positions compared)
    right, left = g["into_right"], g["into_left"]
    assert "written 1 time(s)" in right["written"] and "of this side's" in right["written"], right
    assert right["outcome"] == "one_of_many" and right["next_op"]["kind"] == "gemm", right  # M=1 vs M=prompt+s GEMMs
    assert right["logits_max_abs_diff_after"] != right["logits_max_abs_diff_before"]
    # into the decode: the prefill's output of the located op changes nothing downstream (measured: q_proj, whose
    # difference the attention scores round away): not the cause; every other differing op still differs
    assert left["outcome"] == "not_the_cause", left
    assert left["logits_max_abs_diff_after"] == left["logits_max_abs_diff_before"] > 0
    assert left["ops_differing_after"] == left["ops_differing_before"] - 1
    assert "NOT THE CAUSE" in r.stdout and "ONE OF MANY" in r.stdout


def test_cache_category_on_hf_and_the_graft_judged_where_the_traces_differ(tmp_path):
    """A v_proj output moved at the prefill (1e-4 of its RMS, one element of the last position): steps 0 and 1
    record the same logprobs bitwise, step 2 differs. At step 2 layer 1's attention reads cached K/V that differ
    (its o_proj, a child, completes first), so locate goes back to step 0, where they were written, and names
    v_proj: category cache. The graft at step 0 cannot be judged from step 0's logits (they agreed): the
    grafted re-run runs on to step 2, where its token and logprob are the other side's, bitwise."""
    common = dict(backend="hf", model="tiny", max_new_tokens=3, tier=2, prompts=PROMPT)
    detllm.run(out=tmp_path / "clean", **common)
    detllm.run(out=tmp_path / "moved", options={"perturb": "model.layers.1.self_attn.v_proj:output:1e-4@0"}, **common)
    doc = locate(str(tmp_path / "clean"), str(tmp_path / "moved"), out=tmp_path / "loc", ops=False, graft="both").doc
    assert doc["step"]["step"] == 2 and doc["steps_searched"] == [2, 0], (doc["step"], doc["steps_searched"])
    assert doc["first_bitwise_op"]["module"] == "model.layers.1.self_attn.v_proj" and doc["captured_step"] == 0
    cat = doc["category"]
    assert cat["name"] == "cache" and (cat["written_at_step"], cat["read_at_step"]) == (0, 2), cat
    assert cat["where_written"]["name"] == "numerical_defect" and doc["line"].startswith("cache: ")
    for key, (mine, theirs) in (("into_right", ("right", "left")), ("into_left", ("left", "right"))):
        g = doc["graft"][key]
        assert g["outcome"] == "confirmed" and g["confirmed_by"] == "later_step" and g["judged_at_step"] == 2, g
        assert g["logprob_after"] == g["logprob_other_side"] == doc["step"][theirs] != g["logprob_before"] == doc["step"][mine]


def _one_ulp_and_a_down_proj_edit(dst):
    """tiny's model file with q_proj's largest weight moved by one ulp (layer 0) and one element of layer 1's
    down_proj by 1e-3 of its RMS."""
    import torch
    from safetensors.torch import load_file, save_file

    from detllm.models import local_folder, resolve_model

    shutil.copytree(local_folder(resolve_model("tiny"), None), dst)
    name = next(f for f in os.listdir(dst) if f.endswith(".safetensors"))
    state = load_file(dst / name)
    q = state["model.layers.0.self_attn.q_proj.weight"].view(-1)
    i = int(q.abs().argmax())
    q[i] = torch.nextafter(q[i], torch.tensor(float("inf")))
    d = state["model.layers.1.mlp.down_proj.weight"]
    flat = d.view(-1)
    flat[int(flat.abs().argmax())] += 1e-3 * float(d.pow(2).mean().sqrt())
    save_file(state, dst / name, metadata={"format": "pt"})
    return dst


def test_a_difference_the_attention_rounds_away_is_not_the_cause(tmp_path):
    """q_proj's output differs (one ulp of one weight), so it is the first op with equal inputs and another
    output; but the attention rounds that difference away: grafting it leaves the logits bitwise as they were,
    and the down_proj edit, which is what moved them, is named next."""
    common = dict(backend="hf", max_new_tokens=2, tier=2, prompts=PROMPT)
    detllm.run(model="tiny", out=tmp_path / "clean", **common)
    detllm.run(model=str(_one_ulp_and_a_down_proj_edit(tmp_path / "model")), out=tmp_path / "edited", **common)
    doc = locate(str(tmp_path / "clean"), str(tmp_path / "edited"), out=tmp_path / "loc", ops=False).doc
    assert doc["first_bitwise_op"]["module"] == "model.layers.0.self_attn.q_proj", doc["line"]
    g = doc["graft"]["into_right"]
    assert g["outcome"] == "not_the_cause", g
    assert g["logits_max_abs_diff_after"] == g["logits_max_abs_diff_before"] > 0
    assert g["next_op"]["module"] == "model.layers.1.mlp.down_proj" and g["ops_differing_after"] == g["ops_differing_before"] - 1
