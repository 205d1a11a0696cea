"""Kernel-steering environment as a knob of a diff: which of the variables recorded in the two
sides' env.json can be switched here (ATEN_CPU_CAPABILITY, OMP_*, MKL_*, ONEDNN_*/DNNL_*,
GGML_*, thread and affinity limits) and which recorded environment differences cannot (library
versions, the CPU, a redacted value, a fact the engine reported). Reads env.json only; the
probes themselves run in recorded.py, each in a fresh worker whose environment is set here.
"""

from __future__ import annotations

from typing import Any

from ..compare.causes.sides import ABSENT, flat_diff
from ..runfolder.env import REDACTED, VOLATILE_KEYS

# variables that steer kernels and can be set before a process starts (read at engine start-up)
SWITCHABLE = ("ATEN_CPU_CAPABILITY", "OMP_", "MKL_", "ONEDNN_", "DNNL_", "GGML_", "KMP_", "GOMP_", "OPENBLAS_",
              "CUBLAS_WORKSPACE_CONFIG")
# env.json facts that follow a switchable variable (switching the variable switches them)
_DERIVED = {"ATEN_CPU_CAPABILITY": ("kernels.torch_cpu_capability",)}


def switchable(name: str) -> bool:
    return name.startswith(SWITCHABLE)


def differences(left_env: dict[str, Any], right_env: dict[str, Any]) -> tuple[dict[str, tuple[str | None, str | None]], list[str]]:
    """({variable: (left value, right value)} for each switchable variable whose recorded values
    differ (None: unset), [each other recorded environment difference, as "field (left vs right)"])."""
    lv, rv = left_env.get("env_vars") or {}, right_env.get("env_vars") or {}
    switch: dict[str, tuple[str | None, str | None]] = {}
    cannot: list[str] = []
    for name in sorted(set(lv) | set(rv)):
        a, b = lv.get(name), rv.get(name)
        if a == b:
            continue
        if switchable(name) and REDACTED not in (a, b):
            switch[name] = (a, b)
        elif switchable(name):
            cannot.append(f"env_vars.{name} (recorded as {REDACTED}: its value is unknown)")
        else:  # not a kernel-steering variable diagnose sets (a CUDA_, VLLM_, HF_... variable)
            cannot.append(f"env_vars.{name} ({_show(a)} vs {_show(b)})")
    derived = {f for name in switch for f in _DERIVED.get(name, ())}
    threads_switched = any(name.endswith("NUM_THREADS") for name in switch)
    # the engine's own report is compared as BACKEND_MISMATCH; the document's version is not the machine's
    ignore = set(VOLATILE_KEYS) | {"backend", "env_vars", "schema_version", "artifact_type"}
    if left_env.get("torch") is None or right_env.get("torch") is None:
        ignore.add("torch")
    for d in flat_diff({k: v for k, v in left_env.items() if k not in ignore}, {k: v for k, v in right_env.items() if k not in ignore}):
        f = d["field"]
        if f in derived or (threads_switched and f.startswith("threads.")):
            continue
        if "torch" in ignore and f.startswith(("threads.torch_", "kernels.torch_")):
            continue
        cannot.append(f"{f} ({_show(d['left'])} vs {_show(d['right'])})")
    return switch, cannot


def _show(v: Any) -> str:
    return "unset" if v is None or v is ABSENT else repr(v)


def worker_env(switch: dict[str, tuple[str | None, str | None]], probe_env: dict[str, str | None]) -> dict[str, str | None]:
    """The environment changes of a probe's fresh worker: every switchable variable at the left
    side's recorded value, except the probe's own switch (the right side's value)."""
    env = {name: left for name, (left, _) in switch.items()}
    env.update(probe_env)
    return env


__all__ = ["SWITCHABLE", "differences", "switchable", "worker_env"]
