"""The comparison of two training runs' records, bit for bit: the first divergent step, the first
field that differs there (genesis fields, then RNG state, batch, gradients, loss, values), the
first parameter by name whose gradient or value differs, and the cause those fields name. Reads
records only (no torch); max |Δ| is filled in by the caller where it holds both tensors.
"""

from __future__ import annotations

from typing import Any

IGNORED = frozenset({"seconds", "run", "schema_version", "artifact_type"})  # never compared
_SEEDED = ("rng", "batch")  # with different seeds these differ first


def sorted_names(tensors: dict[str, Any]) -> list[str]:
    """Parameter names in H's order (UTF-8 bytes)."""
    return sorted(tensors, key=lambda n: n.encode("utf-8"))


def step_differs(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two train_step records differ in anything but wall time and run number (h excluded: it
    carries the genesis; a step is judged by what it computed)."""
    return any(a.get(k) != b.get(k) for k in set(a) | set(b) if k not in IGNORED and k != "h")


def differing_parameters(a: dict[str, Any], b: dict[str, Any], key: str) -> list[str]:
    ta, tb = a.get("tensors", {}), b.get("tensors", {})
    return [n for n in sorted_names({**ta, **tb}) if (ta.get(n) or {}).get(key) != (tb.get(n) or {}).get(key)]


def _where(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, str | None, list[str]]:
    """(field, parameter, parameters differing) of the first difference of two step records."""
    if a["rng_sha256"] != b["rng_sha256"]:
        first = "rng"
    elif a["batch_sha256"] != b["batch_sha256"] or a["samples"] != b["samples"]:
        first = "batch"
    elif differing_parameters(a, b, "grad_sha256"):
        first = "grad"
    elif a["loss"] != b["loss"]:
        first = "loss"
    else:
        first = "value"
    grads, values = differing_parameters(a, b, "grad_sha256"), differing_parameters(a, b, "value_sha256")
    changed = sorted(set(grads) | set(values), key=lambda n: n.encode("utf-8"))
    param = (grads or values or [None])[0] if first != "value" else (values or [None])[0]
    return first, param, changed


def first_divergence(ref: list[dict[str, Any]], other: list[dict[str, Any]], *, run: int,
                     test_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The first divergence of `other` (run `run`) from `ref` (run 0), each a genesis record then
    step records; None when bitwise equal at every step. `max_abs_diff` is left None here."""
    g_ref, g_oth = ref[0], other[0]
    steps_ref = {r["step"]: r for r in ref[1:]}
    steps_oth = {r["step"]: r for r in other[1:]}
    step, where, param, changed = None, None, None, []
    for t in sorted(set(steps_ref) | set(steps_oth)):
        a, b = steps_ref.get(t), steps_oth.get(t)
        if a is None or b is None:
            step, where = t, "length"
            break
        if step_differs(a, b):
            step = t
            where, param, changed = _where(a, b)
            break
    genesis_where = None
    if g_ref["config_sha256"] != g_oth["config_sha256"]:
        genesis_where = "config"
    elif g_ref["seed"] != g_oth["seed"]:
        genesis_where = "seed"
    elif g_ref["params_sha256"] != g_oth["params_sha256"]:
        genesis_where = "params_init"
        changed = differing_parameters(g_ref, g_oth, "value_sha256")
        param = changed[0] if changed else None
    if genesis_where is None and step is None:
        return None
    where = genesis_where or where
    cause, detail = _cause(where, step, param, g_ref, g_oth, run, test_options or {})
    return {"run": run, "step": step, "where": where, "parameter": param, "parameters_differing": len(changed),
            "max_abs_diff": None, "cause": cause, "detail": detail}


def _cause(where: str, step: int | None, param: str | None, g_ref: dict[str, Any], g_oth: dict[str, Any], run: int,
           opts: dict[str, Any]) -> tuple[str, str]:
    at = f"step {step}" if step is not None else "the genesis"
    of = f" of {param}" if param else ""
    tamper = opts.get("grad_add")
    if where == "seed":
        recorded = opts.get("repeat_seed", {}).get("run") == run
        how = " (test option repeat_seed)" if recorded else ""
        return "seed", (f"run {run} started from seed {g_oth['seed']}{how}, run 0 from seed {g_ref['seed']}: every RNG stream "
                        f"differs, so the first step's RNG state (R_0), batch and dropout masks differ")
    if tamper and tamper["run"] == run and where in ("grad", "loss", "value") and step is not None and step >= tamper["step"]:
        return "test_option", (f"{where}{of} differs at {at}: run {run} had {tamper['value']!r} added to every element of "
                               f"{tamper['parameter']}'s gradient at step {tamper['step']} (test option grad_add)")
    if where == "rng":
        return "rng", f"the RNG state at the start of {at} differs with the same seed: a source was not captured or restored"
    if where == "batch":
        return "data_order", f"the batch of {at} differs (its samples or token ids): the data order was not reproduced"
    if where in ("config", "params_init"):
        return "unknown", f"the runs started from a different {'configuration' if where == 'config' else 'θ_init'}{of}"
    if where == "length":
        return "unknown", f"one run has no record of {at}"
    return "numerics", (f"{where}{of} differs at {at} with the same seed, RNG state and batch: the same inputs gave other "
                        f"bits (threads, kernels, accumulation order)")


__all__ = ["IGNORED", "differing_parameters", "first_divergence", "sorted_names", "step_differs"]
