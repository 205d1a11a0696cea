"""`detllm models` lists the built-ins; `models export` writes a plain HF folder that transformers loads."""

from __future__ import annotations

import pytest

from detllm.core.hashing import sha256_file
from detllm.models import builtin_path


def test_models_lists_builtins(cli):
    r = cli("models")
    assert r.exit_code == 0
    assert r.stdout.startswith("tiny ") and "smollm2-135m" in r.stdout


@pytest.mark.engine
def test_export_tiny_as_plain_hf_folder(cli, tmp_path):
    dest = tmp_path / "tiny"
    r = cli("models", "export", "tiny", dest)
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert sha256_file(dest / "model.safetensors") == sha256_file(builtin_path("tiny") / "model.safetensors")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoTokenizer.from_pretrained(dest)
    assert AutoModelForCausalLM.from_pretrained(dest).config.num_hidden_layers == 2


def test_export_refuses_a_non_empty_destination(cli, tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    r = cli("models", "export", "tiny", tmp_path)
    assert r.exit_code == 2 and "exists and is not empty" in r.stderr


def test_export_unknown_format(cli, tmp_path):
    r = cli("models", "export", "tiny", tmp_path / "x", "--format", "onnx")
    assert r.exit_code == 2 and "--format must be hf or gguf" in r.stderr
    assert not (tmp_path / "x").exists()
