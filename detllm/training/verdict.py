"""The comparison of two training runs' records, bit for bit: the first divergent step, the first
field that differs there (genesis fields, then RNG state, batch, gradients, loss, values), the
first parameter by name whose gradient or value differs, and the cause those fields name, weighed
by how far the loss and gradient norm moved against the training dtype's rounding. Reads records
only (no torch); max |Δ| is filled in by the caller where it holds both tensors.
"""

from __future__ import annotations

from typing import Any

IGNORED = frozenset({"seconds", "run", "schema_version", "artifact_type"})  # never compared
_SEEDED = ("rng", "batch")  # with different seeds these differ first
# The training dtype's machine epsilon (the spacing of its floats at 1): a relative change of the loss
# or gradient norm counted in these is counted in roundings of that dtype.
EPSILON = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10, "float64": 2.0**-52}
# Accumulation order (threads, kernels) moves the loss of the first divergent step by a few roundings,
# at most hundreds; a change of this many or more is not arithmetic but other inputs.
ROUNDINGS_FAR = 1000
_GRAD_FIGURES, _VALUE_FIGURES = ("grad_sha256", "grad_l2", "grad_max_abs"), ("value_sha256", "value_l2", "value_max_abs")


def sorted_names(tensors: dict[str, Any]) -> list[str]:
    """Parameter names in H's order (UTF-8 bytes)."""
    return sorted(tensors, key=lambda n: n.encode("utf-8"))


def step_differs(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two train_step records differ in anything but wall time and run number (h excluded: it
    carries the genesis; a step is judged by what it computed)."""
    return any(a.get(k) != b.get(k) for k in set(a) | set(b) if k not in IGNORED and k != "h")


def differing_parameters(a: dict[str, Any], b: dict[str, Any], key: str | tuple[str, ...]) -> list[str]:
    """Parameters (in H's order) whose `key` (or any of the keys) differs between two records."""
    ta, tb = a.get("tensors", {}), b.get("tensors", {})
    keys = (key,) if isinstance(key, str) else key
    return [n for n in sorted_names({**ta, **tb}) if any((ta.get(n) or {}).get(k) != (tb.get(n) or {}).get(k) for k in keys)]


def differing_fields(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Every field in which two step records differ (but seconds, run and the header), dotted down
    to the parameter for the per-tensor figures: e.g. ["loss", "samples", "tensors.lm_head.weight.grad_l2"]."""
    out = []
    for k in sorted(set(a) | set(b)):
        if k in IGNORED or a.get(k) == b.get(k):
            continue
        if k != "tensors":
            out.append(k)
            continue
        ta, tb = a.get(k) or {}, b.get(k) or {}
        for n in sorted_names({**ta, **tb}):
            x, y = ta.get(n) or {}, tb.get(n) or {}
            out += [f"tensors.{n}.{f}" for f in sorted(set(x) | set(y)) if x.get(f) != y.get(f)]
    return out


def magnitude(a: dict[str, Any], b: dict[str, Any], dtype: str) -> dict[str, Any]:
    """How far the loss and the gradient norm moved between two step records, absolute and in
    roundings of the training dtype (|Δ|/|x| / ε, the larger of the two)."""
    eps = EPSILON.get(dtype, EPSILON["float32"])
    out: dict[str, Any] = {"dtype": dtype if dtype in EPSILON else "float32", "roundings": 0.0}
    for key in ("loss", "grad_norm"):
        x, y = a.get(key), b.get(key)
        d = None if x is None or y is None else abs(x - y)
        out[f"abs_{key}_diff"] = d
        if d and x:
            out["roundings"] = max(out["roundings"], d / abs(x) / eps)
    return out


def _where(a: dict[str, Any], b: dict[str, Any], figures: bool = True) -> tuple[str, str | None, list[str]]:
    """(field, parameter, parameters differing) of the first difference of two step records;
    figures=False: version 3's rule (a parameter differs by its digests only)."""
    gf, vf = (_GRAD_FIGURES, _VALUE_FIGURES) if figures else ("grad_sha256", "value_sha256")
    if a["rng_sha256"] != b["rng_sha256"]:
        first = "rng"
    elif a["batch_sha256"] != b["batch_sha256"] or a["samples"] != b["samples"]:
        first = "batch"
    elif differing_parameters(a, b, gf) or (figures and a.get("grad_norm") != b.get("grad_norm")):
        first = "grad"  # a gradient's digest, or a figure recorded of the gradients (L2, max |x|, the norm)
    elif a["loss"] != b["loss"]:
        first = "loss"
    else:
        first = "value"
    grads, values = differing_parameters(a, b, gf), differing_parameters(a, b, vf)
    changed = sorted(set(grads) | set(values), key=lambda n: n.encode("utf-8"))
    param = (grads or values or [None])[0] if first != "value" else (values or [None])[0]
    return first, param, changed


def first_divergence(ref: list[dict[str, Any]], other: list[dict[str, Any]], *, run: int,
                     test_options: dict[str, Any] | None = None, dtype: str = "float32",
                     config: bool = True, rule: int = 4) -> dict[str, Any] | None:
    """The first divergence of `other` (run `run`) from `ref` (run 0), each a genesis record then
    step records; None when bitwise equal at every step. `max_abs_diff` is left None here.
    `dtype` is the training dtype (for the magnitude of a numerics cause); config=False leaves the
    genesis' H(config) out (two packs whose train_config.json differs: it must differ). rule=3 is
    version 3's derivation (no magnitude, no `unseeded`, digests only), to re-derive an old report."""
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
            where, param, changed = _where(a, b, figures=rule >= 4)
            break
    genesis_where = None
    if config and g_ref["config_sha256"] != g_oth["config_sha256"]:
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
    weigh = rule >= 4 and where in ("grad", "loss", "value")
    weight = magnitude(steps_ref[step], steps_oth[step], dtype) if weigh else None
    cause, detail = _cause(where, step, param, g_ref, g_oth, run, test_options or {}, weight)
    return {"run": run, "step": step, "where": where, "parameter": param, "parameters_differing": len(changed),
            "max_abs_diff": None, "cause": cause, "detail": detail}


def _cause(where: str, step: int | None, param: str | None, g_ref: dict[str, Any], g_oth: dict[str, Any], run: int,
           opts: dict[str, Any], weight: dict[str, Any] | None = None) -> tuple[str, str]:
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
    moved = _moved(weight) if weight else ""
    if weight and weight["roundings"] >= ROUNDINGS_FAR:
        return "unseeded", (f"{where}{of} differs at {at} with the same seed, RNG state and batch, and {moved}: far beyond "
                            f"accumulation order (under {ROUNDINGS_FAR} roundings): an unseeded random source or "
                            f"data-dependent code")
    return "numerics", (f"{where}{of} differs at {at} with the same seed, RNG state and batch: the same inputs gave other "
                        f"bits (threads, kernels, accumulation order)" + (f"; {moved}" if moved else ""))


def _moved(w: dict[str, Any]) -> str:
    """"|Δloss| 0.0117, |Δgrad_norm| 0.0021: 2.2e+04 float32 roundings"."""
    def g(x: float | None) -> str:
        return "-" if x is None else f"{x:.3g}"
    return (f"|Δloss| {g(w['abs_loss_diff'])}, |Δgrad_norm| {g(w['abs_grad_norm_diff'])}: "
            f"{w['roundings']:.3g} {w['dtype']} roundings of the larger relative change")


def describe(d: dict[str, Any]) -> str:
    """One divergence in words (train_report's summary after "FAIL: ")."""
    at = f"step {d['step']}" if d["step"] is not None else "genesis"
    param = f", parameter {d['parameter']}" if d["parameter"] else ""
    delta = f", max |Δ| {d['max_abs_diff']:.3g}" if d["max_abs_diff"] is not None else ""
    return f"run {d['run']} first differs at {at} ({d['where']}{param}{delta}); cause {d['cause']}: {d['detail']}"


def summary(first: dict[str, Any] | None, runs: int, steps: int) -> str:
    """train_report's summary line, from its first divergence (None: PASS)."""
    if first is None:
        return f"PASS: {runs} runs bitwise equal at every one of {steps} steps (gradients, parameters, losses, RNG state, batches)"
    return f"FAIL: {describe(first)}"


def earlier(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """a diverges at an earlier step than b (the genesis first); ties keep b, the earlier run."""
    return (-1 if a["step"] is None else a["step"]) < (-1 if b["step"] is None else b["step"])


__all__ = ["EPSILON", "IGNORED", "ROUNDINGS_FAR", "describe", "differing_fields", "differing_parameters", "earlier",
           "first_divergence", "magnitude", "sorted_names", "step_differs", "summary"]
