"""Segmented resume on real training of `tiny`, dropout on: 0->K straight equals 0->k, checkpoint,
restore in a fresh process, k->K, bit for bit at every step; and the control that gives the
equality its teeth: without the torch RNG state restored the dropout masks differ."""

from __future__ import annotations

import json

import pytest

from detllm.models import builtin_path
from detllm.training import checkpoint as ckpt_mod
from detllm.training.check import train_check
from detllm.training.child import run_fresh
from detllm.training.loop import RunRequest, run_steps
from detllm.training.verdict import step_differs

K, k = 4, 2


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume") / "pack"
    o = train_check(steps=K, seed=3, out=out, threads=1, repeats=1, fresh_process=0, checkpoint_every=k)
    assert o.exit_code == 0
    config = json.loads((out / "train_config.json").read_text())
    records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    entry = next(c for c in json.loads((out / "checkpoints.json").read_text())["checkpoints"] if c["boundary"] == k)
    return config, records, {"dir": str(o.checkpoints_dir / entry["dir"]), "descriptor_sha256": entry["descriptor_sha256"]}


def _request(config, resume, path) -> RunRequest:
    return RunRequest(config=config, model_path=str(builtin_path("tiny")), run=0, seed=config["seed"], stop=K,
                      steps_file=str(path), resume=resume)


def test_resume_in_a_fresh_process_is_bitwise_the_straight_run(straight, tmp_path):
    config, records, resume = straight
    res = run_fresh(_request(config, resume, tmp_path / "segment.jsonl"))
    assert [r["step"] for r in res.records] == [k, k + 1]  # no genesis: the segment starts at the checkpoint
    for got in res.records:
        want = records[1 + got["step"]]
        assert not step_differs(want, got), f"step {got['step']} differs after the resume"
        assert got["h"] == want["h"]  # the chain continues from the checkpoint's commitment


def test_without_the_torch_rng_state_the_dropout_masks_differ(straight, tmp_path, monkeypatch):
    """The same resume in this process, but the torch CPU generator re-seeded after the restore:
    the batch (its own generator) is the same, the dropout masks are not, so the gradients differ."""
    import torch

    config, records, resume = straight
    real = ckpt_mod.restore

    def restore_but_reseed(state, data):
        real(state, data)
        torch.manual_seed(12345)

    monkeypatch.setattr(ckpt_mod, "restore", restore_but_reseed)
    got = run_steps(_request(config, resume, tmp_path / "segment.jsonl")).records[0]
    want = records[1 + k]
    assert got["batch_sha256"] == want["batch_sha256"] and got["samples"] == want["samples"]
    assert got["rng_sha256"] != want["rng_sha256"]
    assert got["grads_sha256"] != want["grads_sha256"] and got["loss"] != want["loss"]
