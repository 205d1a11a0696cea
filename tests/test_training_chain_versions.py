"""Packs of both chain versions, on real training of `tiny`: a pack written as before (chain
detllm-train/1, P by SHA-256, checkpoints included) still verifies down to its checkpoints and
weights and replays onto its commitments; a new pack is detllm-train/2 (P by BLAKE3); diff refuses
to compare two packs whose chains differ (their digests cannot agree), before anything is written."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest

from detllm.training import check, digest
from detllm.training.check import train_check

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chain-versions")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(check, "CHAIN", digest.CHAIN_1)  # what detllm wrote before detllm-train/2
        old = train_check(out=root / "v1", steps=3, seed=0, repeats=1, fresh_process=0, checkpoint_every=1)
    new = train_check(out=root / "v2", steps=3, seed=0, repeats=1, fresh_process=0, checkpoint_every=1)
    assert old.exit_code == 0 and new.exit_code == 0
    return root / "v1", root / "v2"


def _genesis(pack):
    return json.loads((pack / "steps.jsonl").read_text().splitlines()[0])


def _sha256_p(name: str, shape, data: bytes) -> str:
    head = b"detllm-train/1 tensor\x00" + struct.pack("<Q", len(name)) + name.encode() + struct.pack("<Q", 3) + b"F32"
    return hashlib.sha256(head + struct.pack("<Q", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape) + data).hexdigest()


def test_each_pack_names_its_chain_and_hashes_by_it(packs):
    from safetensors.numpy import load_file

    from detllm.models import builtin_path

    old, new = packs
    c_old, c_new = (json.loads((p / "train_config.json").read_text()) for p in packs)
    assert "chain" not in c_old and c_new["chain"] == "detllm-train/2"
    arrays = load_file(builtin_path("tiny") / "model.safetensors")
    name = sorted(arrays)[0]
    want = _sha256_p(name, arrays[name].shape, arrays[name].astype("<f4").tobytes())
    assert _genesis(old)["tensors"][name]["value_sha256"] == want  # P of /1, as before
    assert _genesis(new)["tensors"][name]["value_sha256"] != want
    desc = json.loads((old.parent / "v1.checkpoints" / "boundary_000000" / "checkpoint.json").read_text())
    assert "chain" not in desc
    desc = json.loads((new.parent / "v2.checkpoints" / "boundary_000000" / "checkpoint.json").read_text())
    assert desc["chain"] == "detllm-train/2"


@pytest.mark.parametrize("side", [0, 1])
def test_both_chains_verify_with_checkpoints_and_weights(packs, cli, side):
    pack = packs[side]
    final = pack.parent / f"{pack.name}.checkpoints" / "boundary_000003" / "model.safetensors"
    res = cli("verify", pack, "--weights", final)
    assert res.exit_code == 0, res.output
    assert "4 of 4 checked by digest down to H(θ)" in res.output and "weights: matched" in res.output


def test_the_old_chain_replays_onto_its_commitments(packs, cli, tmp_path):
    res = cli("replay", packs[0], "--out", tmp_path / "r")
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "r" / "train_replay.json").read_text())["verdict"] == "PASS"


def test_diff_refuses_packs_of_two_chains(packs, cli, tmp_path):
    res = cli("diff", *packs, "--out", tmp_path / "d")
    assert res.exit_code == 2, res.output
    assert "different chain versions (detllm-train/1, detllm-train/2)" in res.output
    assert not (tmp_path / "d").exists()
