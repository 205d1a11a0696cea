"""What the llama-server build is: its `--version` lines, the GPU devices it lists, the CPU
features its kernels were selected by, and the marker files scripts/build_llamacpp.sh leaves
next to bin/. Each asks the binary a short question and exits; none starts a server for a run.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from ...core.errors import BackendError
from ...core.hashing import sha256_file
from .server import free_port

_CPU_FEATURES: dict[str, dict[str, int] | None] = {}  # binary sha256 -> its CPU backend features, per process


def version_lines(binary: Path) -> str | None:
    """"version: ...; built with ..." from `llama-server --version`; None when it prints neither.
    OSError and subprocess.TimeoutExpired reach the caller."""
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip().startswith(("version:", "built with"))]
    return "; ".join(lines) or None


def lists_gpu(binary: Path) -> bool:
    """True when this build lists a GPU device (`--list-devices`)."""
    try:
        listed = subprocess.run([str(binary), "--list-devices"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise BackendError(f"{binary} --list-devices failed: {exc}") from exc
    devices = [line.strip() for line in listed.split("Available devices:", 1)[-1].splitlines() if line.strip()]
    return bool(devices) and devices != ["(none)"]


def cpu_features(binary: Path) -> dict[str, int] | None:
    """The CPU backend features llama.cpp selects kernels with here (`system_info: ... | CPU :
    AVX2 = 1 | AVX512 = 1 | ...`): printed before the model loads, so a missing model makes the
    server print them and exit at once (~0.1 s). None when the binary does not say."""
    key = sha256_file(binary)
    if key not in _CPU_FEATURES:
        try:
            proc = subprocess.run([str(binary), "-m", "/nonexistent/detllm-probe.gguf", "--host", "127.0.0.1",
                                   "--port", str(free_port()), "-lv", "4", "--device", "none"],
                                  capture_output=True, text=True, timeout=30)
            m = re.search(r"system_info:.*?\| CPU : (.*)", proc.stdout + proc.stderr)
        except (OSError, subprocess.TimeoutExpired):
            m = None
        _CPU_FEATURES[key] = None if m is None else {
            k.strip(): int(v) for k, v in re.findall(r"([A-Z0-9_]+) = (\d+)", m.group(1))}
    return _CPU_FEATURES[key]


def marker(binary: Path, name: str) -> str | None:
    """A one-line marker file (VERSION, CPU_FLAGS) the build script leaves next to bin/, if present."""
    try:
        return (binary.parent.parent / name).read_text().strip() or None
    except OSError:
        return None


__all__ = ["cpu_features", "lists_gpu", "marker", "version_lines"]
