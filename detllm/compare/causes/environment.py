"""BACKEND_MISMATCH and ENV_MISMATCH: the engine (its name, build and own report) or the
machine (libraries, drivers, threads, hardware, kernel paths) differs, including what config.py
routed here as chosen by the machine. Does not judge requested settings (config.py).
"""

from __future__ import annotations

from typing import Any

from ...core.ompwait import WAIT_ONLY
from ...runfolder.env import HARDWARE_KEYS, KERNEL_ENV_PREFIXES, VOLATILE_KEYS
from .notes import Notes
from .sides import ABSENT, Routed, Side, cut, flat_diff, lr

# llama-server argv flags that mirror a recorded setting or identity (compared there) or a port
_ARGV_MIRRORED = {"-m", "--host", "--port", "-np", "-c", "-t", "-tb", "-b", "-ub", "-fa", "-ctk", "-ctv", "--device",
                  "-ngl", "--cache-ram", "-sps"}
# engine-report keys that follow the batch size or mirror recorded settings (llama-server /props)
_ENGINE_MIRRORED = {"n_ctx", "total_slots", "argv"}


def _argv_flags(argv: Any) -> dict[str, Any]:
    """llama-server argv as {flag: value} (a flag without a value maps to True)."""
    out: dict[str, Any] = {}
    if not isinstance(argv, list):
        return out
    i = 0
    while i < len(argv):
        a = str(argv[i])
        if a.startswith("-") and i + 1 < len(argv) and not str(argv[i + 1]).startswith("-"):
            out[a], i = argv[i + 1], i + 2
        else:
            out[a], i = True, i + 1
    return out


def _served_aliases(lb: dict[str, Any], rb: dict[str, Any], engine: list[dict[str, Any]], notes: Notes) -> list[dict[str, Any]]:
    """A served model's name (/v1/models `id`: llama-server's --alias, vLLM's --served-model-name)
    is a label, not the engine: a differing id is noted, not a difference, where something the
    server reports about the weights behind the name (the entry's `root` or `meta`, llama-server's
    /props model_path) was recorded on both sides and agrees, and none of it differs."""
    lm, rm = lb.get("models"), rb.get("models")
    if not (isinstance(lm, list) and isinstance(rm, list) and len(lm) == len(rm)):
        return engine
    lp, rp = (lb.get("props") or {}).get("model_path"), (rb.get("props") or {}).get("model_path")
    out = []
    for d in engine:
        i = next((i for i in range(len(lm)) if d["field"] == f"backend.models[{i}].id"), None)
        a, b = (lm[i], rm[i]) if i is not None and isinstance(lm[i], dict) and isinstance(rm[i], dict) else ({}, {})
        known = [k for k in ("root", "meta") if a.get(k) is not None and b.get(k) is not None]
        agree = [f"models[{i}].{k}" for k in known if a[k] == b[k]] + (["props.model_path"] if lp is not None and lp == rp else [])
        disagree = any(a[k] != b[k] for k in known) or (None not in (lp, rp) and lp != rp)
        if i is None or not agree or disagree:
            out.append(d)
            continue
        notes.note({**d, "field": f"env.{d['field']}"}, "the name the server serves the model under (llama-server --alias, vLLM "
                   f"--served-model-name), not the engine: what the server reports about the weights agrees ({', '.join(agree)})")
    return out


def backend_mismatch(left: Side, right: Side, notes: Notes, routed: Routed) -> dict[str, Any] | None:
    ln, rn = left.run_config["config"]["backend"], right.run_config["config"]["backend"]
    lb, rb = left.env.get("backend") or {}, right.env.get("backend") or {}
    # settings the run config already records, paths whose content hash agrees, hardware (ENV)
    skip = {"device", "dtype"} | set(left.run_config["backend_options"]) | set(right.run_config["backend_options"])
    same_content = {k for k in lb if f"{k}_sha256" in lb and lb.get(f"{k}_sha256") == rb.get(f"{k}_sha256")}
    for k in sorted(same_content):
        if lb.get(k) != rb.get(k):
            notes.note({"field": f"env.backend.{k}", "left": lb.get(k), "right": rb.get(k)},
                       f"another path, the same content (backend.{k}_sha256 agrees)")
    skip |= same_content
    skip |= set(_ENGINE_MIRRORED) | set(HARDWARE_KEYS)
    engine = flat_diff({k: v for k, v in lb.items() if k not in skip}, {k: v for k, v in rb.items() if k not in skip}, "backend")
    if ln == rn == "openai":
        engine = _served_aliases(lb, rb, engine, notes)
    if ln == rn:
        la, ra = _argv_flags(lb.get("argv")), _argv_flags(rb.get("argv"))
        engine += flat_diff({k: v for k, v in la.items() if k not in _ARGV_MIRRORED},
                            {k: v for k, v in ra.items() if k not in _ARGV_MIRRORED}, "backend.argv")
    for key in HARDWARE_KEYS:
        if key in lb or key in rb:
            routed.machine += flat_diff(lb.get(key, ABSENT), rb.get(key, ABSENT), f"backend.{key}")
    engine = notes.screen(engine, "env")
    dtype = routed.dtype if ln != rn else None
    if ln == rn and not engine:
        return None
    ev: dict[str, Any] = {"backend": lr(ln, rn), "engine": cut(engine)}
    if dtype is not None and dtype["requested"]["left"] == dtype["requested"]["right"]:
        ev["dtype_in_effect"] = lr(dtype["left"], dtype["right"])  # each engine resolved the same request its own way
    return ev


def _kernel_first(d: dict[str, Any]) -> int:
    """Sort key: what selects kernels first (capability in effect, the variables that steer
    it, ISA flags, GPUs), then the rest."""
    f = d["field"]
    if f.startswith(("kernels.", "backend.")) or f.startswith(tuple(f"env_vars.{p}" for p in KERNEL_ENV_PREFIXES)):
        return 0
    if f.startswith(("cpu.", "gpus", "torch.")):
        return 1
    return 2


def env_mismatch(left: Side, right: Side, notes: Notes, routed: Routed) -> dict[str, Any] | None:
    ignore = set(VOLATILE_KEYS) | {"backend"}  # the engine's own report is BACKEND_MISMATCH's
    if left.env.get("torch") is None or right.env.get("torch") is None:
        ignore.add("torch")  # a side whose engine never loaded torch (llama.cpp) has no torch facts to compare
    fields = flat_diff({k: v for k, v in left.env.items() if k not in ignore},
                       {k: v for k, v in right.env.items() if k not in ignore})
    if "torch" in ignore:
        fields = [f for f in fields if not f["field"].startswith("threads.torch_")
                  and not (f["field"].startswith("kernels.torch_") and ABSENT in (f["left"], f["right"]))]
    same_backend = left.run_config["config"]["backend"] == right.run_config["config"]["backend"]
    if not same_backend:
        # a kernel fact only one engine reports (llama.cpp's CPU features, torch's capability) is
        # part of that engine's record, not a difference of the machine: BACKEND_MISMATCH owns it
        fields = [f for f in fields if not (f["field"].startswith("kernels.") and ABSENT in (f["left"], f["right"]))]
    fields = notes.screen(fields, "env")
    for d in [f for f in fields if f["field"] in {f"env_vars.{v}" for v in WAIT_ONLY}]:
        fields.remove(d)  # how idle OpenMP threads wait (core/ompwait.py): the time changes, never a result
        notes.note({**d, "field": f"env.{d['field']}"}, "how idle OpenMP threads wait: changes the time, never which "
                   "thread computes what")
    if routed.dtype is not None and same_backend and routed.dtype["requested"]["left"] == routed.dtype["requested"]["right"]:
        fields.append({"field": "dtype in effect (chosen by the machine)", "left": routed.dtype["left"], "right": routed.dtype["right"]})
    fields = sorted(fields + routed.machine, key=_kernel_first)
    if not fields:
        return None
    return {"differences": cut(fields, 40), "count": len(fields),
            "fingerprint": lr(left.env["fingerprint"], right.env["fingerprint"])}
