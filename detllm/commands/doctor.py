"""`detllm doctor`: what works on this machine, one screen.

Owns the checks (torch build, CUDA and GPUs, the tier each backend can enforce here, whether
artifacts/ is writable) and the screen. Each backend says itself whether its engine or binary
is installed and what installs it (`Backend.installed()`, through the registry). It never
downloads anything, never builds a model and never starts an engine.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

FIX = {
    "torch": "scripts/install.sh   (CPU torch 2.13.0 through constraints.txt), or pip with torch first at the pin (docs/ci.md#install)",
    "artifacts": "run from a folder you can write to, or pass --out DIR",
}
SHOWN = ("hf", "vllm", "llamacpp", "fake", "openai")  # the order of the screen; other registered backends follow


def _torch() -> dict[str, Any]:
    if importlib.util.find_spec("torch") is None:
        return {"installed": False, "fix": FIX["torch"]}
    import torch

    out: dict[str, Any] = {"installed": True, "version": torch.__version__, "cuda_build": torch.version.cuda,
                           "cuda_available": bool(torch.cuda.is_available()), "gpus": []}
    if out["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out["gpus"].append({"index": i, "name": p.name, "compute_capability": f"{p.major}.{p.minor}"})
    return out


_FORMAT = {"hf": "hf", "vllm": "hf", "llamacpp": "gguf"}  # the built-in model's format each backend loads


def _tier(name: str) -> tuple[int | None, str]:
    """The tier the backend enforces here as configured by default, and why not higher. Asked
    of a backend on the built-in `tiny` model only when that is already built: creating a
    backend would build it, and doctor builds nothing. Engines start on first use, never here."""
    from ..backends.registry import backend_class
    from ..core.config import RunConfig
    from ..core.errors import DetllmError
    from ..models import list_models

    fmt = _FORMAT.get(name)
    if fmt is not None and fmt not in next(m["cached"] for m in list_models() if m["name"] == "tiny"):
        return None, f"the built-in model is not built yet (`detllm run --backend {name}` builds it)"
    try:
        backend = backend_class(name).from_config(RunConfig(backend=name))
        try:
            caps = backend.capabilities()
        finally:
            backend.close()
    except DetllmError as err:
        return None, err.message
    except Exception as exc:  # noqa: BLE001 - doctor reports what it cannot check instead of failing
        return None, f"{exc.__class__.__name__}: {exc}"[:200]
    return caps.max_tier, "; ".join(caps.notes)


def _writable(folder: Path) -> dict[str, Any]:
    probe = folder if folder.exists() else next((p for p in folder.absolute().parents if p.exists()), Path("/"))
    ok = probe.is_dir() and os.access(probe, os.W_OK | os.X_OK)
    return {"path": str(folder), "writable": ok, **({} if ok else {"fix": FIX["artifacts"]})}


def diagnose_machine(artifacts_dir: Path = Path("artifacts")) -> dict[str, Any]:
    """Every finding, as the JSON `detllm doctor --json` prints."""
    from ..backends.registry import BACKENDS, backend_class

    torch = _torch()
    backends: dict[str, dict[str, Any]] = {}
    for name in (*SHOWN, *(n for n in BACKENDS if n not in SHOWN)):
        found = backend_class(name).installed()
        backends[name] = found.to_json()
        if found.usable and found.tier_note is None:  # a tier_note: the backend's tier is not doctor's to ask
            backends[name]["max_tier"], backends[name]["tier_note"] = _tier(name)
    return {"torch": torch, "backends": backends, "artifacts": _writable(artifacts_dir)}


def render_doctor(found: dict[str, Any]) -> str:
    t = found["torch"]
    lines = ["detllm doctor"]
    if not t["installed"]:
        lines.append(f"torch     not installed -> {t['fix']}")
    else:
        build = f"CUDA {t['cuda_build']} build" if t["cuda_build"] else "CPU build"
        gpus = ", ".join(f"{g['name']} (compute capability {g['compute_capability']})" for g in t["gpus"]) or "no GPU visible"
        lines.append(f"torch     {t['version']} ({build}); CUDA {'available' if t['cuda_available'] else 'not available'}; {gpus}")
    for name, b in found["backends"].items():
        if b["usable"]:
            what = b.get("engine") or b.get("build") or ""
            where = f" [{b['binary']}]" if b.get("binary") else ""
            tier = f"enforces tier <= {b['max_tier']}" if b.get("max_tier") is not None else "tier not checked"
            lines.append(f"{name:<9} ok: {what}{where}; {tier}" + (f" ({b['tier_note']})" if b.get("tier_note") else ""))
        else:
            lines.append(f"{name:<9} unavailable: {b['why']} -> {b['fix']}")
    a = found["artifacts"]
    lines.append(f"artifacts {a['path']}/ " + ("writable" if a["writable"] else f"NOT writable -> {a['fix']}"))
    return "\n".join(lines) + "\n"
