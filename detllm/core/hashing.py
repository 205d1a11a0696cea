"""Content hashes: files, weight sets, tokenizers, prompts, canonical JSON.

Identity is by content, never by path: the same tokenizer at two paths hashes the
same, and a weight changed in place hashes differently. `prehash` starts a model folder's
hashes on a thread of their own while the caller does other work (the hf backend: while
transformers imports its model classes).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import threading
import time
from pathlib import Path
from typing import Any, Iterable

from .identity import ModelIdentity, WeightFile

_CHUNK = 1 << 20  # 1 MiB reads
_PRE_CHUNK = 16 << 20  # prehash's reads: each takes the GIL back twice (read, hash), 16x fewer times than 1 MiB
_PRE_THREAD = "detllm-prehash"  # the thread's name, as a thread dump shows it
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
# (path, device, inode, size, mtime_ns, ctime_ns) -> (sha256, ns when the hash was taken), per process.
# mtime can be set back (os.utime, cp -p, rsync -t) but ctime cannot: every write or utime sets it.
_memo: dict[tuple, tuple[str, int]] = {}
_inflight: dict[tuple, threading.Event] = {}  # key -> set when the thread hashing it is done
_inflight_lock = threading.Lock()
RACY_NS = 2_000_000_000  # a file changed this close to its hashing is re-hashed (timestamps are coarse)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_text(text: str) -> str:
    return sha256_bytes(text.encode("utf-8"))


def sha256_file(path: Path, *, chunk: int = _CHUNK) -> str:
    """sha256 of the file's bytes, read `chunk` bytes at a time. A long-lived process (tests, a notebook, the API) re-uses an
    earlier hash only when nothing about the file can have changed since: same inode, size,
    mtime *and* ctime, and the file was last changed well before that hash was taken (git's
    "racy clean" rule: an edit within the timestamp granularity of the hash is not visible).
    A hash of the same file another thread is taking (prehash) is waited for, not taken twice;
    it is used when that thread started reading after this call began (as if read here), or when
    the racy-clean rule accepts it."""
    asked = time.time_ns()
    st = path.stat()
    key = (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    changed = max(st.st_mtime_ns, st.st_ctime_ns)
    hit = _memo.get(key)
    if hit is not None and changed < hit[1] - RACY_NS:
        return hit[0]
    with _inflight_lock:
        busy = _inflight.get(key)
        if busy is None:
            busy = _inflight[key] = threading.Event()
            mine = True
        else:
            mine = False
    if not mine:
        busy.wait()
        hit = _memo.get(key)
        if hit is not None and (hit[1] >= asked or changed < hit[1] - RACY_NS):
            return hit[0]
        return _hash_file(path, key, None, chunk)
    return _hash_file(path, key, busy, chunk)


def _hash_file(path: Path, key: tuple, busy: threading.Event | None, chunk: int = _CHUNK) -> str:
    """Read and hash `path` `chunk` bytes at a time, record it under `key`; `busy`: this thread's
    in-flight mark, cleared after."""
    try:
        started = time.time_ns()
        h = hashlib.sha256()
        # the buffer is an anonymous mapping of its own, unmapped on return: a malloc'd one of this size can
        # stay in a thread's arena after it is freed (+3.4 MiB of smollm2-135m's peak RSS with a bytearray)
        with open(path, "rb", buffering=0) as f, mmap.mmap(-1, min(chunk, max(key[3], 1))) as buf, memoryview(buf) as view:
            while n := f.readinto(view):
                h.update(view[:n])  # read and hash both let go of the GIL: a prehash runs beside Python
        _memo[key] = (h.hexdigest(), started)
        return h.hexdigest()
    finally:
        if busy is not None:
            with _inflight_lock:
                _inflight.pop(key, None)
            busy.set()


def prehash(paths: Iterable[Path]) -> threading.Thread:
    """Hash `paths` on a daemon thread now, into sha256_file's memo, so the caller's own sha256_file
    calls find them done or in progress: smollm2-135m's 538 MB took ~0.45 s of a check's start, now
    spent while transformers imports its model classes (GIL-bound Python, ~1.5 s; one core each). A file
    it cannot read is skipped: the caller's own call raises, in its own words."""
    todo = list(paths)

    def run() -> None:
        for p in todo:
            try:
                sha256_file(p, chunk=_PRE_CHUNK)
            except OSError:
                pass

    thread = threading.Thread(target=run, name=_PRE_THREAD, daemon=True)
    thread.start()
    return thread


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


# config keys that never change what a model computes: version stamps, names, output switches, and
# what a re-save by another transformers version writes on its own (`_from_model_config`: the
# generation config was derived from config.json; detllm passes every decoding setting explicitly)
COSMETIC_CONFIG_KEYS = frozenset({
    "transformers_version", "_name_or_path", "_commit_hash", "_attn_implementation_autoset", "_from_model_config",
    "output_attentions", "output_hidden_states", "return_dict", "torchscript", "use_cache", "id2label", "label2id",
    "finetuning_task", "problem_type", "task_specific_params",
})
# keys a newer transformers writes under a new name for the same value: hashed under the new name
RENAMED_CONFIG_KEYS = {"torch_dtype": "dtype"}
_CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def _json_file(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _semantic(path: Path, drop: frozenset[str], renamed: dict[str, str] | None = None) -> str:
    """sha256 of a JSON file's canonical form without the keys in `drop`, keys in `renamed` under
    their new name (unless the file has both); its bytes' sha256 when it is not a JSON object."""
    doc = _json_file(path)
    if not isinstance(doc, dict):
        return sha256_file(path)
    if renamed:
        doc = {renamed.get(k, k) if renamed.get(k) not in doc else k: v for k, v in doc.items()}
    return sha256_bytes(canonical_json({k: v for k, v in doc.items() if k not in drop}))


def tokenizer_sha256(folder: Path) -> str:
    """Hash of the tokenizer files' contents (names relative, paths ignored), without the chat
    template: prompts are tokenized as given, no template is applied (chat_template_sha256)."""
    found = [(n, _semantic(folder / n, frozenset({"chat_template"})) if n == "tokenizer_config.json" else sha256_file(folder / n))
             for n in TOKENIZER_FILES if n not in _CHAT_TEMPLATE_FILES and (folder / n).is_file()]
    return combine(found)


def chat_template_sha256(folder: Path) -> str | None:
    """The chat template's text wherever the folder keeps it; None when it has none."""
    parts = [(n, sha256_file(folder / n)) for n in _CHAT_TEMPLATE_FILES if (folder / n).is_file()]
    cfg = _json_file(folder / "tokenizer_config.json")
    if isinstance(cfg, dict) and cfg.get("chat_template"):
        parts.append(("tokenizer_config.json:chat_template", sha256_bytes(canonical_json(cfg["chat_template"]))))
    return combine(parts) if parts else None


def config_digests(folder: Path) -> tuple[str | None, str | None]:
    """(config_sha256 over the fields that change the computation, config_files_sha256 over the
    files' bytes) of config.json and generation_config.json; (None, None) without them."""
    found = [n for n in CONFIG_FILES if (folder / n).is_file()]
    if not found:
        return None, None
    return (combine((n, _semantic(folder / n, COSMETIC_CONFIG_KEYS, RENAMED_CONFIG_KEYS)) for n in found),
            combine((n, sha256_file(folder / n)) for n in found))


def folder_files(folder: Path) -> list[Path]:
    """Every file under `folder` but the hub client's `.cache`, sorted: what content_key hashes."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and ".cache" not in p.relative_to(folder).parts)


def content_key(folder: Path) -> str:
    """One digest over every file under `folder` (relative name and sha256 of its bytes): what
    an in-process cache of a loaded model is keyed on, so a file edited in place (same size,
    mtime set back) is never served from a model loaded before the edit."""
    return combine((str(p.relative_to(folder)), sha256_file(p)) for p in folder_files(folder))


def folder_identity(model_id: str, folder: Path, *, revision: str | None = None, fmt: str | None = None) -> ModelIdentity:
    weights = weight_files(folder)
    config, files = config_digests(folder)
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
        config_sha256=config, config_files_sha256=files, chat_template_sha256=chat_template_sha256(folder),
    )
