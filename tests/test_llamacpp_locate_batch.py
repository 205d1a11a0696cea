"""locate on llama.cpp inside a batch (issue 34 §2) and its graft (issue 33 §1), against the real
llama-server and detllm-dump (tiny F32 GGUF, f32 KV cache, no flash attention): detllm-dump re-runs a
batch of 4 as the server scheduled it and cuts row 0 out of each graph evaluation; batch 1 vs batch 4
is located on an op whose row really differs, the same batch twice locates nothing, and a weight
edited in the GGUF is located and the graft (detllm-dump writing the left's rows into the node) confirms it.

CI always builds llama.cpp, so a missing binary FAILS these tests (DETLLM_SKIP_LLAMACPP=1 skips them).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import detllm
from detllm.backends.base import CaptureSpec, Request
from detllm.backends.llamacpp import LlamaCppBackend, LlamaCppOptions
from detllm.backends.llamacpp.capture import find_dumper, run_dump
from detllm.backends.llamacpp.model import read_info
from detllm.backends.llamacpp.rows import BOUND
from detllm.core.config import Decoding
from detllm.locate import locate
from detllm.models import builtin_path

from .conftest import llama_server_or_fail, write_prompts

pytestmark = pytest.mark.engine

OPTIONS = {"kv_type": "f32", "flash_attn": "off"}
# four prompts of 7 tokens each: the batch-4 prefill is one ubatch of 4 x 7 rows (so each layer's attention op
# is captured; a prompt split over several ubatches has its attention op left out, noted)
PROMPTS = ["The capital of France is", "def add(a, b):", "The cat sat on a", "The sun is very hot"]


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    llama_server_or_fail()
    tmp = tmp_path_factory.mktemp("llbatch")
    prompts = write_prompts(tmp / "p.jsonl", PROMPTS)
    return detllm.check(backend="llamacpp", model="tiny", prompts=prompts, tier=2, runs=2, vary_batch=(1, 4),
                        max_new_tokens=3, options=OPTIONS, out=tmp / "check").out_dir


@pytest.fixture(scope="module")
def server():
    llama_server_or_fail()
    with LlamaCppBackend("tiny", LlamaCppOptions(**OPTIONS), slots=4) as b:
        yield b, [Request(i, tuple(b.tokenize(p)), p) for i, p in enumerate(PROMPTS)]


def test_batch_1_vs_4_is_located_on_a_real_row_difference(check, server, tmp_path):
    doc = locate(f"{check}::batch_1", f"{check}::batch_4", out=tmp_path / "loc").doc
    assert doc["status"] == "located", doc["line"]
    right = doc["right"]
    assert right["reproduced"] and any("a batch of 4: detllm-dump re-ran it" in n for n in right["notes"]), right
    op, step = doc["first_bitwise_op"]["module"], doc["captured_step"]
    # the named op, captured again here from both schedules: row 0's inputs agree bitwise, its output does not
    b, reqs = server
    spec = CaptureSpec(step=step, row=0, level="modules")
    one = b.capture(reqs[:1], Decoding(max_new_tokens=3), seed=0, n_logprobs=5, spec=spec)
    four = b.capture(reqs, Decoding(max_new_tokens=3), seed=0, n_logprobs=5, spec=spec)
    got = [{t.name: t for t in c.tensors}[op] for c in (one, four)]
    assert all(np.array_equal(x, y) for x, y in zip(got[0].inputs, got[1].inputs)) and got[0].inputs, op
    assert not np.array_equal(got[0].output, got[1].output), op
    # the rows cut from the batched graph are row 0's: its embedding is token_embd's rows of prompt 0's tokens
    emb = {t.name: t for t in four.tensors}["model.embed_tokens"].output
    W = np.fromfile(b.gguf, dtype=np.float32, count=int(np.prod(b.info.tensor_layout["token_embd.weight"][0])),
                    offset=b.info.tensor_layout["token_embd.weight"][1]).reshape(-1, emb.shape[-1])
    ids = list(reqs[0].input_ids) + list(four.generations[0].token_ids[:step])
    assert np.array_equal(emb, W[[ids[p] for p in {t.name: t for t in four.tensors}["model.embed_tokens"].positions]])
    assert four.engine["dumper_topk_gap_max_abs_diff"] <= BOUND and "not_reproduced" not in four.engine
    sched = four.engine["dumper_schedule"]
    assert sched and all(set(e["sequences"]) == {"0", "1", "2", "3"} for e in sched), sched
    # the bound tells schedules apart: row 0 computed alone does not match what the server gave it in the batch
    alone = run_dump(find_dumper(b.binary), b.gguf, reqs[0].input_ids, four.generations[0].token_ids[:step], step,
                     b.dump_settings(), patterns=(r"^result_output$",))
    top = four.generations[0].top_logprobs
    gap = max(abs((lp - top[i][0][1]) - float(alone.logits[i][t] - alone.logits[i][top[i][0][0]]))
              for i in range(step + 1) for t, lp in top[i])
    assert gap > BOUND, gap
    assert doc["category"]["name"] == "reduction_order" and "operand shapes differ" in doc["category"]["why"], doc["category"]
    g = doc["graft"]["into_right"]  # the left's row grafted into the batched graph's row 0
    assert "written 1 time(s)" in g["written"] and g["outcome"] in ("one_of_many", "partial", "confirmed"), g


def test_a_decode_step_in_the_batch_reads_its_own_kv_stream(server):
    """Row 1 of the batch at step 2 (one ubatch of 4 rows): the dumper reproduces the server's row, and the
    K/V cached for it are its own stream's: the keys its prompt wrote at step 0 in the same batch, bitwise (f32 cache)."""
    b, reqs = server
    caps = {s: b.capture(reqs, Decoding(max_new_tokens=3), seed=0, n_logprobs=5, spec=CaptureSpec(step=s, row=1, level="modules"))
            for s in (0, 2)}
    assert caps[2].engine["dumper_topk_gap_max_abs_diff"] <= BOUND and caps[2].engine["dumper_schedule"] == [
        {"rows": 4, "sequences": {str(i): [len(reqs[i].input_ids) + 1, 1] for i in range(4)}}]
    att = [{t.name: t for t in caps[s].tensors}["model.layers.0.self_attn/attention"] for s in (0, 2)]
    n = len(reqs[1].input_ids)
    assert att[1].input_names[3:] == ["past_keys", "past_values"] and att[1].inputs[3].shape[0] == n + 1
    assert np.array_equal(att[1].inputs[3][:n], att[0].inputs[1]) and np.array_equal(att[1].inputs[4][:n], att[0].inputs[2])


def test_the_same_batch_twice_locates_nothing(check, tmp_path):
    doc = locate(f"{check}::batch_4", f"{check}::batch_4", step=0, out=tmp_path / "loc").doc  # each side re-run on its own
    assert doc["status"] == "not_located" and "no op differs" in doc["line"], doc["line"]
    assert doc["right"]["reproduced"] and doc["captured"]["tensors"] > 10
    assert all(row.get("max_abs_diff") in (0, 0.0, None) for row in doc["layers"]), doc["layers"][:3]


def _edited_gguf(dst, name):
    """tiny's F32 GGUF with one element of `name` (its largest) moved by 1e-3 of the tensor's RMS."""
    src = builtin_path("tiny", "gguf") / "model.gguf"
    shutil.copy(src, dst)
    ne, offset = read_info(dst).tensor_layout[name]
    w = np.memmap(dst, dtype=np.float32, mode="r+", offset=offset, shape=(int(np.prod(ne)),))
    i = int(np.abs(w).argmax())
    w[i] += np.float32(1e-3 * float(np.sqrt(np.mean(np.asarray(w, np.float64) ** 2))))
    w.flush()
    return dst


def test_an_edited_gguf_weight_is_located_and_the_graft_confirms_it(tmp_path, cli):
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:1])
    edited = _edited_gguf(tmp_path / "edited.gguf", "blk.0.attn_q.weight")
    sides = [detllm.run(backend="llamacpp", model=m, prompts=prompts, tier=2, max_new_tokens=2, out=tmp_path / k,
                        options=OPTIONS).out_dir for k, m in (("clean", "tiny"), ("edited", str(edited)))]
    r = cli("locate", sides[0], sides[1], "--out", tmp_path / "loc")
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "loc" / "locate.json").read_text())
    assert doc["first_bitwise_op"]["module"] == "model.layers.0.self_attn.q_proj", doc["line"]
    g = doc["graft"]["into_right"]
    assert g["outcome"] == "confirmed" and g["logits_max_abs_diff_before"] > 0, g
    assert "written 1 time(s)" in g["written"] and "re-permuted" in g["written"], g["written"]
    assert "CONFIRMED" in r.stdout


def test_a_batch_the_dumper_does_not_reproduce_is_said_and_nothing_compared(check, tmp_path, monkeypatch):
    """The wiring of the reproduction check: with a bound no re-run can meet, the batched side is "not
    reproduced here" (its dumper's row 0 is not the server's) and no op is compared."""
    from detllm.backends.llamacpp import rows

    monkeypatch.setattr(rows, "BOUND", -1.0)
    doc = locate(f"{check}::batch_1", f"{check}::batch_4", out=tmp_path / "loc", graft="off").doc
    assert doc["status"] == "not_reproduced" and doc["line"].startswith("not reproduced here: the right side"), doc["line"]
    assert "detllm-dump's re-run of the batch of 4 did not compute llama-server's row 0" in doc["right"]["not_reproduced"]
    assert doc["left"]["reproduced"] and doc["first_bitwise_op"] is None and doc["layers"] == []
