"""What one backend does to the whole process, which every later backend in it must see.

Owns two such things. vLLM's batch-invariant mode: once an engine switched it on it stays on
(aten overrides, TF32 off, env vars) with no off switch, so a later run that would compute under
it while recording it off is refused. And TF32 on CUDA: read, switch off and restore it through
whichever torch API is in use. Imports no engine; torch is passed in by the caller.
"""

from __future__ import annotations

import sys
from typing import Any

from .errors import BackendError

# ------------------------------------------------------------------ vLLM's batch-invariant mode

# vLLM's batch-invariant mode changes the whole process and has no off switch: it registers
# aten overrides (mm, addmm, matmul, linear, softmax, log_softmax, mean, bmm), replaces
# torch.bmm, sets TF32 off and reduced-precision reductions off, and writes env vars. Any
# later computation in the process (another vLLM engine, the hf backend) runs with it.
_BI_MODULES_LOADED = ("vllm.model_executor.layers.batch_invariant", "vllm.model_executor.determinism.batch_invariant")
_BI_STARTED = False  # an engine of this process was started with VLLM_BATCH_INVARIANT=1


def mark_batch_invariant_started() -> None:
    """Called by the vllm backend once it started an engine with the mode on: true for the
    rest of the process, whatever the engine's release restores."""
    global _BI_STARTED
    _BI_STARTED = True


def batch_invariant_in_process() -> bool:
    """True once vLLM's batch-invariant mode is on in this process: an engine detllm started
    with it, or vLLM's own flag (`_batch_invariant_MODE`, read without importing vLLM)."""
    mods = (sys.modules.get(name) for name in _BI_MODULES_LOADED)
    return _BI_STARTED or any(bool(getattr(m, "_batch_invariant_MODE", False)) for m in mods if m is not None)


def refuse_after_batch_invariant(what: str) -> None:
    """A run that would compute under vLLM's leftover batch-invariant mode while recording it
    off is refused (BackendError) before anything is written."""
    if batch_invariant_in_process():
        raise BackendError(f"vLLM's batch-invariant mode was switched on earlier in this process and cannot be switched off "
                           f"(aten overrides, TF32 and env stay in place); {what} would compute with it while recording it off",
                           hint="run it in a new process: a new detllm command, or check --fresh-process")


# ------------------------------------------------------------------ TF32 on CUDA
#
# torch >= 2.9 has per-op `fp32_precision` settings ("ieee", "tf32", "none": inherit) and
# raises a RuntimeError when the legacy `allow_tf32` flag is *read* after the new API was
# used (by vLLM's batch-invariant mode, by user code, by an earlier run in the process).
# So: use the new API wherever it exists, the legacy flags only on an older torch, and
# turn any failure into a BackendError.

# new-API settings (object path under torch.backends, attribute) that decide fp32 math on CUDA
TF32_NEW_API = (("cuda.matmul", "fp32_precision"), ("cudnn.conv", "fp32_precision"), ("cudnn.rnn", "fp32_precision"))
TF32_LEGACY_API = (("cuda.matmul", "allow_tf32"), ("cudnn", "allow_tf32"))
TF32_OFF = {"fp32_precision": "ieee", "allow_tf32": False}


def _owner(torch: Any, path: str) -> Any:
    obj = torch.backends
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def tf32_knobs(torch: Any) -> tuple[tuple[str, str], ...]:
    """The settings this torch decides TF32 by: the new API when it exists, else the legacy flags."""
    try:
        getattr(_owner(torch, "cuda.matmul"), "fp32_precision")
    except AttributeError:
        return TF32_LEGACY_API
    except RuntimeError:
        pass  # it exists (and `read_tf32` will report why it cannot be read)
    return TF32_NEW_API


def read_tf32(torch: Any) -> dict[str, Any]:
    """{"cuda.matmul.fp32_precision": "ieee", ...}: the TF32 settings in effect now."""
    out = {}
    for path, attr in tf32_knobs(torch):
        try:
            out[f"{path}.{attr}"] = getattr(_owner(torch, path), attr)
        except (RuntimeError, AttributeError) as exc:
            raise BackendError(f"cannot read torch's TF32 setting torch.backends.{path}.{attr}: {_first_line(exc)}") from exc
    return out


def write_tf32(torch: Any, values: dict[str, Any]) -> None:
    """Set the settings named as `read_tf32` returns them (restore a saved snapshot)."""
    for name, value in values.items():
        path, attr = name.rsplit(".", 1)
        try:
            setattr(_owner(torch, path), attr, value)
        except (RuntimeError, AttributeError, ValueError) as exc:
            raise BackendError(f"cannot set torch's TF32 setting torch.backends.{name} to {value!r}: {_first_line(exc)}") from exc


def disable_tf32(torch: Any) -> dict[str, Any]:
    """Switch TF32 off for matmul and cuDNN; returns the settings now in effect (read back)."""
    write_tf32(torch, {f"{path}.{attr}": TF32_OFF[attr] for path, attr in tf32_knobs(torch)})
    return read_tf32(torch)


def tf32_is_off(values: dict[str, Any]) -> bool:
    return all(v == TF32_OFF[name.rsplit(".", 1)[1]] for name, v in values.items())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


__all__ = [
    "batch_invariant_in_process", "disable_tf32", "mark_batch_invariant_started", "read_tf32", "refuse_after_batch_invariant",
    "tf32_is_off", "tf32_knobs", "write_tf32",
]
