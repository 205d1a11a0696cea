"""The five scenarios of issue 23 on real training of `tiny` (dropout on): an honest run passes; a
repeat from another seed fails naming the seed; 1e-10 added to one gradient at step k is found at
step k in that parameter; weights edited after training fail the final commitment while every
logged loss matches; a checkpoint with 32 bytes flipped is refused before it is loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from detllm.cli import app
from detllm.core.errors import ArtifactError, IntegrityError
from detllm.training.chain import check_chain
from detllm.training.check import train_check
from detllm.training.checkpoint import load_checkpoint

TAMPERED = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def honest(tmp_path_factory):
    """Run 0, a repeat in this process and one in a fresh process, 4 steps, checkpoints every 2."""
    out = tmp_path_factory.mktemp("train") / "pack"
    return train_check(steps=4, seed=0, out=out, threads=1, repeats=1, fresh_process=1, checkpoint_every=2)


def _steps(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_honest_run_passes(honest):
    assert honest.exit_code == 0
    rep = honest.report
    assert rep["verdict"] == "PASS" and rep["first_divergence"] is None
    assert [r["process"] for r in rep["runs"]] == ["reference", "same", "fresh"]
    assert len({r["head"] for r in rep["runs"]}) == 1  # the three chains end on one commitment
    assert all(c["equal"] for c in rep["comparisons"])
    assert (honest.out_dir / "manifest.json").is_file() and not (honest.out_dir / "detllm.partial").exists()
    assert [r.steps for r in check_chain(honest.out_dir).runs] == [4, 4, 4]
    index = json.loads((honest.out_dir / "checkpoints.json").read_text())
    assert [c["boundary"] for c in index["checkpoints"]] == [0, 2, 4]


def test_dropout_draws_random_numbers(honest):
    """The runs agree because the RNG was reproduced, not because nothing was random: the RNG state
    moves from step to step (dropout masks and batch offsets are drawn from it)."""
    steps = _steps(honest.out_dir / "steps.jsonl")[1:]
    assert len({s["rng_sha256"] for s in steps}) == len(steps)
    cfg = json.loads((honest.out_dir / "train_config.json").read_text())
    assert cfg["task"]["attention_dropout"] == 0.1


def test_cli_exit_code_and_verdict(tmp_path):
    res = CliRunner().invoke(app, ["train-check", "--steps", "2", "--fresh-process", "0", "--threads", "1", "--out", str(tmp_path / "p")])
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("PASS: 2 runs bitwise equal at every one of 2 steps")  # the checkpoints' size went to stderr first
    assert res.stderr.startswith("checkpoints: 3 × ~5.51 MB")


@pytest.mark.parametrize("args,says", [
    (["--steps", "0"], "--steps 0"),
    (["--seed", str(2**53)], "--seed"),
    (["--repeats", "0", "--fresh-process", "0"], "at least one repeat"),
    (["--batch-size", "3", "--grad-accumulation", "2"], "must divide the batch size"),
    (["--test-option", "grad_add=1:model.no_such.weight:1e-10"], "has no parameter 'model.no_such.weight'"),
    (["--test-option", "grad_add=1:x"], "is not repeat_seed=SEED or grad_add"),
])
def test_cli_refuses_bad_input_in_one_line(tmp_path, args, says):
    res = CliRunner().invoke(app, ["train-check", *args, "--out", str(tmp_path / "p")])
    assert res.exit_code == 2 and not (tmp_path / "p").exists() and not (tmp_path / "p.checkpoints").exists()
    assert res.output.count("\n") == 1 and res.output.startswith("detllm: error: ") and says in res.output


def test_another_seed_fails_naming_the_seed(tmp_path):
    o = train_check(steps=2, out=tmp_path / "p", threads=1, repeats=1, fresh_process=0, checkpoint_every=None,
                    test_options={"repeat_seed": {"run": 1, "seed": 1}})
    assert o.exit_code == 1
    d = o.report["first_divergence"]
    assert (d["where"], d["cause"], d["step"]) == ("seed", "seed", 0)
    assert "seed 1" in d["detail"] and "seed 0" in d["detail"]
    assert o.report["runs"][1]["seed"] == 1
    check_chain(o.out_dir)  # the repeat's chain starts from its own seed and still checks out


def test_gradient_tamper_is_found_at_its_step_and_parameter(tmp_path):
    k = 2
    o = train_check(steps=4, out=tmp_path / "p", threads=1, repeats=1, fresh_process=0, checkpoint_every=None,
                    test_options={"grad_add": {"run": 1, "step": k, "parameter": TAMPERED, "value": 1e-10}})
    assert o.exit_code == 1
    d = o.report["first_divergence"]
    assert (d["step"], d["where"], d["parameter"], d["cause"]) == (k, "grad", TAMPERED, "test_option")
    assert d["parameters_differing"] >= 1
    # the bits changed (float32 elements with |g| >= ~2e-3 round a 1e-10 change away; the small ones do not)
    assert d["max_abs_diff"] is not None and 0 < d["max_abs_diff"] <= 2e-10
    ref, rep = _steps(o.out_dir / "steps.jsonl"), _steps(o.out_dir / "repeats" / "run_1.jsonl")
    assert [a["h"] == b["h"] for a, b in zip(ref[1:], rep[1:])] == [True, True, False, False]
    assert ref[1 + k]["tensors"][TAMPERED]["grad_sha256"] != rep[1 + k]["tensors"][TAMPERED]["grad_sha256"]


def _final_weights(honest) -> Path:
    index = json.loads((honest.out_dir / "checkpoints.json").read_text())
    last = index["checkpoints"][-1]
    return honest.checkpoints_dir / last["dir"] / "model.safetensors"


def test_weights_edited_after_training_fail_the_final_commitment(honest, tmp_path):
    from safetensors.torch import load_file, save_file

    final = _final_weights(honest)
    assert check_chain(honest.out_dir, weights=final).weights.startswith("matched")
    tensors = load_file(str(final))
    tensors[TAMPERED] = tensors[TAMPERED] + 1e-6  # a small substitution
    edited = tmp_path / "model.safetensors"
    save_file(tensors, str(edited))
    with pytest.raises(IntegrityError) as err:
        check_chain(honest.out_dir, weights=edited)
    assert "final commitment" in err.value.message and TAMPERED in err.value.message
    # every logged loss still matches an honest repeat: only the hash tells
    losses = [s["loss"] for s in _steps(honest.out_dir / "steps.jsonl")[1:]]
    assert losses == [s["loss"] for s in _steps(honest.out_dir / "repeats" / "run_2.jsonl")[1:]]


@pytest.fixture
def checkpoint_copy(honest, tmp_path):
    index = json.loads((honest.out_dir / "checkpoints.json").read_text())
    entry = index["checkpoints"][1]
    dest = tmp_path / entry["dir"]
    shutil.copytree(honest.checkpoints_dir / entry["dir"], dest)
    return dest, entry["descriptor_sha256"]


@pytest.fixture
def loads(monkeypatch):
    """Records every parse of safetensors bytes, to prove a refusal came before it."""
    import safetensors.torch

    calls = []
    real = safetensors.torch.load
    monkeypatch.setattr(safetensors.torch, "load", lambda data: calls.append(len(data)) or real(data))
    return calls


def test_checkpoint_loads_when_intact(checkpoint_copy, loads):
    d, sha = checkpoint_copy
    ckpt = load_checkpoint(d, sha)
    assert ckpt.boundary == 2 and len(loads) == 2


def test_flipped_checkpoint_is_refused_before_loading(checkpoint_copy, loads):
    d, sha = checkpoint_copy
    p = d / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[2048:2080] = bytes(b ^ 0xFF for b in data[2048:2080])
    p.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="model.safetensors: sha256 .* refused before loading"):
        load_checkpoint(d, sha)
    assert loads == []


def test_edited_descriptor_is_refused_by_the_index_digest(checkpoint_copy, loads):
    d, sha = checkpoint_copy
    doc = json.loads((d / "checkpoint.json").read_text())
    doc["files"][0]["sha256"] = "0" * 64
    (d / "checkpoint.json").write_text(json.dumps(doc))
    with pytest.raises(IntegrityError, match="not the one the pack's index holds"):
        load_checkpoint(d, sha)
    assert loads == []


def test_checkpoint_without_rng_state_is_not_resumable(checkpoint_copy, loads):
    d, _ = checkpoint_copy
    doc = json.loads((d / "checkpoint.json").read_text())
    doc["files"] = [f for f in doc["files"] if f["path"] != "rng.json"]
    doc["rng_sha256"] = None
    (d / "checkpoint.json").write_text(json.dumps(doc))
    (d / "rng.json").unlink()
    with pytest.raises(ArtifactError) as err:
        load_checkpoint(d)
    assert "not resumable" in err.value.message and "\n" not in err.value.one_line()
    assert loads == []
