"""Causes ranked by whether their difference can produce the divergence seen (issue 20, section 1):
one test per row of docs/causes.md "What each cause can explain", the real case (one hf model
folder, its config re-saved by another transformers, --max-new-tokens 16 vs 24), a model
difference that cannot cut generation off ranked below the setting that did, and the merged
BATCH_VARIANCE naming every batch size (section 5)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

import detllm
from detllm.runfolder import artifacts
from detllm.runfolder.artifacts import validate
from detllm.compare.causes import Side, rank
from detllm.compare.causes.explains import CAN_EXPLAIN, cannot_explain, judge
from detllm.core.hashing import config_digests

HERE = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("make_diff_fixtures", HERE / "fixtures" / "make_diff_fixtures.py")
mk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mk)

KINDS = ("input_ids", "token", "logprob", "stop", "limit", "unmatched")
# the table of docs/causes.md, row by row: what each code can produce
TABLE = {
    "MODEL_MISMATCH": {"token", "logprob", "stop"},
    "TOKENIZER_MISMATCH": {"input_ids", "token", "logprob", "stop"},
    "PROMPT_MISMATCH": {"unmatched"},
    "CONFIG_MISMATCH": {"input_ids", "token", "logprob", "stop", "limit"},
    "BACKEND_MISMATCH": {"input_ids", "token", "logprob", "stop", "limit"},
    "ENV_MISMATCH": {"input_ids", "token", "logprob", "stop"},
    "RUN_VARIANCE": {"token", "logprob", "stop"},
    "BATCH_VARIANCE": {"token", "logprob", "stop"},
    "CACHE_VARIANCE": {"token", "logprob", "stop"},
    "PROCESS_VARIANCE": {"token", "logprob", "stop"},
}


def _docs_table() -> dict[str, set[str]]:
    """The rows of the table in docs/causes.md: | `CODE` | kinds ... |"""
    text = (HERE.parent / "docs" / "causes.md").read_text()
    section = text.split("### What each cause can explain", 1)[1].split("\n\n", 2)[1]
    rows = {}
    for line in section.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = {k for k in KINDS if f"`{k}`" in cells[1]}
    return rows


def test_the_table_in_the_docs_is_the_table_the_code_uses():
    assert _docs_table() == TABLE
    assert {k: set(v) for k, v in CAN_EXPLAIN.items()} == TABLE


@pytest.mark.parametrize("code", sorted(TABLE))
def test_each_row(code):
    """Every kind the row names is explained (no cannot_explain); every other kind is not, and says why;
    a cause that cannot explain ranks below one that can, whatever their order in RANK."""
    for kind in KINDS:
        at = {"kind": kind, "token_index": None if kind == "unmatched" else 3}
        ev = {"fields": [{"field": "config.decoding.temperature", "left": 0.0, "right": 0.5}], "applied": []} \
            if code == "CONFIG_MISMATCH" else {}
        if code == "CONFIG_MISMATCH" and kind == "limit":
            ev["fields"] = [{"field": "config.decoding.max_new_tokens", "left": 3, "right": 8}]
        why = cannot_explain(code, ev, [at], sampled=False)
        assert (why is None) == (kind in TABLE[code]), (code, kind, why)
        if why is not None:
            assert why.startswith("the first divergence (token 3) is " if kind != "unmatched" else "the first divergence is ")
            other = next(c for c in TABLE if kind in TABLE[c] and c != code)
            ranked = rank([{"code": code, "evidence": {"cannot_explain": why}}, {"code": other, "evidence": {}}])
            assert [c["code"] for c in ranked] == [other, code]


def test_config_fields_explain_only_what_they_can():
    limit = [{"field": "config.decoding.max_new_tokens", "left": 16, "right": 24}]
    assert cannot_explain("CONFIG_MISMATCH", {"fields": limit, "applied": []}, [{"kind": "limit", "token_index": 16}], False) is None
    assert "it ends generation where the smaller of the two values ends" in cannot_explain(
        "CONFIG_MISMATCH", {"fields": limit, "applied": []}, [{"kind": "limit", "token_index": 9}], False)
    assert "can produce only one side reaching its --max-new-tokens" in cannot_explain(
        "CONFIG_MISMATCH", {"fields": limit, "applied": []}, [{"kind": "token", "token_index": 3}], False)
    seed = [{"field": "config.seed", "left": 1, "right": 2}]
    assert "greedy decoding draws no random number" in cannot_explain(
        "CONFIG_MISMATCH", {"fields": seed, "applied": []}, [{"kind": "token", "token_index": 3}], False)
    assert cannot_explain("CONFIG_MISMATCH", {"fields": seed, "applied": []}, [{"kind": "token", "token_index": 3}], True) is None


def test_a_cause_that_explains_any_divergence_seen_is_not_demoted():
    """A tokenizer difference explains prompt 2's input ids although prompt 0's first divergence is a length limit."""
    limit, ids = {"kind": "limit", "token_index": 6}, {"kind": "input_ids", "token_index": 0}
    assert cannot_explain("TOKENIZER_MISMATCH", {}, [limit, ids], False) is None
    why = cannot_explain("MODEL_MISMATCH", {}, [limit, ids], False)
    assert why.startswith("the first divergence (token 6) is one side reaching its --max-new-tokens where the other went on; "
                          "the others seen are the prompt fed as different input ids: a model difference")


def test_a_length_divergence_is_told_apart_by_the_finish_reason():
    def rec(finish, n):
        return {"prompt_index": 0, "prompt_id": "p", "finish_reason": finish, "token_ids": list(range(n))}

    d = {"kind": "length", "token_index": 4, "prompt_index": 0, "left": {"token_id": None}, "right": {"token_id": 9}}
    comp = {"first_divergence": d, "divergences": [d]}
    for finish, says in (("length", "reaching its --max-new-tokens"), ("stop", "stopping (EOS or a stop string)")):
        causes = [{"code": "MODEL_MISMATCH", "evidence": {}}, {"code": "CONFIG_MISMATCH", "evidence": {
            "fields": [{"field": "config.decoding.max_new_tokens", "left": 4, "right": 8}], "applied": []}}]
        judge(causes, comp, Side("a", 0, 1, [rec(finish, 4)]), Side("b", 0, 1, [rec("length", 8)]))
        blamed = [c["code"] for c in causes if "cannot_explain" in c["evidence"]]
        assert blamed == (["MODEL_MISMATCH"] if finish == "length" else ["CONFIG_MISMATCH"])
        assert says in next(c["evidence"]["cannot_explain"] for c in causes if "cannot_explain" in c["evidence"])


def _tiny_copy(dest: Path) -> Path:
    from detllm.models import builtin_path

    shutil.copytree(builtin_path("tiny", "hf"), dest)
    return dest


def _resave_as_older_transformers(folder: Path) -> None:
    """config.json and generation_config.json as an older transformers saved the same model: another
    version stamp, the dtype under its old name, the generation config marked as derived from config.json."""
    cfg = json.loads((folder / "config.json").read_text())
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg["transformers_version"] = "4.46.3"
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = json.loads((folder / "generation_config.json").read_text())
    gen.pop("_from_model_config", None)
    gen["transformers_version"] = "4.46.3"
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2))


@pytest.mark.engine
def test_a_resaved_config_is_no_model_difference_and_the_length_limit_leads(tmp_path):
    """The real case: one model folder, its config re-saved by another transformers between the runs,
    --max-new-tokens 16 vs 24. The divergence is a length stop at token 16; the cause is the setting."""
    older, newer = _tiny_copy(tmp_path / "older"), _tiny_copy(tmp_path / "newer")
    _resave_as_older_transformers(older)
    assert config_digests(older)[0] == config_digests(newer)[0] and config_digests(older)[1] != config_digests(newer)[1]
    prompts = ["The capital of France is", "Once upon a time"]
    a = detllm.run(backend="hf", model=str(older), prompts=prompts, max_new_tokens=16, tier=2, out=tmp_path / "a").out_dir
    b = detllm.run(backend="hf", model=str(newer), prompts=prompts, max_new_tokens=24, tier=2, out=tmp_path / "b").out_dir
    report = detllm.diff(a, b).report
    validate(report, "report")
    first = report["first_divergence"]
    assert first["kind"] == "length" and first["token_index"] == 16 and first["left"]["token_id"] is None
    assert [c["code"] for c in report["causes"]] == ["CONFIG_MISMATCH"], report["causes"]
    assert report["category"] == "CONFIG_MISMATCH"
    assert "run_config.model.config_files_sha256" in {d["field"] for d in report["inert_differences"]}


def test_a_model_difference_that_cannot_cut_generation_off_ranks_below_the_limit(tmp_path):
    """Weights recorded as different (an edit in place) and --max-new-tokens 6 vs 8, tokens equal up to 6:
    MODEL_MISMATCH, first in RANK, ranks below CONFIG_MISMATCH and says why."""
    a = detllm.run(backend="fake", model="fake", max_new_tokens=6, tier=2, out=tmp_path / "a").out_dir
    b = detllm.run(backend="fake", model="fake", max_new_tokens=8, tier=2, out=tmp_path / "b").out_dir
    for folder, digest in ((a, "1" * 64), (b, "2" * 64)):
        doc = json.loads((folder / artifacts.RUN_CONFIG).read_text())
        doc["model"].update(weights_sha256=digest, weights=[{"file": "model.safetensors", "sha256": digest, "size": 1}])
        mk._write(folder, artifacts.RUN_CONFIG, doc)
    report = detllm.diff(a, b).report
    validate(report, "report")
    assert report["first_divergence"]["kind"] == "length" and report["first_divergence"]["token_index"] == 6
    assert [c["code"] for c in report["causes"]] == ["CONFIG_MISMATCH", "MODEL_MISMATCH"]
    why = report["causes"][1]["evidence"]["cannot_explain"]
    assert "the first divergence (token 6) is one side reaching its --max-new-tokens" in why and "never" in why
    assert "cannot_explain" not in report["causes"][0]["evidence"]


def test_the_merged_batch_variance_names_every_batch_size(tmp_path):
    out = detllm.check(backend="fake", runs=2, vary_batch=(1, 4, 8), tier=2,
                       options={"diverge": "prompt=0,pos=1,batch=4;prompt=0,pos=1,batch=8"}, out=tmp_path / "c").out_dir
    report = json.loads((out / "report.json").read_text())
    cause = next(c for c in report["causes"] if c["code"] == "BATCH_VARIANCE")
    assert cause["evidence"]["comparisons"] == ["batch 4 vs batch 1", "batch 8 vs batch 1"]
    assert cause["evidence"]["batch_sizes"] == [1, 4, 8] and "batch_size" not in cause["evidence"]
    assert "batch sizes [1, 4, 8]" in (out / "report.txt").read_text()
