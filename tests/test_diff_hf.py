"""Integration: `diff` on runs of the built-in tiny model through real transformers.

Runs are small (8 tokens, tier 2) and share this process, so the model loads once.
The run of the edited weights is a separate `detllm run` process, as it would be for
a user; the hf backend caches loaded models per process by path.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

import detllm
from detllm.runfolder.artifacts import validate
from detllm.cli import app

pytestmark = pytest.mark.engine
np = pytest.importorskip("numpy")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

SMALL = {"backend": "hf", "max_new_tokens": 8, "tier": 2}


def codes(causes: list[dict]) -> list[str]:
    return [c["code"] for c in causes]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("diffhf")
    exported = root / "tiny-export"
    r = CliRunner().invoke(app, ["models", "export", "tiny", str(exported)])
    assert r.exit_code == 0, r.output
    prompts = root / "other.txt"
    prompts.write_text("The capital of France is\nA completely different prompt\n")
    out = {
        "a": detllm.run(model="tiny", out=root / "a", **SMALL).out_dir,
        "b": detllm.run(model="tiny", out=root / "b", **SMALL).out_dir,
        "bf16": detllm.run(model="tiny", dtype="bfloat16", out=root / "bf16", **SMALL).out_dir,
        "prompts": detllm.run(model="tiny", prompts=prompts, out=root / "prompts", **SMALL).out_dir,
        "exported": detllm.run(model=str(exported), out=root / "exported", **SMALL).out_dir,
    }
    # one value of one weight changed in place: same folder, same path, different content
    weights = safetensors_numpy.load_file(str(exported / "model.safetensors"))
    weights["model.norm.weight"][3] += np.float32(0.5)
    safetensors_numpy.save_file(weights, str(exported / "model.safetensors"), metadata={"format": "pt"})
    edited = subprocess.run([sys.executable, "-m", "detllm", "run", "--model", str(exported), "--max-new-tokens", "8",
                             "--tier", "2", "--out", str(root / "edited"), "--no-progress"], capture_output=True, text=True, timeout=600)
    assert edited.returncode == 0, edited.stderr
    out["edited"] = root / "edited"
    return out


def diff(a, b, **kw) -> dict:
    report = detllm.diff(a, b, **kw).report
    validate(report, "report")
    return report


def test_same_model_twice_passes_bitwise(runs):
    r = diff(runs["a"], runs["b"])
    assert (r["status"], r["tier"]["effective"], r["causes"], r["info"]) == ("PASS", 2, [], [])
    assert r["comparisons"][0]["drift"]["max_abs_logprob_diff"] == 0.0


def test_the_same_files_at_another_path_are_neither_model_nor_tokenizer_mismatch(runs):
    r = diff(runs["a"], runs["exported"])
    assert r["status"] == "PASS"
    assert not {"MODEL_MISMATCH", "TOKENIZER_MISMATCH"} & set(codes(r["info"]))


def test_one_weight_changed_in_the_same_folder_is_model_mismatch(runs):
    r = diff(runs["exported"], runs["edited"])
    assert (r["status"], r["category"]) == ("FAIL", "MODEL_MISMATCH")
    ev = r["causes"][0]["evidence"]
    assert ev["same_path"] is True and ev["path"]["left"] == ev["path"]["right"]
    assert ev["files"] == [{"file": "model.safetensors", "left": ev["files"][0]["left"], "right": ev["files"][0]["right"]}]
    assert ev["files"][0]["left"] != ev["files"][0]["right"]
    assert "TOKENIZER_MISMATCH" not in codes(r["causes"])


def test_float32_vs_bfloat16_is_config_mismatch(runs):
    r = diff(runs["a"], runs["bf16"])
    assert (r["status"], r["category"]) == ("FAIL", "CONFIG_MISMATCH")
    ev = r["causes"][0]["evidence"]
    assert {"field": "config.dtype", "left": "float32", "right": "bfloat16"} in ev["fields"]
    assert r["first_divergence"]["noise_floor"] == 2.0**-4, "the noisier side's floor"


def test_different_prompt_files_are_prompt_mismatch(runs):
    r = diff(runs["a"], runs["prompts"])
    assert (r["status"], r["category"]) == ("FAIL", "PROMPT_MISMATCH")
    ev = r["causes"][0]["evidence"]
    assert [p["prompt_text"] for p in ev["right_only"]] == ["A completely different prompt"]
    assert r["comparisons"][0]["prompts_compared"] == 1 and r["comparisons"][0]["prompts_diverged"] == 0
