"""Built-in models: the tiny GGUF carries exactly the HF weights and vocabulary, builds are
byte-identical across cache folders, and the GGUF header reader agrees with `gguf`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from detllm.core.errors import UsageError
from detllm.models import builtin_path, export_model
from detllm.models.gguf import permute_qk, read_gguf, tensor_map

np = pytest.importorskip("numpy")
gguf = pytest.importorskip("gguf")
safetensors_numpy = pytest.importorskip("safetensors.numpy")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): _sha(p) for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tiny_hf() -> Path:
    return builtin_path("tiny", "hf")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("export") / "tiny-gguf"
    export_model("tiny", dest, "gguf")
    return dest / "model.gguf"


def test_tiny_gguf_tensors_equal_hf_weights(tiny_hf, tiny_gguf):
    hf = safetensors_numpy.load_file(str(tiny_hf / "model.safetensors"))
    config = json.loads((tiny_hf / "config.json").read_text())
    reader = gguf.GGUFReader(str(tiny_gguf))
    tensors = {t.name: t for t in reader.tensors}
    mapping = tensor_map(config)
    assert set(tensors) == {g for _, g, _ in mapping}
    assert {h for h, _, _ in mapping} == set(hf), "every HF weight is exported, nothing else"
    for hf_name, gguf_name, heads in mapping:
        t = tensors[gguf_name]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, gguf_name
        want = hf[hf_name] if heads is None else permute_qk(hf[hf_name], heads)
        got = np.asarray(t.data).reshape(want.shape)
        assert np.array_equal(got, want), f"{gguf_name} differs from {hf_name}"


def test_permute_qk_is_a_row_permutation(tiny_hf):
    hf = safetensors_numpy.load_file(str(tiny_hf / "model.safetensors"))
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    p = permute_qk(q, 2)
    assert not np.array_equal(p, q), "the permutation must move rows, or llama.cpp's rope would be wrong"
    assert sorted(map(bytes, p)) == sorted(map(bytes, q)), "rows are moved, never changed"


def test_tiny_gguf_vocabulary_matches_hf_tokenizer(tiny_hf, tiny_gguf):
    tok = json.loads((tiny_hf / "tokenizer.json").read_text(encoding="utf-8"))
    info = read_gguf(tiny_gguf)
    tokens = info.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 512
    for text, i in tok["model"]["vocab"].items():
        assert tokens[i] == text
    assert tokens[0] == "<|endoftext|>" and info.metadata["tokenizer.ggml.token_type"][0] == 3  # control
    assert info.metadata["tokenizer.ggml.merges"] == [" ".join(m) for m in tok["model"]["merges"]]
    assert info.metadata["tokenizer.ggml.add_bos_token"] is False  # the HF tokenizer adds no BOS either
    assert info.metadata["tokenizer.ggml.pre"] == "gpt-2"
    assert info.quantization == "F32"
    assert info.token_bytes()[tok["model"]["vocab"]["Ġthe"]] == b" the"


def test_header_reader_agrees_with_gguf_package(tiny_gguf):
    ours = read_gguf(tiny_gguf)
    theirs = gguf.GGUFReader(str(tiny_gguf))
    assert set(ours.metadata) == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            want = field.contents()
            got = ours.metadata[key]
            assert got == pytest.approx(want) if isinstance(want, float) else got == want, key
    assert ours.tensor_types == {t.name: int(t.tensor_type) for t in theirs.tensors}
    assert ours.context_length == 512 and ours.architecture == "llama"


def test_header_reader_rejects_other_files(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all, just bytes")
    with pytest.raises(ValueError):
        read_gguf(bad)


def test_tiny_builds_are_byte_identical_across_caches(tmp_path, monkeypatch, tiny_gguf):
    trees = []
    for name in ("a", "b"):
        monkeypatch.setenv("DETLLM_CACHE", str(tmp_path / name))
        hf = builtin_path("tiny", "hf")
        gg = builtin_path("tiny", "gguf")
        assert hf.is_relative_to(tmp_path / name) and gg.is_relative_to(tmp_path / name)
        trees.append((_tree(hf), _tree(gg)))
    assert trees[0] == trees[1], "same seed, same bytes"
    assert trees[0][1]["model.gguf"] == _sha(tiny_gguf), "an export is the cached file"
    assert read_gguf(tmp_path / "a" / "models" / "tiny-v1-gguf" / "model.gguf").tokenizer_sha256() == \
        read_gguf(tiny_gguf).tokenizer_sha256(), "tokenizer identity is by content, not path"


def test_gguf_tokenizer_hash_changes_with_the_vocabulary(tmp_path, tiny_hf):
    from detllm.models.gguf import build_tiny_gguf

    base = read_gguf(builtin_path("tiny", "gguf") / "model.gguf").tokenizer_sha256()
    changed = tmp_path / "hf"
    changed.mkdir()
    for p in tiny_hf.iterdir():
        if p.is_file():
            (changed / p.name).write_bytes(p.read_bytes())
    tok = json.loads((changed / "tokenizer.json").read_text(encoding="utf-8"))
    tok["model"]["merges"] = tok["model"]["merges"][:-1]  # drop one merge rule
    (changed / "tokenizer.json").write_text(json.dumps(tok), encoding="utf-8")
    build_tiny_gguf(changed, tmp_path / "out")
    assert read_gguf(tmp_path / "out" / "model.gguf").tokenizer_sha256() != base


def test_export_gguf_refuses_a_non_empty_destination(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(UsageError):
        export_model("tiny", tmp_path, "gguf")
