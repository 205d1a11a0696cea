"""Content hashes: files, weight sets, tokenizers, prompts, canonical JSON.

Identity is by content, never by path: the same tokenizer at two paths hashes the
same, and a weight changed in place hashes differently.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable

from .backends.base import ModelIdentity, WeightFile

_CHUNK = 1 << 20  # 1 MiB reads
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)
CONFIG_FILES = ("config.json", "generation_config.json")  # architecture and decoding defaults: part of the model
_memo: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256, per process


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_text(text: str) -> str:
    return sha256_bytes(text.encode("utf-8"))


def sha256_file(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _memo:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        _memo[key] = h.hexdigest()
    return _memo[key]


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8: the bytes every digest of JSON is taken over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def combine(pairs: Iterable[tuple[str, str]]) -> str:
    """One digest over sorted (name, sha256) pairs."""
    return sha256_bytes("".join(f"{n}\0{h}\n" for n, h in sorted(pairs)).encode())


def weight_paths(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def weight_files(folder: Path) -> tuple[WeightFile, ...]:
    files = weight_paths(folder)
    return tuple(WeightFile(str(p.relative_to(folder)), sha256_file(p), p.stat().st_size) for p in files)


def tokenizer_sha256(folder: Path) -> str:
    """Hash of the tokenizer files' contents (names relative, paths ignored)."""
    found = [(n, sha256_file(folder / n)) for n in TOKENIZER_FILES if (folder / n).is_file()]
    return combine(found)


def folder_identity(model_id: str, folder: Path, *, revision: str | None = None, fmt: str | None = None) -> ModelIdentity:
    weights = weight_files(folder)
    if fmt is None:
        fmt = "safetensors" if any(w.file.endswith(".safetensors") for w in weights) else "pytorch"
    return ModelIdentity(
        id=model_id,
        path=str(folder),
        revision=revision,
        format=fmt,
        weights=weights,
        weights_sha256=combine((w.file, w.sha256) for w in weights),
        tokenizer_sha256=tokenizer_sha256(folder),
        config_sha256=combine((n, sha256_file(folder / n)) for n in CONFIG_FILES if (folder / n).is_file()),
    )
