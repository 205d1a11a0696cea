"""CONFIG_MISMATCH: what the user requested differs (run_config.config, the backend options
the user set, determinism settings asked for). Routes what the machine chose and what follows
the batch sizes to environment.py and variance.py; settings that never change the
computation are noted as inert, never causes.
"""

from __future__ import annotations

from typing import Any

from ...models.gguf import FLOAT_TYPES as FLOAT_GGUF  # GGUF types that store plain floats
from .notes import Notes
from .sides import ABSENT, Routed, Side, cut, flat_diff, lr

# run_config.config fields judged elsewhere or not about generation
_NOT_CONFIG = ("backend", "model", "revision", "batch_size", "vary_batch", "runs", "atol", "record_prompt_text", "options",
               "dtype", "fresh_process")
# recorded settings that never change the computation: listed in report.inert_differences, never a cause
INERT_CONFIG = {
    "tier": "the tier selects checks and settings; the settings it applied are compared one by one (determinism_applied)",
    "mode": "strict or best-effort decides whether a run is refused, not how it computes",
}
INERT_OPTIONS = {
    "port": "the loopback port a server listens on",
    "startup_timeout": "how long detllm waits for the server",
    "request_timeout": "how long detllm waits for a request",
    "bin": "the binary's path; its build is compared by content (env.json backend.binary_sha256)",
    "gpu_memory_utilization": "how much GPU memory vLLM may reserve, not how it computes",
    "api_key_env": "the name of the variable holding an API key",
    "connect_timeout": "how long detllm waits for a connection",
    "retries": "how often a request the server did not take is resent (each record counts its retries)",
    "sample_interval": "how often detllm asks the server about its batch",
}
# settings whose value follows the run's largest batch unless the user set them
BATCH_DERIVED = ("slots", "max_num_seqs")
# engines whose computation depends on how many (id, logprob) pairs are asked for: llama.cpp
# sorts and softmaxes n_probs candidates itself, so their number changes the sum order
LOGPROBS_COUNT_MATTERS = ("llamacpp",)


def _settings(applied: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in (applied or {}).get("settings", ())}


def _origin(setting: dict[str, Any], user_keys: set[str]) -> str:
    """Who chose a setting's value: "user" (requested), "batch" (follows the batch sizes) or
    "machine" (nothing was requested: the machine or engine chose it)."""
    by = setting.get("chosen_by")
    if by:
        return by
    if setting["name"] in user_keys:
        return "user"
    if setting["name"] in BATCH_DERIVED:
        return "batch"
    return "machine" if setting.get("requested") in (None, "auto") else "user"


def dtype_in_effect(side: Side) -> str | None:
    """The dtype a side computed in (a float GGUF's F32 spelled float32, so engines compare)."""
    value = _settings(side.applied).get("dtype", {}).get("value")
    value = value if isinstance(value, str) and value else (side.run_config or {}).get("config", {}).get("dtype")
    return FLOAT_GGUF.get(value.upper(), value) if isinstance(value, str) else value


def config_mismatch(left: Side, right: Side, notes: Notes, routed: Routed) -> dict[str, Any] | None:
    """What the user requested: run_config.config, the backend options the user set, and
    the determinism settings whose value the user asked for (requested vs in effect)."""
    lcfg, rcfg = left.run_config["config"], right.run_config["config"]
    backends = {lcfg["backend"], rcfg["backend"]}
    la, ra = _settings(left.applied), _settings(right.applied)
    fields = []
    for d in notes.screen(flat_diff(*({k: v for k, v in c.items() if k not in _NOT_CONFIG} for c in (lcfg, rcfg)), "config"),
                          "run_config"):
        key = d["field"].split(".")[1]
        full = {**d, "field": "run_config." + d["field"]}
        if key in INERT_CONFIG:
            notes.note(full, INERT_CONFIG[key])
        elif key == "logprobs" and not backends & set(LOGPROBS_COUNT_MATTERS):
            notes.note(full, "how many (id, logprob) pairs are recorded does not change this engine's computation; "
                             "top-k lists are compared over the common top-min(k)")
        elif key in la and key in ra and la[key].get("value") == ra[key].get("value") and la[key].get("applied") == ra[key].get("applied"):
            notes.note(full, f"requested differently, but the same {key} was in effect on both sides")
        else:
            fields.append(d)
    # the dtype: compared in effect, on every backend; requested differently -> CONFIG
    ld, rd = dtype_in_effect(left), dtype_in_effect(right)
    if ld != rd:
        routed.dtype = {"left": ld, "right": rd, "requested": lr(lcfg.get("dtype"), rcfg.get("dtype"))}
        if lcfg.get("dtype") != rcfg.get("dtype"):
            fields.append({"field": "config.dtype", "left": lcfg.get("dtype"), "right": rcfg.get("dtype")})
    elif lcfg.get("dtype") != rcfg.get("dtype"):
        notes.note({"field": "run_config.config.dtype", "left": lcfg.get("dtype"), "right": rcfg.get("dtype")},
                   f"requested differently, but both ran in {ld}")
    applied: list[dict[str, Any]] = []
    if lcfg["backend"] == rcfg["backend"]:
        user_keys = set(lcfg.get("options") or {}) | set(rcfg.get("options") or {})
        for d in notes.screen(flat_diff(left.run_config["backend_options"], right.run_config["backend_options"], "backend_options"),
                              "run_config"):
            key = d["field"].split(".")[1]
            if key in INERT_OPTIONS:
                notes.note({**d, "field": "run_config." + d["field"]}, INERT_OPTIONS[key])
            elif key in user_keys:
                fields.append(d)
            elif key in BATCH_DERIVED:
                routed.batch.append(d)
            else:
                routed.machine.append({**d, "field": "run_config." + d["field"] + " (default)"})
        for name in sorted(set(la) | set(ra)):
            a, b = la.get(name), ra.get(name)
            if name == "dtype" or (a and b and a.get("applied") == b.get("applied") and a.get("value") == b.get("value")):
                continue
            diffs = notes.screen(flat_diff(*({"applied": s.get("applied"), "value": s.get("value")} if s else ABSENT for s in (a, b)),
                                           f"settings.{name}"), "determinism_applied")
            origin = _origin(a or b, user_keys)
            if name in INERT_OPTIONS:
                for d in diffs:
                    notes.note({**d, "field": "determinism_applied." + d["field"]}, INERT_OPTIONS[name])
            elif origin == "user":
                applied += diffs
            elif origin == "batch":
                routed.batch += diffs
            else:
                routed.machine += [{**d, "field": "determinism_applied." + d["field"] + " (chosen by the machine)"} for d in diffs]
        te = (left.applied or {}).get("tier_effective"), (right.applied or {}).get("tier_effective")
        if te[0] != te[1]:
            notes.note({"field": "determinism_applied.tier_effective", "left": te[0], "right": te[1]}, INERT_CONFIG["tier"])
    if not fields and not applied:
        return None
    ev: dict[str, Any] = {"fields": cut(fields), "applied": cut(applied), "count": len(fields) + len(applied)}
    if routed.dtype is not None and lcfg.get("dtype") != rcfg.get("dtype"):
        ev["dtype_in_effect"] = lr(ld, rd)
    return ev
