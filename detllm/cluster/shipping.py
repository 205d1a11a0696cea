"""`check --ray --ship-model`: the model folder sent from the driver to every node through Ray's object
store, named by the sha256 of its content, written on the node under the temp folder
(detllm-shipped/<digest>/, the same path on every node) and hashed again on arrival: a copy that
differs fails its replica. Reads and writes files only; the transport is the driver's ray.put.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from ..core.errors import UsageError

MAX_BYTES = 8 << 30  # refuse to ship more than this through the object store; give a path every node has


def content_digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(f"{rel}\0".encode())
        h.update(hashlib.sha256(files[rel]).digest())
    return h.hexdigest()


def read_model(model: str) -> tuple[dict[str, bytes], str]:
    """Every regular file of the model folder `model` by relative path, and their digest (usage error
    for a hub id, a built-in name or a folder too large to ship)."""
    root = Path(model)
    if not root.is_dir():
        raise UsageError(f"--ship-model sends a model folder, and {model!r} is not one",
                         hint="export a built-in model with `detllm models export NAME DIR`, or give a path every node has")
    paths = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    if sum(p.stat().st_size for p in paths) > MAX_BYTES:
        raise UsageError(f"{model!r} is over {MAX_BYTES >> 30} GiB: too large to ship through Ray's object store",
                         hint="put it at the same path on every node (or a hub id) and leave out --ship-model")
    files = {p.relative_to(root).as_posix(): p.read_bytes() for p in paths}
    return files, content_digest(files)


def land(files: dict[str, bytes], digest: str) -> Path:
    """The shipped model on this node at <temp>/detllm-shipped/<digest[:16]>, written once (atomically:
    a private folder renamed into place) and checked against `digest`; ValueError when it differs."""
    dest = Path(tempfile.gettempdir()) / "detllm-shipped" / digest[:16]
    if not dest.is_dir():
        tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:16]}-", dir=dest.parent if dest.parent.is_dir() else _mkparent(dest)))
        for rel, data in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(data)
        try:
            os.rename(tmp, dest)
        except OSError:  # another task of this node landed it first
            shutil.rmtree(tmp, ignore_errors=True)
    here = content_digest({p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file()})
    if here != digest:
        raise ValueError(f"the shipped model arrived changed at {dest} (sha256 {here[:12]}, driver {digest[:12]})")
    return dest


def _mkparent(dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    return dest.parent


__all__ = ["content_digest", "land", "read_model"]
