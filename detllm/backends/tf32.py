"""TF32 on CUDA: read, switch off and restore it through whichever torch API is in use.

torch >= 2.9 has per-op `fp32_precision` settings ("ieee", "tf32", "none": inherit) and
raises a RuntimeError when the legacy `allow_tf32` flag is *read* after the new API was
used (by vLLM's batch-invariant mode, by user code, by an earlier run in the process).
So: use the new API wherever it exists, the legacy flags only on an older torch, and
turn any failure into a BackendError. Owns nothing else of a backend's determinism.
"""

from __future__ import annotations

from typing import Any

from ..errors import BackendError

# new-API settings (object path under torch.backends, attribute) that decide fp32 math on CUDA
NEW_API = (("cuda.matmul", "fp32_precision"), ("cudnn.conv", "fp32_precision"), ("cudnn.rnn", "fp32_precision"))
LEGACY_API = (("cuda.matmul", "allow_tf32"), ("cudnn", "allow_tf32"))
OFF = {"fp32_precision": "ieee", "allow_tf32": False}


def _owner(torch: Any, path: str) -> Any:
    obj = torch.backends
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def knobs(torch: Any) -> tuple[tuple[str, str], ...]:
    """The settings this torch decides TF32 by: the new API when it exists, else the legacy flags."""
    try:
        getattr(_owner(torch, "cuda.matmul"), "fp32_precision")
    except AttributeError:
        return LEGACY_API
    except RuntimeError:
        pass  # it exists (and `read` will report why it cannot be read)
    return NEW_API


def read(torch: Any) -> dict[str, Any]:
    """{"cuda.matmul.fp32_precision": "ieee", ...}: the TF32 settings in effect now."""
    out = {}
    for path, attr in knobs(torch):
        try:
            out[f"{path}.{attr}"] = getattr(_owner(torch, path), attr)
        except (RuntimeError, AttributeError) as exc:
            raise BackendError(f"cannot read torch's TF32 setting torch.backends.{path}.{attr}: {_first_line(exc)}") from exc
    return out


def write(torch: Any, values: dict[str, Any]) -> None:
    """Set the settings named as `read` returns them (restore a saved snapshot)."""
    for name, value in values.items():
        path, attr = name.rsplit(".", 1)
        try:
            setattr(_owner(torch, path), attr, value)
        except (RuntimeError, AttributeError, ValueError) as exc:
            raise BackendError(f"cannot set torch's TF32 setting torch.backends.{name} to {value!r}: {_first_line(exc)}") from exc


def disable(torch: Any) -> dict[str, Any]:
    """Switch TF32 off for matmul and cuDNN; returns the settings now in effect (read back)."""
    write(torch, {f"{path}.{attr}": OFF[attr] for path, attr in knobs(torch)})
    return read(torch)


def is_off(values: dict[str, Any]) -> bool:
    return all(v == OFF[name.rsplit(".", 1)[1]] for name, v in values.items())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


__all__ = ["disable", "is_off", "knobs", "read", "write"]
