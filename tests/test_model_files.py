"""A corrupt or truncated model is one line naming the file, exit 2, nothing written (issue 11).

modelfiles.check_model_files reads headers and JSON only; the unit tests build real files of
each kind (the built-in tiny model exported as HF and GGUF) and break them the ways a failed
download does. The engine tests show each backend refuses them at its load boundary."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from detllm.core.errors import UsageError
from detllm.core.modelfiles import check_model_files
from detllm.models import builtin_path


@pytest.fixture(scope="module")
def tiny_hf() -> Path:
    return builtin_path("tiny", "hf")


@pytest.fixture(scope="module")
def tiny_gguf() -> Path:
    return builtin_path("tiny", "gguf") / "model.gguf"


def broken_copy(src: Path, dest: Path, name: str, how) -> Path:
    shutil.copytree(src, dest)
    how(dest / name)
    return dest


def truncate(n: int):
    def cut(p: Path) -> None:
        p.write_bytes(p.read_bytes()[:n])
    return cut


def overwrite(text: str):
    return lambda p: p.write_text(text)


def test_intact_models_pass(tiny_hf, tiny_gguf):
    check_model_files(tiny_hf)
    check_model_files(tiny_gguf)


@pytest.mark.parametrize("name,how,needle", [
    ("model.safetensors", truncate(1000), "its header claims"),
    ("model.safetensors", truncate(4), "shorter than a safetensors header"),
    ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:-100]), "(truncated)"),
    ("config.json", overwrite('{"model_type": '), "not valid JSON"),
    ("tokenizer.json", overwrite('{"version": "1.0", "trunc'), "not valid JSON"),
    ("generation_config.json", lambda p: p.write_bytes(b"\xff\xfe\x00"), "not valid JSON"),
])
def test_a_broken_hf_folder_names_the_file(tiny_hf, tmp_path, name, how, needle):
    folder = broken_copy(tiny_hf, tmp_path / "m", name, how)
    with pytest.raises(UsageError, match=needle) as info:
        check_model_files(folder)
    assert info.value.message.startswith(f"model file {str(folder / name)!r} is unreadable or corrupt")


@pytest.mark.parametrize("cut,needle", [(100, "truncated GGUF header"), (1_000_000, "(truncated)"), (3, "no GGUF magic")])
def test_a_truncated_gguf_names_the_file(tiny_gguf, tmp_path, cut, needle):
    p = tmp_path / "model.gguf"
    p.write_bytes(tiny_gguf.read_bytes()[:cut])
    with pytest.raises(UsageError, match=needle):
        check_model_files(p)


@pytest.mark.engine
@pytest.mark.parametrize("name,how", [("model.safetensors", truncate(1000)), ("config.json", overwrite("{")),
                                      ("tokenizer.json", overwrite("[1, 2"))])
def test_hf_backend_refuses_a_corrupt_model_in_one_line(cli, tiny_hf, tmp_path, name, how):
    folder = broken_copy(tiny_hf, tmp_path / "m", name, how)
    out = tmp_path / "out"
    r = cli("run", "--model", folder, "--out", out, "--no-progress")
    assert r.exit_code == 2, r.output
    assert f"model file {str(folder / name)!r} is unreadable or corrupt" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert not out.exists()


@pytest.mark.engine
def test_llamacpp_backend_refuses_a_truncated_gguf_in_one_line(cli, tiny_gguf, tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(tiny_gguf.read_bytes()[:1_000_000])
    out = tmp_path / "out"
    r = cli("run", "--backend", "llamacpp", "--model", p, "--out", out, "--no-progress")
    assert r.exit_code == 2, r.output
    assert f"model file {str(p)!r} is unreadable or corrupt: tensor" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()
