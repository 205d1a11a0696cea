"""The model of the `llamacpp` backend: which .gguf file a model name means, reading its header
(checked first, so a truncated file is one line, not a server log), and its identity by content
(the file's sha256, the tokenizer's keys, its quantization). Starts no server.
"""

from __future__ import annotations

from pathlib import Path

from ...core.errors import UsageError
from ...core.hashing import combine, sha256_file
from ...core.modelfiles import check_model_files
from ...models.gguf import GGUFInfo, read_gguf
from ..base import ModelIdentity, WeightFile


def resolve_gguf(model: str) -> Path:
    """A built-in name, a .gguf file, or a folder holding exactly one .gguf."""
    from ...models import BUILTINS, builtin_path

    p = Path(model).expanduser()
    if p.is_file():
        if p.suffix != ".gguf":
            raise UsageError(f"llamacpp needs a .gguf model file, got {model!r}")
        return p.resolve()
    if p.is_dir():
        found = sorted(p.glob("*.gguf"))
        if len(found) != 1:
            raise UsageError(f"llamacpp needs a folder holding exactly one .gguf file; {model!r} holds {len(found)}",
                             hint="pass the .gguf file itself, or convert the model with `detllm models export NAME DIR --format gguf`")
        return found[0].resolve()
    if model in BUILTINS:
        return builtin_path(model, "gguf") / "model.gguf"
    raise UsageError(f"llamacpp model {model!r} is not a built-in model, a .gguf file or a folder with one",
                     hint=f"built-in models: {', '.join(BUILTINS)}")


def read_info(gguf: Path) -> GGUFInfo:
    """The file's header, after its tensor bounds are checked."""
    check_model_files(gguf)  # header and tensor bounds: a truncated file is one line, not a server log
    try:
        return read_gguf(gguf)
    except ValueError as exc:
        raise UsageError(f"cannot read GGUF {str(gguf)!r}: {exc}") from exc


def gguf_identity(model_id: str, gguf: Path, info: GGUFInfo) -> ModelIdentity:
    w = WeightFile(gguf.name, sha256_file(gguf), gguf.stat().st_size)
    return ModelIdentity(
        id=model_id, path=str(gguf), revision=None, format="gguf", weights=(w,),
        weights_sha256=combine([("gguf", w.sha256)]),  # one file: its name is not part of the identity
        tokenizer_sha256=info.tokenizer_sha256(),
        quantization=info.quantization,
    )


__all__ = ["gguf_identity", "read_info", "resolve_gguf"]
