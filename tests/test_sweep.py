"""sweep: grid parsing, Wilson intervals, cell labels, and a real grid on the fake backend
(each cell a real run in a worker process) whose drift follows the batch-size axis."""

from __future__ import annotations

import pytest

from detllm.runfolder.artifacts import read_json
from detllm.diagnose.sweep import judge_cell, parse_axes, wilson
from detllm.core.errors import UsageError

from .conftest import write_prompts


def test_wilson_interval_matches_the_textbook_values():
    lo, hi = wilson(0, 12)
    assert lo == 0.0 and hi == pytest.approx(0.2425, abs=1e-3)
    lo, hi = wilson(5, 10)
    assert (lo, hi) == (pytest.approx(0.2366, abs=1e-3), pytest.approx(0.7634, abs=1e-3))
    assert wilson(10, 10)[1] == pytest.approx(1.0) and wilson(10, 10)[0] == pytest.approx(0.7225, abs=1e-3)


@pytest.mark.parametrize("spec", ["batch_size", "batch_size=", "=1,2", "batch_size=1,x", "batch_size=1,1"])
def test_bad_axes_are_usage_errors(spec):
    with pytest.raises(UsageError):
        parse_axes([spec])


def test_axes_in_order_and_backend_options_allowed():
    assert parse_axes(["batch_size=1,8", "kv_type=f16,f32"]) == [("batch_size", ["1", "8"]), ("kv_type", ["f16", "f32"])]
    with pytest.raises(UsageError, match="twice"):
        parse_axes(["threads=1", "threads=2"])


def _rec(prompt, run, tokens, lps):
    return {"prompt_index": prompt, "run_index": run, "token_ids": tokens, "logprobs": lps}


def test_labels_unique_outputs_and_rate():
    ref = [_rec(0, r, [1, 2, 3], [-0.1, -0.2, -0.3]) for r in range(2)]
    assert judge_cell(ref, ref)["label"] == "stable"
    fragile = [_rec(0, 0, [1, 2, 3], [-0.1, -0.2, -0.3]), _rec(0, 1, [1, 2, 3], [-0.1, -0.2001, -0.3])]
    got = judge_cell(fragile, ref)
    assert got["label"] == "fragile" and got["unique_outputs_per_prompt"] == {0: 1}
    assert got["within_cell_max_abs_logprob_diff"] == pytest.approx(1e-4)
    unstable = [_rec(0, 0, [1, 2, 3], [-0.1] * 3), _rec(0, 1, [1, 5, 3], [-0.1] * 3)]
    got = judge_cell(unstable, ref)
    assert got["label"] == "unstable" and got["max_unique_outputs"] == 2
    assert (got["diverged"], got["observations"]) == (1, 2) and got["divergence_rate"] == 0.5


def test_sweep_on_fake_follows_the_batch_axis(cli, tmp_path):
    r = cli("sweep", "--backend", "fake", "--model", "fake", "--axis", "batch_size=1,2,8", "--axis", "threads=1,2",
            "--repeats", "2", "--max-new-tokens", "6", "--opt", "batch_drift=0.001", "--opt", "diverge=prompt=0,pos=2,batch=8",
            "--out", tmp_path / "s")
    assert r.exit_code == 0, r.output
    doc = read_json(tmp_path / "s" / "sweep.json", "sweep")
    assert len(doc["cells"]) == 6 and doc["reference_cell"] == {"batch_size": "1", "threads": "1"}
    by = {(c["cell"]["batch_size"], c["cell"]["threads"]): c for c in doc["cells"]}
    assert all(c["label"] == "stable" for c in doc["cells"])  # repeats in one process agree
    assert by[("1", "2")]["vs_reference_max_abs_logprob_diff"] == 0.0
    assert by[("2", "1")]["vs_reference_max_abs_logprob_diff"] == pytest.approx(0.001)
    assert by[("8", "1")]["diverged"] == 2 and by[("8", "1")]["observations"] == 8  # prompt 0, both repeats
    assert (by[("8", "1")]["prompts_diverged"], by[("8", "1")]["prompts_compared"]) == (1, 4)  # the unit of the interval
    assert by[("8", "1")]["prompt_wilson_95"][0] > 0.0 and by[("2", "1")]["prompt_wilson_95"][0] == 0.0
    assert "batch_size=8, threads=2" in (tmp_path / "s" / "sweep.txt").read_text()
    pytest.importorskip("matplotlib")
    assert doc["heatmap"] == "heatmap.png" and (tmp_path / "s" / "heatmap.png").stat().st_size > 1000


def test_bad_cell_value_is_refused_before_anything_runs(cli, tmp_path):
    r = cli("sweep", "--backend", "fake", "--axis", "dtype=float32,float64", "--out", tmp_path / "s")
    assert r.exit_code == 2 and "float64" in r.output and not (tmp_path / "s").exists()


def test_wilson_interval_counts_prompts_not_correlated_repeats():
    """4 prompts x 3 repeats, none diverging: the independent unit is the prompt, so the
    interval is wilson(0, 4) = [0, 0.49], not wilson(0, 12) = [0, 0.24] (review R12)."""
    cell = [_rec(p, r, [1, 2], [-0.1, -0.2]) for p in range(4) for r in range(3)]
    got = judge_cell(cell, cell)
    assert (got["prompts_diverged"], got["prompts_compared"]) == (0, 4) and got["observations"] == 12
    assert got["prompt_wilson_95"] == [0.0, pytest.approx(0.4899, abs=1e-3)]
    assert "wilson_95" not in got  # the old name counted prompts x repeats as trials
    # one prompt whose 3 repeats all differ is one diverging prompt of 4, not 3 diverging trials of 12
    moved = [_rec(p, r, [1, 3] if p == 0 else [1, 2], [-0.1, -0.2]) for p in range(4) for r in range(3)]
    got = judge_cell(moved, cell)
    assert (got["diverged"], got["prompts_diverged"]) == (3, 1)
    assert got["prompt_wilson_95"] == list(wilson(1, 4))


def test_null_logprob_follows_the_one_nan_rule():
    """null == null is no drift; null against a number is a difference (fragile) that is counted,
    never a maximum (review R9: it was a TypeError)."""
    both = [_rec(0, r, [1, 2], [None, -0.2]) for r in range(2)]
    got = judge_cell(both, both)
    assert got["label"] == "stable" and got["null_logprob_steps"] == 0 and got["within_cell_max_abs_logprob_diff"] == 0.0
    one = [_rec(0, 0, [1, 2], [None, -0.2]), _rec(0, 1, [1, 2], [-0.3, -0.2])]
    got = judge_cell(one, both)
    assert got["label"] == "fragile" and got["within_cell_max_abs_logprob_diff"] == 0.0
    assert got["null_logprob_steps"] == 1 and got["vs_reference_max_abs_logprob_diff"] == 0.0


def test_bad_backend_option_in_a_cell_is_refused_before_anything_runs(cli, tmp_path):
    """--opt values of each cell are parsed by the backend's Options before the grid starts (R11)."""
    r = cli("sweep", "--backend", "fake", "--model", "fake", "--axis", "max_tier=99,2", "--repeats", "2", "--out", tmp_path / "s")
    assert r.exit_code == 2 and "max_tier" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "s").exists()


def test_served_sweep_with_null_logprobs_and_an_erroring_first_cell(cli, tmp_path):
    """A real HTTP server whose first logprob is null (R9), and a first cell that errors at run
    time (prompt_as=ids needs /tokenize, which this server lacks): the sweep runs, and the
    reference is the first cell that ran, named as such (R11)."""
    from tests.test_openai_stub import Stub

    class NullFirst(Stub):
        def answer(self, body):
            doc = super().answer(body)
            if doc["choices"][0]["logprobs"]:
                doc["choices"][0]["logprobs"]["token_logprobs"][0] = None
            return doc

    stub = NullFirst()
    try:
        prompts = write_prompts(tmp_path / "p.jsonl", ("one", "two"))
        r = cli("sweep", "--backend", "openai", "--model", "stub-model", "--opt", f"base_url={stub.url}", "--axis", "prompt_as=ids,text",
                "--axis", "batch_size=1,2", "--repeats", "2", "--prompts", prompts, "--max-new-tokens", "3", "--tier", "2",
                "--out", tmp_path / "s")
    finally:
        stub.close()
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    doc = read_json(tmp_path / "s" / "sweep.json", "sweep")
    by = {(c["cell"]["prompt_as"], c["cell"]["batch_size"]): c for c in doc["cells"]}
    assert by[("ids", "1")]["status"] == "error" and "tokenize" in by[("ids", "1")]["error"]
    assert doc["reference_cell"] == {"prompt_as": "text", "batch_size": "1"}
    ran = [c for c in doc["cells"] if c["status"] == "ran"]
    assert len(ran) == 2 and all(c["label"] == "stable" and c["null_logprob_steps"] == 0 for c in ran)
    text = (tmp_path / "s" / "sweep.txt").read_text()
    assert "reference: prompt_as=text, batch_size=1 (the first cell, prompt_as=ids, batch_size=1, errored)" in text
