"""No secret from the environment reaches a run folder or its pack, byte for byte: planted
tokens, keys, passwords in URLs and token-shaped values in allow-listed variables."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

import detllm

PLANTED = {
    "HF_TOKEN": "hf_PlantedTokenValue0123456789",  # secret name, allow-listed prefix
    "VLLM_API_KEY": "planted-vllm-api-key-7f3a9",  # secret name, allow-listed prefix
    "MY_SECRET": "planted-my-secret-c0ffee",  # not allow-listed at all
    "HF_ENDPOINT": "https://planteduser:plantedpass-9d1@hub.invalid",  # password in a URL
    "DETLLM_NOTE": "hf_abcdefghijklmnopqrstu",  # token-shaped value under a harmless name
    "PYTORCH_NOTE": "ghp_PlantedGithubToken0123456789ab",
    "OMP_NOTE": "sk-plantedOpenAIkey0123456789",
}
# every value, and the parts a partial leak would show
NEEDLES = [v.encode() for v in PLANTED.values()] + [b"plantedpass-9d1", b"planteduser:", b"PlantedToken", b"abcdefghijklmnopqrstu"]


def assert_no_secrets(folder: Path, pack: Path) -> None:
    files = [p for p in folder.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"env.json", "run_config.json", "trace.jsonl", "manifest.json"}
    blobs = {str(p): p.read_bytes() for p in files}
    blobs[str(pack)] = gzip.decompress(pack.read_bytes())  # every member's bytes, headers included
    for name, data in blobs.items():
        for needle in NEEDLES:
            assert needle not in data, f"{needle!r} leaked into {name}"
    # the variables were seen (so this test can fail) and redacted, not dropped
    env_vars = json.loads((folder / "env.json").read_text())["env_vars"]
    for var in ("HF_TOKEN", "VLLM_API_KEY", "HF_ENDPOINT", "DETLLM_NOTE", "PYTORCH_NOTE", "OMP_NOTE"):
        assert env_vars[var] == "<redacted>", var
    assert "MY_SECRET" not in env_vars


def test_fake_check_and_pack_hold_no_secrets(cli, tmp_path):
    out = tmp_path / "run"
    r = cli("check", "--backend", "fake", "--out", out, "--no-progress", env=PLANTED)
    assert r.exit_code == 0, r.output
    assert_no_secrets(out, detllm.create_pack(out, tmp_path / "run.tar.gz"))


@pytest.mark.engine
def test_hf_check_and_pack_hold_no_secrets(cli, tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "run"
    r = cli("check", "--model", "tiny", "--runs", "2", "--max-new-tokens", "3", "--out", out, "--no-progress", env=PLANTED)
    assert r.exit_code == 0, r.output
    assert_no_secrets(out, detllm.create_pack(out, tmp_path / "run.tar.gz"))
