"""sweep: grid parsing, Wilson intervals, cell labels, and a real grid on the fake backend
(each cell a real run in a worker process) whose drift follows the batch-size axis."""

from __future__ import annotations

import json

import pytest

from detllm.artifacts import read_json
from detllm.diagnose.sweep import judge_cell, parse_axes, wilson
from detllm.errors import UsageError


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
    assert by[("8", "1")]["wilson_95"][0] > 0.0 and by[("2", "1")]["wilson_95"][0] == 0.0
    assert "batch_size=8, threads=2" in (tmp_path / "s" / "sweep.txt").read_text()
    pytest.importorskip("matplotlib")
    assert doc["heatmap"] == "heatmap.png" and (tmp_path / "s" / "heatmap.png").stat().st_size > 1000


def test_bad_cell_value_is_refused_before_anything_runs(cli, tmp_path):
    r = cli("sweep", "--backend", "fake", "--axis", "dtype=float32,float64", "--out", tmp_path / "s")
    assert r.exit_code == 2 and "float64" in r.output and not (tmp_path / "s").exists()
