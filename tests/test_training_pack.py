"""A training pack as a repro pack, on real training of `tiny`: verify offline without torch, each
tamper of the integrity checks fails it (exit 6), `replay --sample 2/8` re-runs two segments from
their checkpoints onto their commitments, `diff` of two packs with different seeds names step 0
and a parameter with max |Δ|, `pack --with-checkpoints` carries the checkpoints only when asked.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile

import pytest

from detllm.runfolder.integrity import seal
from detllm.training.check import train_check

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """Two real training packs of 8 steps: A (seed 0, a checkpoint at every step) and B (seed 1,
    checkpoints at 0 and 8 only). One repeat each, in this process."""
    root = tmp_path_factory.mktemp("train-packs")
    a = train_check(out=root / "A", steps=8, seed=0, repeats=1, fresh_process=0, checkpoint_every=1)
    b = train_check(out=root / "B", steps=8, seed=1, repeats=1, fresh_process=0, checkpoint_every=None)
    assert a.exit_code == 0 and b.exit_code == 0
    return root / "A", root / "B"


def _copy(src, dest):
    shutil.copytree(src, dest)
    shutil.copytree(src.parent / (src.name + ".checkpoints"), dest.parent / (dest.name + ".checkpoints"))
    return dest


def test_verify_passes_offline_without_torch(packs):
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "from detllm.commands.verify import verify\n"
            f"r = verify({str(packs[0])!r})\n"
            "print('\\n'.join(r.lines()))\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "18 step records chained" in res.stdout and "verdict PASS re-derived" in res.stdout
    assert "9 of 9 checked by digest down to H(θ)" in res.stdout


def _lines(path):
    return path.read_text().splitlines(keepends=True)


def _flip(p):
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def _reorder(p):
    lines = _lines(p)
    lines[3], lines[4] = lines[4], lines[3]
    p.write_text("".join(lines))


def _truncate(p):
    p.write_text("".join(_lines(p)[:-1]))


def _edit(p):
    lines = _lines(p)
    rec = json.loads(lines[5])
    rec["loss"] = rec["loss"] + 1e-3
    lines[5] = json.dumps(rec, separators=(",", ":")) + "\n"
    p.write_text("".join(lines))


def _edit_params(p):
    lines = _lines(p)
    rec = json.loads(lines[5])
    name = sorted(rec["tensors"])[0]
    rec["tensors"][name]["value_sha256"] = "0" * 64
    lines[5] = json.dumps(rec, separators=(",", ":")) + "\n"
    p.write_text("".join(lines))


@pytest.mark.parametrize("tamper,reseal,says", [
    (_flip, False, "changed after sealing"),
    (_reorder, False, "changed after sealing"),
    (_truncate, False, "changed after sealing"),
    (_edit, False, "changed after sealing"),
    # the tamperer re-seals the manifest: the chain (or the report's re-derivation) still catches it
    (_reorder, True, "a step removed, repeated or reordered"),
    (_truncate, True, "holds 7 steps"),
    (_edit_params, True, "params_sha256 is not H(θ_4)"),
    (_edit, True, "its steps file shows a first difference at step 4"),
])
def test_each_tamper_fails_verify(packs, tmp_path, cli, tamper, reseal, says):
    pack = _copy(packs[0], tmp_path / "A")
    tamper(pack / "steps.jsonl")
    if reseal:
        (pack / "manifest.json").unlink()
        seal(pack)
    res = cli("verify", pack)
    assert res.exit_code == 6, res.output
    assert says in res.output


def test_a_flipped_checkpoint_fails_verify_and_replay(packs, tmp_path, cli):
    pack = _copy(packs[0], tmp_path / "A")
    model = tmp_path / "A.checkpoints" / "boundary_000004" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[2048:2080] = bytes(b ^ 0xFF for b in data[2048:2080])  # 32 bytes flipped at rest
    model.write_bytes(bytes(data))
    res = cli("verify", pack)
    assert res.exit_code == 6 and "boundary_000004/model.safetensors is missing or changed" in res.output
    res = cli("replay", pack, "--sample", "8/8", "--out", tmp_path / "r")
    assert res.exit_code == 6 and not (tmp_path / "r").exists()  # refused before anything ran or was written


def test_replay_sample_2_of_8_lands_on_the_commitments(packs, tmp_path, cli):
    res = cli("replay", packs[0], "--sample", "2/8", "--sample-seed", "5", "--out", tmp_path / "r", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["verdict"] == "PASS" and doc["sample"] == {"k": 2, "n": 8, "seed": 5}
    assert len(doc["segments"]) == 2 and all(s["landed"] and s["from"] == "checkpoint" for s in doc["segments"])
    committed = {json.loads(line)["step"]: json.loads(line)["h"] for line in _lines(packs[0] / "steps.jsonl")[1:]}
    for s in doc["segments"]:
        assert s["head"] == committed[s["stop"] - 1]
        assert (tmp_path / "r" / f"segment_{s['start']:06d}_{s['stop']:06d}.jsonl").is_file()
    for bad in ("0/8", "3/2", "16/16", "x"):
        res = cli("replay", packs[0], "--sample", bad, "--out", tmp_path / "bad")
        assert res.exit_code == 2, (bad, res.output)
    assert not (tmp_path / "bad").exists()


def test_diff_of_two_seeds_names_step_0_and_a_parameter(packs, tmp_path, cli):
    res = cli("diff", *packs, "--out", tmp_path / "d")
    assert res.exit_code == 1, res.output
    doc = json.loads((tmp_path / "d" / "train_diff.json").read_text())
    d = doc["first_divergence"]
    assert d["step"] == 0 and d["where"] == "seed" and d["cause"] == "seed"
    assert d["parameter"] == "lm_head.weight"  # the first parameter by name, and every gradient differs at step 0
    assert d["max_abs_diff"] is not None and d["max_abs_diff"] > 0  # re-run from both sides' checkpoints at boundary 0
    assert doc["config_differs"] == ["checkpoint_every", "seed"] and [g["step"] for g in doc["growth"]] == list(range(8))
    assert "first divergent step: step 0 (seed), first parameter lm_head.weight" in res.output
    assert doc["at_divergence"]["first_op"]["found"] is None and "batches of step 0 differ" in doc["at_divergence"]["first_op"]["why"]
    same = cli("diff", packs[0], packs[0])
    assert same.exit_code == 0 and "bitwise equal at every step" in same.output
    assert cli("diff", *packs, "--atol", "0.1").exit_code == 2


def test_pack_carries_checkpoints_only_when_asked(packs, tmp_path, cli):
    plain, full = tmp_path / "plain.tar.gz", tmp_path / "full.tar.gz"
    assert cli("pack", packs[0], "-o", plain).exit_code == 0
    assert cli("pack", packs[0], "-o", full, "--with-checkpoints").exit_code == 0
    with tarfile.open(plain) as t:
        assert not any("checkpoints/" in n for n in t.getnames())
    with tarfile.open(full) as t:
        names = t.getnames()
    assert "full/checkpoints/boundary_000008/model.safetensors" in names and "full/steps.jsonl" in names
    res = cli("verify", full)
    assert res.exit_code == 0 and "9 of 9 checked by digest" in res.output
    res = cli("replay", full, "--sample", "1/8", "--out", tmp_path / "r")  # the packed checkpoints, no --checkpoints
    assert res.exit_code == 0, res.output
    assert cli("pack", packs[0], "-o", tmp_path / "x.tar.gz", "--with-checkpoints", "--checkpoints", tmp_path).exit_code == 2


def test_axes_say_which_setting_changes_the_bits(tmp_path, cli):
    """--axis as sweep's: the base runs twice, each change once; micro-batching (with dropout on)
    changes the bits at step 0; the verdict says the base repeated itself."""
    res = cli("train-check", "--axis", "threads=1,2", "--axis", "grad_accumulation=1,2", "--steps", "2", "--out", tmp_path / "ax")
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "ax" / "axes.json").read_text())
    rows = {r["what"]: r for r in doc["cells"]}
    assert rows["base repeated"]["bits_changed"] is False
    acc = rows["grad_accumulation 1 -> 2"]["first_divergence"]
    assert acc["step"] == 0 and acc["where"] in ("grad", "loss") and acc["parameter"]
    assert "threads 1 -> 2" in rows  # measured either way; the figure goes in the report
    for bad in (["--axis", "lr=1,2"], ["--axis", "threads=1"], ["--axis", "threads=1,x"], ["--axis", "threads"]):
        res = cli("train-check", *bad, "--out", tmp_path / "bad")
        assert res.exit_code == 2 and not (tmp_path / "bad").exists(), (bad, res.output)


def test_parity_scores_a_checkpoints_trained_weights(packs, tmp_path):
    """parity --checkpoint: the hf-trained weights (checked by digest) on both sides; the same kernel
    gives the same bits on the prefill path, and the rollout differs from the untrained model's."""
    from detllm.training.parity import parity

    ckpt = packs[0].parent / "A.checkpoints" / "boundary_000008"
    from detllm.models import builtin_path
    from detllm.training.parity import trainer_logprobs

    outcome = parity(backend="hf", attn_implementation="eager", max_new_tokens=4, checkpoint=ckpt, out=tmp_path / "t")
    trained = outcome.doc
    assert f"weights: the checkpoint {ckpt} (checked by digest), on both sides" in outcome.text  # said, not only recorded
    assert trained["checkpoint"] == str(ckpt) and trained["paths"]["prefill"]["bitwise_equal"]
    seqs = [(s["prompt_ids"], s["token_ids"]) for s in trained["sequences"]]
    untrained = trainer_logprobs(builtin_path("tiny"), "float32", seqs, attn_implementation="eager")
    assert [s["trainer"] for s in trained["sequences"]] != untrained


def test_verify_weights_against_the_final_commitment(packs, tmp_path, cli):
    """Weights edited after training: every logged loss still matches, verify --weights fails."""
    from safetensors.torch import load_file, save_file

    final = packs[0].parent / "A.checkpoints" / "boundary_000008" / "model.safetensors"
    res = cli("verify", packs[0], "--weights", final)
    assert res.exit_code == 0 and "weights: matched: model.safetensors is θ_7" in res.output
    tensors = load_file(str(final))
    tensors["lm_head.weight"][0, 0] += 1e-6
    save_file(tensors, str(tmp_path / "edited.safetensors"))
    res = cli("verify", packs[0], "--weights", tmp_path / "edited.safetensors")
    assert res.exit_code == 6 and "is not the final commitment's H(θ_7)" in res.output and "lm_head.weight" in res.output
    assert cli("verify", packs[0], "--weights", tmp_path / "missing.safetensors").exit_code == 2


def test_first_op_inside_a_step(packs):
    """The tapped re-run of a step is itself repeatable (two re-runs of step 3 from checkpoint 3
    capture equal tensors everywhere), and the comparison names the first capture that differs."""
    import numpy as np

    from detllm.taps import Tap, Tapped
    from detllm.training.chain import load_config
    from detllm.training.diffing import first_op
    from detllm.training.opdiff import first_differing
    from detllm.training.pack import records

    config, _ = load_config(packs[0])
    step3 = records(packs[0] / "steps.jsonl")[4]
    same = first_op(packs[0], config, step3, None, packs[0], config, step3, None, 3)
    assert same["found"] is None and same["captured"][0] == same["captured"][1] > 20
    a = Tap([Tapped("model.embed_tokens", "embedding", 0, np.zeros(3)), Tapped("model.norm", "norm", 1, np.ones(3)),
             Tapped("lm_head.weight", "param_grad", 2, np.ones(2), phase="param_grad")])
    b = Tap([Tapped("model.embed_tokens", "embedding", 0, np.zeros(3)), Tapped("model.norm", "norm", 1, np.array([1, 1.5, 1])),
             Tapped("lm_head.weight", "param_grad", 2, np.zeros(2), phase="param_grad")])
    found = first_differing(a, b)
    assert found["name"] == "model.norm" and found["phase"] == "forward" and found["max_abs_diff"] == 0.5
