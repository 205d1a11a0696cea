"""`detllm train-check --axis threads=1,2 --axis grad_accumulation=1,2 --axis dtype=float32,bfloat16`:
which setting changes the bits of training, and at which step and parameter. The base cell (each
axis at its first value) runs twice (it must repeat itself, or nothing can be blamed on an axis);
then each other value of each axis runs with only that axis changed, compared bit for bit with
the base. Axes use the tool's one --axis parser (config.parse_axes). Owns the plan, axes.json and
its text; the runs are loop.py's, the comparison verdict.py's.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

from ..runfolder import artifacts
from ..core.config import parse_axes
from ..runfolder.env import detllm_version
from ..runfolder.integrity import seal
from ..core.errors import UsageError
from .pack import TrainingOutcome
from .verdict import first_divergence

AXES = {"threads": int, "grad_accumulation": int, "dtype": str}
AXES_JSON = "axes.json"


def plan(specs: list[str]) -> list[tuple[str, list[str]]]:
    axes = parse_axes(specs, int_axes=[n for n, k in AXES.items() if k is int], command="train-check --axis",
                      example="threads=1,2")
    for name, values in axes:
        if name not in AXES:
            raise UsageError(f"--axis {name}: train-check varies {', '.join(AXES)}", hint="e.g. --axis grad_accumulation=1,2")
        if len(values) < 2:
            raise UsageError(f"--axis {name} needs at least two values to compare, got {values[0]!r}")
    return axes


def _cell_config(base: dict[str, Any], cell: dict[str, str]) -> dict[str, Any]:
    cfg = copy.deepcopy(base)
    for name, value in cell.items():
        cfg[name] = AXES[name](value)
    return cfg


def _as_base(records: list[dict[str, Any]], base: list[dict[str, Any]], same_samples_batch: bool) -> list[dict[str, Any]]:
    """A cell's records with what its axis changes by definition made equal to the base's: the
    config digest (and so h), and, for gradient accumulation, the batch digest where the same
    samples were drawn (micro-batching re-cuts the same rows). What remains is what the bits did."""
    out = []
    by = {r.get("step"): r for r in base[1:]}
    for r in records:
        r = dict(r)
        ref = base[0] if r["artifact_type"] == "train_genesis" else by.get(r["step"], {})
        r["h"] = ref.get("h", r["h"])
        if r["artifact_type"] == "train_genesis":
            r["config_sha256"] = ref["config_sha256"]
        elif same_samples_batch and r["samples"] == ref.get("samples"):
            r["batch_sha256"] = ref["batch_sha256"]
        out.append(r)
    return out


def _max_abs(a: Any, b: Any) -> float | None:
    if a is None or b is None or a.shape != b.shape:
        return None
    d = (a.double() - b.double()).abs().max().item()
    return d if d == d and d != float("inf") else None


def run_axes(config: dict[str, Any], model_path: Path, specs: list[str], *, out: str | Path | None = None,
             force: bool = False) -> TrainingOutcome:
    """Run the base cell twice and every one-axis change once (each in this process, from genesis);
    name for each change whether the bits changed, the first divergent step, field and parameter and
    max |Δ| there. PASS: the base repeated itself bitwise (the axes' findings are then attributable)."""
    from .loop import RunRequest, run_steps

    axes = plan(specs)
    base_cell = {name: values[0] for name, values in axes}
    base = _cell_config(config, base_cell)
    if base["task"].get("batch_size") and any(n == "grad_accumulation" for n, _ in axes):
        for _, values in (a for a in axes if a[0] == "grad_accumulation"):
            bad = [v for v in values if base["task"]["batch_size"] % int(v)]
            if bad:
                raise UsageError(f"--axis grad_accumulation={bad[0]} does not divide the batch size {base['task']['batch_size']}")
    out = Path(out) if out is not None else artifacts.default_out_dir("train-axes")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not ((out / AXES_JSON).is_file() and force))):
        raise UsageError(f"--out {str(out)!r} is not an empty folder", hint="choose another --out (or --force over earlier axes)")
    if out.is_dir():
        shutil.rmtree(out)
    (out / "cells").mkdir(parents=True)

    def run(cfg: dict[str, Any], name: str, reference: str | None = None, keep: bool = False) -> Any:
        return run_steps(RunRequest(config=cfg, model_path=str(model_path), run=0, seed=cfg["seed"], stop=cfg["steps"],
                                    steps_file=str(out / "cells" / f"{name}.jsonl"), reference=reference, keep_tensors=keep))

    label = ",".join(f"{k}={v}" for k, v in base_cell.items())
    ref = run(base, "base", keep=True)
    again = run(base, "base-repeat", reference=str(out / "cells" / "base.jsonl"))
    rows = [_row({"base": label}, "base repeated", ref, again, ref.records)]
    for name, values in axes:
        for value in values[1:]:
            cell = {**base_cell, name: value}
            got = run(_cell_config(config, cell), f"{name}={value}", reference=str(out / "cells" / "base.jsonl"))
            rows.append(_row({name: value}, f"{name} {values[0]} -> {value}", ref,
                             got, _as_base(got.records, ref.records, name == "grad_accumulation")))
    repeatable = rows[0]["bits_changed"] is False
    doc = artifacts.stamp("train_axes", {
        "detllm_version": detllm_version(), "created_at": artifacts.utc_now(), "model": config["model"]["id"],
        "steps": config["steps"], "seed": config["seed"], "axes": [{"name": n, "values": v} for n, v in axes], "base": base_cell,
        "verdict": "PASS" if repeatable else "FAIL", "cells": rows,
    })
    artifacts.write_json(out, AXES_JSON, doc)
    text = render_axes(doc)
    artifacts.atomic_write_text(out / "axes.txt", text)
    seal(out)  # verify and pack take it (training/results.py re-derives the base's repeat)
    return TrainingOutcome(doc, out, text)


def _row(change: dict[str, str], what: str, ref: Any, got: Any, normalised: list[dict[str, Any]]) -> dict[str, Any]:
    div = first_divergence(ref.records, normalised, run=1, test_options={})
    row: dict[str, Any] = {"change": change, "what": what, "bits_changed": div is not None, "first_divergence": div,
                           "abs_loss_diff": None, "seconds": got.seconds}
    if div is not None and div["step"] is not None:  # evidence of size: the loss of that step on both sides, from the records
        la = next((r["loss"] for r in ref.records[1:] if r["step"] == div["step"]), None)
        lb = next((r["loss"] for r in normalised[1:] if r["step"] == div["step"]), None)
        row["abs_loss_diff"] = abs(la - lb) if la is not None and lb is not None else None
    if div is not None and div["parameter"] and div["step"] is not None and got.divergent_step == div["step"]:
        kept = ref.kept.get(div["step"], {}).get(div["parameter"])
        mine = (got.divergent or {}).get(div["parameter"])
        if kept is not None and mine is not None:
            grad = div["where"] == "grad"
            div["max_abs_diff"] = _max_abs(kept[0], mine[0]) if grad else _max_abs(kept[1], mine[1])
    return row


def render_axes(doc: dict[str, Any]) -> str:
    lines = [f"train-check axes: {'the base repeats bitwise' if doc['verdict'] == 'PASS' else 'FAIL: the base does not repeat itself'}"
             f" (base {', '.join(f'{k}={v}' for k, v in doc['base'].items())}, {doc['steps']} steps, seed {doc['seed']})"]
    for r in doc["cells"]:
        d = r["first_divergence"]
        if d is None:
            lines.append(f"  {r['what']}: same bits at every step")
            continue
        at = f"step {d['step']}" if d["step"] is not None else "the genesis"
        delta = f", max |Δ| {d['max_abs_diff']:.3g}" if d.get("max_abs_diff") is not None else ""
        loss = f"; |Δloss| there {r['abs_loss_diff']:.3g}" if r["abs_loss_diff"] is not None else ""
        lines.append(f"  {r['what']}: bits change at {at} ({d['where']}" + (f", parameter {d['parameter']}" if d["parameter"] else "")
                     + f"{delta}){loss}")
    return "\n".join(lines) + "\n"


def axes_from_args(*, model: str, steps: int, seed: int, batch_size: int, seq_len: int, dtype: str, threads: int | None,
                   grad_accumulation: int, specs: list[str], out: str | Path | None, force: bool) -> TrainingOutcome:
    """train-check --axis: the built-in task's config from train-check's options, then run_axes."""
    from ..core.hashing import folder_identity
    from ..models import resolve_model
    from .check import make_config

    plan(specs)  # a bad axis is refused before the model is touched
    resolved = resolve_model(model)
    if resolved.path is None or not resolved.path.is_dir():
        raise UsageError(f"--model {model!r}: train-check needs a built-in model or a local model folder")
    config = make_config(model_id=model, identity=folder_identity(model, resolved.path).to_json(), steps=steps, seed=seed,
                         threads=threads, batch_size=batch_size, seq_len=seq_len, grad_accumulation=grad_accumulation, dtype=dtype,
                         checkpoint_every=None, test_options={})
    return run_axes(config, resolved.path, specs, out=out, force=force)


__all__ = ["AXES", "axes_from_args", "plan", "render_axes", "run_axes"]
