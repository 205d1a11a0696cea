"""Verdicts a new user met on real training (issue 31 §3): two packs that differ only in --threads
and are bitwise equal at every step PASS, naming the difference; a loss moved far beyond the
training dtype's rounding (a --script whose loss is scaled by state no seed reaches) is not called
numerics.
"""

from __future__ import annotations

import json

import pytest

from detllm.training.check import train_check
from detllm.training.verdict import EPSILON, ROUNDINGS_FAR, first_divergence

NOISY = '''
import sys
import torch

def make():
    model = torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(0, 32, (16, 6), generator=torch.Generator().manual_seed(1))
    batches = [data[i:i + 4] for i in range(0, 16, 4)]
    # state no seed reaches: how many runs this process made before (0 for run 0, 1 for run 1), so the
    # loss of run 1 is scaled by 1 + 1e-3, as an unseeded noise term of that size would (not left to chance)
    runs = sys.__dict__.setdefault("_detllm_test_runs", [0])
    scale = 1 + 1e-3 * runs[0]
    runs[0] += 1

    def loss_fn(m, ids):
        loss = torch.nn.functional.cross_entropy(m(ids[:, :-1]).reshape(-1, 32), ids[:, 1:].reshape(-1))
        return loss * scale

    return model, opt, batches, loss_fn
'''


@pytest.mark.engine
def test_packs_differing_only_in_threads_with_equal_bits_pass_and_name_it(tmp_path, cli):
    one = train_check(out=tmp_path / "t1", steps=3, threads=1, repeats=1, fresh_process=0, checkpoint_every=None)
    two = train_check(out=tmp_path / "t2", steps=3, threads=2, repeats=1, fresh_process=0, checkpoint_every=None)
    assert one.exit_code == 0 and two.exit_code == 0
    steps = [[{k: v for k, v in json.loads(line).items() if k not in ("seconds", "config_sha256", "h")}
              for line in (p / "steps.jsonl").read_text().splitlines()] for p in (tmp_path / "t1", tmp_path / "t2")]
    assert steps[0] == steps[1]  # every record but H(config) and what chains it (h) is bitwise equal: the premise
    res = cli("diff", tmp_path / "t1", tmp_path / "t2", "--out", tmp_path / "d")
    assert res.exit_code == 0, res.output
    assert "diff: PASS" in res.output and "train_config.json differs in: threads, which changed no bit" in res.output
    doc = json.loads((tmp_path / "d" / "train_diff.json").read_text())
    assert doc["verdict"] == "PASS" and doc["config_differs"] == ["threads"] and doc["first_divergence"] is None


@pytest.mark.engine
def test_a_loss_moved_far_beyond_rounding_is_not_called_numerics(tmp_path, cli):
    (tmp_path / "noisy.py").write_text(NOISY)
    out = train_check(script=f"{tmp_path / 'noisy.py'}:make", steps=2, repeats=1, fresh_process=0, out=tmp_path / "p")
    assert out.exit_code == 1
    d = out.report["first_divergence"]
    assert d["step"] == 0 and d["cause"] == "unseeded", d
    assert "unseeded random source or data-dependent code" in d["detail"] and "|Δloss|" in d["detail"]
    assert float(d["detail"].split(" float32 roundings")[0].rsplit(" ", 1)[1]) > 8000  # 1e-3 / 2^-23 = 8389
    assert cli("verify", tmp_path / "p").exit_code == 0  # and verify re-derives that cause from the records


def _records(loss_b, norm_b):
    t = {"w": {"grad_sha256": "a" * 64, "value_sha256": "b" * 64, "grad_l2": 1.0, "grad_max_abs": 1.0,
               "value_l2": 1.0, "value_max_abs": 1.0}}
    g = {"artifact_type": "train_genesis", "run": 0, "seed": 0, "config_sha256": "c" * 64, "params_sha256": "d" * 64, "h": "e" * 64}
    step = {"artifact_type": "train_step", "run": 0, "step": 0, "rng_sha256": "f" * 64, "batch_sha256": "0" * 64, "samples": [1],
            "loss": 4.0, "grad_norm": 2.0, "grads_sha256": "1" * 64, "params_sha256": "2" * 64, "h": "3" * 64, "tensors": t}
    other = {**step, "loss": loss_b, "grad_norm": norm_b, "tensors": {"w": {**t["w"], "grad_sha256": "9" * 64}}}
    return [g, step], [g, other]


@pytest.mark.parametrize("loss_b,norm_b,dtype,cause", [
    (4.0 * (1 + 3 * EPSILON["float32"]), 2.0, "float32", "numerics"),          # 3 roundings: accumulation order
    (4.0, 2.0 * (1 + 50 * EPSILON["float32"]), "float32", "numerics"),          # the gradient norm, 50 roundings
    (4.0 * (1 + 2.6e-3), 2.0, "float32", "unseeded"),                           # the trial's 0.26 %: ~2e4 roundings
    (4.0, 2.0 * (1 + 2 * ROUNDINGS_FAR * EPSILON["float32"]), "float32", "unseeded"),
    (4.0 * (1 + 2.6e-3), 2.0, "bfloat16", "numerics"),                          # a third of one bfloat16 rounding
])
def test_the_cause_weighs_the_change_against_the_dtypes_rounding(loss_b, norm_b, dtype, cause):
    ref, other = _records(loss_b, norm_b)
    d = first_divergence(ref, other, run=1, dtype=dtype)
    assert d["where"] == "grad" and d["cause"] == cause, d
    assert f"{dtype} roundings" in d["detail"]
