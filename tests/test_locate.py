"""`detllm locate` on the fake backend's scripted capture: the step, the exact batch re-run, the
root-cause rule (inputs agree, output differs), the K/V step back, tolerance, memory bound, the
folder written and resealed, and every refusal (exit 2, 4) before anything is written."""

from __future__ import annotations

import json

import pytest

import detllm
from detllm.runfolder import artifacts
from detllm.locate import locate
from detllm.render.locate import html_section
from detllm.commands.verify import verify_folder

INJECT = "prompt=1,pos=2,batch=4,what=logprob"


def _check(tmp_path, name="c", tier=2, runs=2, **opts):
    opts = {"diverge": INJECT, **opts}
    detllm.check(backend="fake", options=opts, vary_batch=(1, 4), runs=runs, tier=tier, max_new_tokens=6, out=tmp_path / name)
    return tmp_path / name


@pytest.mark.parametrize("module", ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj",
                                    "model.layers.0.input_layernorm", "model.layers.1.self_attn", "lm_head"])
def test_names_the_module_that_moved(tmp_path, module):
    folder = _check(tmp_path, capture_module=module)
    res = locate(f"{folder}::batch_1", f"{folder}::batch_4")
    doc = res.doc
    assert doc["status"] == "located", doc["line"]
    assert doc["step"]["prompt"] == 1 and doc["step"]["step"] == 2 and doc["step"]["what"] == "logprob"
    op = doc["first_bitwise_op"]
    assert op["module"] == module and op["step"] == 2 and op["prompt"] == 1
    assert op["output_shape"] == {"left": [1, 1, 8], "right": [4, 1, 8]}  # as each engine saw the whole batch
    assert doc["first_beyond_tolerance_op"]["module"] == module  # a 1e-3 move: far beyond rounding
    assert doc["cost"]["reruns"] == {"left": 1, "right": 1}
    row = next(r for r in doc["layers"] if r["module"] == module)
    assert row["inputs_equal"] is True and row["output_equal"] is False
    before = [r for r in doc["layers"] if r["order"] < row["order"]]
    assert before and all(r["output_equal"] for r in before)
    assert doc["growth"][0]["module"] == module and doc["growth"][-1]["kind"] == "logits"
    # written into the folder both sides came from, and sealed with it
    assert res.out_dir == folder
    assert artifacts.read_json(folder / "locate.json", "locate") == json.loads(json.dumps(doc))
    assert (folder / "locate.txt").read_text().startswith("LOCATED")
    verify_folder(folder)


def test_prefill_padding_is_sliced_off(tmp_path):
    """Batch 4 pads the prompt on the left at the prefill; the scripted padding rows differ by batch size."""
    folder = _check(tmp_path, diverge="prompt=1,pos=0,batch=4,what=logprob")
    doc = locate(f"{folder}::batch_1", f"{folder}::batch_4").doc
    assert doc["step"]["step"] == 0
    assert doc["first_bitwise_op"]["module"] == "model.layers.0.mlp.down_proj"
    assert all(r["output_equal"] for r in doc["layers"] if r["order"] < 11)


def test_a_rounding_sized_move_is_bitwise_but_within_tolerance(tmp_path):
    folder = _check(tmp_path, capture_nudge="3e-7")
    doc = locate(f"{folder}::batch_1", f"{folder}::batch_4").doc
    op = doc["first_bitwise_op"]
    assert op["module"] == "model.layers.0.mlp.down_proj"
    assert op["max_abs_diff"] <= op["tolerance"]
    assert doc["first_beyond_tolerance_op"] is None
    assert "within tolerance" in doc["line"]


def test_cached_kv_sends_the_search_back_to_the_step_that_wrote_them(tmp_path):
    folder = _check(tmp_path, capture_module="model.layers.0.mlp.down_proj", capture_from_step="0")
    doc = locate(f"{folder}::batch_1", f"{folder}::batch_4").doc
    assert doc["steps_searched"] == [2, 0] and doc["captured_step"] == 0
    assert doc["first_bitwise_op"]["module"] == "model.layers.0.mlp.down_proj" and doc["first_bitwise_op"]["step"] == 0
    assert doc["cost"]["reruns"] == {"left": 2, "right": 2}  # the most a side is re-run
    assert any("cached K/V" in n for n in doc["not_captured"])


def test_identical_repeats_locate_nothing_and_rerun_nothing(tmp_path):
    folder = _check(tmp_path)
    doc = locate(f"{folder}::run_0", f"{folder}::run_1").doc
    assert doc["status"] == "no_difference" and doc["step"] is None and doc["first_bitwise_op"] is None
    assert doc["cost"] == {}


def test_run_variance_is_not_reproduced_here(tmp_path):
    folder = _check(tmp_path, diverge="prompt=0,pos=1,run=1,what=logprob")
    doc = locate(f"{folder}::run_0", f"{folder}::run_1").doc
    assert doc["status"] == "not_reproduced"
    assert doc["left"]["reproduced"] is True and doc["right"]["reproduced"] is False
    assert "step 1: recorded logprob" in doc["right"]["not_reproduced"]
    assert doc["first_bitwise_op"] is None and doc["layers"] == []


def test_layers_only_names_the_layer(tmp_path):
    folder = _check(tmp_path)
    doc = locate(f"{folder}::batch_1", f"{folder}::batch_4", layers_only=True).doc
    assert doc["first_bitwise_op"]["module"] == "model.layers.0"
    assert {r["kind"] for r in doc["layers"]} <= {"embedding", "layer", "logits"}


def test_past_the_memory_bound_layer_boundaries_only(tmp_path):
    folder = _check(tmp_path)
    doc = locate(f"{folder}::batch_1", f"{folder}::batch_4", max_bytes=4096).doc
    assert doc["left"]["level"] == "layers" and doc["first_bitwise_op"]["module"] == "model.layers.0"
    assert any("layer boundaries only" in n for n in doc["not_captured"])
    assert max(doc["cost"]["peak_captured_bytes"].values()) <= 4096 // 2


def test_a_failing_check_folder_and_a_diff_folder(tmp_path, cli):
    folder = _check(tmp_path, diverge="prompt=1,pos=3,batch=4")  # a token flip: the check fails
    doc = locate(str(folder)).doc
    assert doc["source"] == "check folder" and doc["step"]["what"] == "token" and doc["step"]["step"] == 3
    assert doc["first_bitwise_op"]["module"] == "model.layers.0.mlp.down_proj"
    d = tmp_path / "d"
    assert cli("diff", f"{folder}::batch_1", f"{folder}::batch_4", "--out", d).exit_code == 1
    r = cli("locate", d)
    assert r.exit_code == 0, r.output
    assert "LOCATED" in r.stdout and "model.layers.0.mlp.down_proj" in r.stdout
    assert artifacts.read_json(d / "locate.json", "locate")["source"] == "diff folder"
    verify_folder(d)


def test_cli_writes_html_and_json(tmp_path, cli):
    folder = _check(tmp_path)
    page = tmp_path / "l.html"
    r = cli("locate", f"{folder}::batch_1", f"{folder}::batch_4", "--out", tmp_path / "o", "--html", page, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["status"] == "located"
    text = page.read_text()
    assert "<svg" in text and "<script" not in text and "model.layers.0.mlp.down_proj" in text
    assert not (folder / "locate.json").exists()  # --out elsewhere: the run folder is untouched
    assert "<svg" in "".join(html_section(json.loads((tmp_path / "o" / "locate.json").read_text())))


@pytest.mark.parametrize("args, code, words", [
    (["nowhere"], 2, "locate needs two sides"),
    (["{f}::batch_4"], 2, "locate needs two sides"),
    (["{f}::batch_x", "{f}::batch_4"], 2, "cannot read the selection"),
    (["{f}::batch_1", "{f}::batch_16"], 2, "has no records for run_0@batch_16"),
    (["{f}::batch_1", "{f}::batch_4", "--max-memory", "0"], 2, "--max-memory"),
    (["{f}::batch_1", "{f}::batch_4", "--prompt", "-1"], 2, "--prompt"),
    (["{f}::batch_1", "{f}::batch_4", "--prompt", "9"], 2, "no common record"),
])
def test_bad_input_one_line_nothing_written(tmp_path, cli, args, code, words):
    folder = _check(tmp_path, diverge="prompt=1,pos=2,batch=4,what=logprob")
    before = sorted(p.name for p in folder.iterdir())
    r = cli("locate", *[a.format(f=folder) for a in args])
    assert r.exit_code == code, r.output
    assert r.stderr.startswith("detllm: error:") and words in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in folder.iterdir()) == before


def test_backend_without_internals_exit_4_nothing_written(tmp_path, cli):
    folder = _check(tmp_path, capture="none")
    r = cli("locate", f"{folder}::batch_1", f"{folder}::batch_4")
    assert r.exit_code == 4, r.output
    assert "captures nothing" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (folder / "locate.json").exists()


def test_model_changed_since_the_run_exit_7(tmp_path, cli):
    folder = _check(tmp_path)
    cfg = json.loads((folder / "run_config.json").read_text())
    cfg["model"]["weights_sha256"] = "0" * 64  # the recorded weights are not the ones the backend loads now
    (folder / "run_config.json").write_text(json.dumps(cfg))
    r = cli("locate", f"{folder}::batch_1", f"{folder}::batch_4", "--out", tmp_path / "o")
    assert r.exit_code == 7, r.output
    assert "refusing" in r.stderr and not (tmp_path / "o").exists()


def test_diff_locate_report_issue_html_and_pack_hold_it(tmp_path, cli):
    folder = _check(tmp_path)
    d = tmp_path / "d"
    r = cli("diff", f"{folder}::batch_1", f"{folder}::batch_4", "--out", d, "--locate")
    assert r.exit_code == 0, r.output  # the diff's own verdict (tier 2 across batch sizes: tokens only)
    assert "LOCATED" in r.stdout and "model.layers.0.mlp.down_proj" in r.stdout
    issue = cli("report", d, "--format", "issue").stdout
    assert "Where the bits part" in issue and "first_bitwise_op`: model.layers.0.mlp.down_proj (gemm)" in issue
    assert "in [[1, 1, 8]] -> out [1, 1, 8] (left)" in issue and "#" in issue.split("log scale")[1]
    page = cli("report", d, "--format", "html").stdout
    assert "Where the bits part" in page and "<svg" in page and "<script" not in page
    r = cli("pack", d, "-o", tmp_path / "d.tar.gz")
    assert r.exit_code == 0, r.output
    import tarfile

    assert "d/locate.json" in tarfile.open(tmp_path / "d.tar.gz").getnames()
    (d / "locate.json").write_text((d / "locate.json").read_text().replace("down_proj", "up_proj"))
    assert cli("verify", d).exit_code == 6  # sealed: an edit is caught


def test_a_hostile_locate_json_is_escaped_or_ignored(tmp_path, cli):
    folder = _check(tmp_path)
    locate(f"{folder}::batch_1", f"{folder}::batch_4")
    doc = json.loads((folder / "locate.json").read_text())
    doc["first_bitwise_op"]["module"] = "<script>alert(1)</script>"
    doc["line"] = "<img src=x onerror=alert(1)>"
    (folder / "locate.json").write_text(json.dumps(doc))
    page = cli("report", folder, "--format", "html").stdout
    assert "<script>alert" not in page and "<img src=x" not in page and "&lt;script&gt;" in page
    doc["step"] = "<b>"  # not the schema's: the section is left out
    (folder / "locate.json").write_text(json.dumps(doc))
    assert "Where the bits part" not in cli("report", folder, "--format", "html").stdout


def test_a_step_asked_for_on_equal_sides_locates_nothing(tmp_path):
    folder = _check(tmp_path)
    doc = locate(f"{folder}::run_0", f"{folder}::run_1", step=1).doc
    assert doc["step"]["what"] == "asked" and doc["captured_step"] == 1
    assert doc["status"] == "not_located" and doc["first_bitwise_op"] is None and doc["first_differing"] is None
    assert doc["layers"] and all(r["output_equal"] and r["inputs_equal"] for r in doc["layers"])


def test_diagnose_layers_probe(tmp_path, cli):
    folder = _check(tmp_path, diverge="prompt=1,pos=3,batch=4")
    r = cli("diagnose", folder, "--probe", "layers", "--out", tmp_path / "dg")
    assert r.exit_code == 0, r.output
    doc = artifacts.read_json(tmp_path / "dg" / "diagnosis.json", "diagnosis")
    assert doc["layers"]["status"] == "ran" and doc["layers"]["layer"] == "model.layers.0" and doc["layers"]["step"] == 3
    assert "layers (detllm locate): numerical defect: model.layers.0 (layer) differs" in r.stdout  # the category heads the line
    assert "first op whose inputs agree" in r.stdout
    assert artifacts.read_json(tmp_path / "dg" / "layers" / "locate.json", "locate")["captured"]["level_requested"] == "layers"


def test_a_served_run_has_no_internals_exit_4(tmp_path, cli):
    folder = _check(tmp_path)
    cfg = json.loads((folder / "run_config.json").read_text())
    cfg["config"]["backend"] = "openai"  # as a run against a served endpoint records it
    (folder / "run_config.json").write_text(json.dumps(cfg))
    r = cli("locate", f"{folder}::batch_1", f"{folder}::batch_4")
    assert r.exit_code == 4, r.output
    assert "has no internals locate can capture" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (folder / "locate.json").exists()


def test_a_fresh_process_side_is_re_run_here_and_says_so(tmp_path):
    folder = tmp_path / "f"
    detllm.check(backend="fake", options={"diverge": "prompt=0,pos=1,fresh=1,what=logprob"}, runs=2, fresh_process=1, tier=2,
                 max_new_tokens=4, out=folder)
    doc = locate(f"{folder}::run_0", f"{folder}::run_1").doc
    assert doc["status"] == "not_reproduced"  # the difference lives in the fresh process only
    assert doc["right"]["reproduced"] is False and any("fresh process" in n for n in doc["right"]["notes"])


def test_layer_boundaries_without_inputs_take_the_previous_boundary_as_input():
    """One engine's layer boundaries against another's (llama.cpp's l_out-N carry no inputs): the first layer
    whose previous boundary agrees and whose own output differs is named."""
    import numpy as np

    from detllm.backends.base import CapturedTensor
    from detllm.locate.align import pair_up
    from detllm.locate.rule import judge

    def side(moved: bool):
        h = np.arange(12, dtype=np.float32).reshape(3, 4)
        out = [CapturedTensor("model.embed_tokens", "embedding", 0, h)]
        for i in range(3):
            h = h * 2 + (np.float32(1e-3) if moved and i >= 1 else 0)
            out.append(CapturedTensor(f"model.layers.{i}", "layer", i + 1, h.copy()))
        return out

    pairs, _, _ = pair_up(side(False), side(True))
    verdict = judge(pairs)
    assert verdict.first_bitwise.left.name == "model.layers.1"
    assert [p.inputs_inferred for p in pairs] == [False, True, True, True]
    assert [p.inputs_equal for p in pairs] == [None, True, True, False]


def test_a_verdict_asked_only_where_to_search_next_evaluates_no_float64_reference():
    """judge(evaluate=False) (the search's verdicts before the last capture) calls no record's reeval
    and leaves first_beyond None; judge() on the same pairs evaluates and names the op beyond tolerance."""
    import numpy as np

    from detllm.backends.base import CapturedTensor
    from detllm.locate.align import pair_up
    from detllm.locate.rule import judge

    calls: list[str] = []

    def side(moved: bool):
        x = np.ones((3, 4), dtype=np.float32)
        y = x * 2 + (np.float32(1e-2) if moved else 0)
        out = [CapturedTensor("model.embed_tokens", "embedding", 0, x),
               CapturedTensor("model.layers.0", "layer", 1, y, inputs=[x], input_names=["arg0"])]
        for t in out:
            def run(t=t):
                calls.append(t.name)
                t.ref_error, t.reeval = 1e-7, None
            t.reeval = run
        return out

    pairs, _, _ = pair_up(side(False), side(True))
    quick = judge(pairs, evaluate=False)
    assert quick.first_bitwise.left.name == "model.layers.0" and quick.first_beyond is None and calls == []
    full = judge(pairs)
    assert full.first_beyond is full.first_bitwise and calls == ["model.layers.0", "model.layers.0"]
