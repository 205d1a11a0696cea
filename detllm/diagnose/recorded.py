"""Diagnosing a diff whose two sides were recorded with different settings: which of the
recorded differences the divergence follows.

Owns the knobs of a diff (RunConfig fields and backend options that differ between the two
sides' run_config.json) and their probes: the left side's settings re-run as they were (is the
left side reproducible?), then with one differing setting switched to the right side's value.
The knob whose switch reproduces the right side is the one the divergence follows. Backend or
model differences are named, never probed: one knob cannot turn one engine into another.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from .. import artifacts
from ..compare.engine import compare, select
from ..config import RunConfig
from .probes import Probe

UNPROBED = ("backend", "model", "revision", "device")  # an engine or weights change is the cause itself
IGNORED = ("runs", "vary_batch", "tier", "mode", "record_prompt_text", "atol", "fresh_process", "negative_control", "logprobs")


def sides(diff_dir: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(report, left summary, right summary) of a diff folder; each side's folder resolved."""
    rep = artifacts.read_json(diff_dir / artifacts.REPORT, "report")
    out = []
    for key in ("left", "right"):
        s = dict(rep["summary"][key])
        folder = Path(s["folder"])
        if not artifacts.is_detllm_folder(folder) and artifacts.is_detllm_folder(diff_dir.parent / folder):
            folder = diff_dir.parent / folder
        if not artifacts.is_detllm_folder(folder):
            from ..errors import ArtifactError

            raise ArtifactError(f"the diff's {key} side {s['folder']!r} is not a run folder here", hint="diagnose the run folders themselves")
        s["path"] = folder
        out.append(s)
    return rep, out[0], out[1]


def differences(left: RunConfig, right: RunConfig, lb: int, rb: int) -> tuple[list[Probe], list[dict[str, str]]]:
    """(one probe per probeable difference, the differences named but not probed)."""
    probes: list[Probe] = []
    named: list[dict[str, str]] = []
    a, b = left.to_json(), right.to_json()
    for f in UNPROBED:
        if a.get(f) != b.get(f):
            named.append({"knob": f, "reason": f"the sides differ in {f} ({a.get(f)!r} vs {b.get(f)!r}): that is the recorded cause itself"})
    if named:
        return [], named
    for f in ("dtype", "threads", "seed"):
        if a[f] != b[f]:
            probes.append(Probe(f"{f}={b[f]}", f, "recorded", f"whether switching {f} alone reproduces the right side", 1.0,
                                threads=b[f] if f == "threads" else None, dtype=b[f] if f == "dtype" else None,
                                options={"__seed": str(b[f])} if f == "seed" else {}))
    for f, v in b["decoding"].items():
        if a["decoding"].get(f) != v:
            probes.append(Probe(f"{f}={v}", f, "recorded", f"whether switching {f} alone reproduces the right side", 1.0,
                                options={f"__decoding.{f}": str(v)}))
    for k in sorted(set(a["options"]) | set(b["options"])):
        if a["options"].get(k) != b["options"].get(k) and k not in ("bin", "port"):
            probes.append(Probe(f"{k}={b['options'].get(k)}", k, "recorded", f"whether switching {k} alone reproduces the right side",
                                1.0, options={k: b["options"].get(k) or ""}))
    if lb != rb:
        probes.append(Probe(f"batch_size={rb}", "batch_size", "recorded", "whether the batch size alone reproduces the right side", 1.0,
                            options={"__batch_size": str(rb)}))
    return probes, named


def probe_config(left: RunConfig, right: RunConfig, probe: Probe | None, batch: int) -> RunConfig:
    """The left side's settings (one run at `batch`), with the probe's one switch applied."""
    cfg = dataclasses.replace(left, runs=1, vary_batch=(), batch_size=batch, mode="best-effort", fresh_process=0, negative_control=False)
    if probe is None:
        return cfg
    opts = {k: v for k, v in probe.options.items() if not k.startswith("__")}
    if opts:
        merged = dict(cfg.options)
        for k, v in opts.items():
            if v:
                merged[k] = v
            else:
                merged.pop(k, None)  # the right side did not set it
        cfg = dataclasses.replace(cfg, options=tuple(sorted(merged.items())))
    for k, v in probe.options.items():
        if k == "__seed":
            cfg = dataclasses.replace(cfg, seed=right.seed)
        elif k == "__batch_size":
            cfg = dataclasses.replace(cfg, batch_size=int(v))
        elif k.startswith("__decoding."):
            field = k.removeprefix("__decoding.")
            cfg = dataclasses.replace(cfg, decoding=dataclasses.replace(cfg.decoding, **{field: getattr(right.decoding, field)}))
    return probe.apply(cfg) if (probe.threads is not None or probe.dtype is not None) else cfg


def same(records: list[dict[str, Any]], side: list[dict[str, Any]], *, tier: int, same_batch: bool, atol: float) -> dict[str, Any]:
    """Compare a probe's records with one side's: diverged?, first position, max |dlogprob|."""
    c = compare(side, records, name="probe vs side", kind="diff", left_label="side", right_label="probe", required=True,
                check_logprobs=tier >= 3 or (tier == 2 and same_batch), atol=atol)
    first = c["first_divergence"]
    dr = c["drift"]
    return {"diverged": c["status"] != "PASS", "prompts_diverged": c["prompts_diverged"],
            "first": None if first is None else {"prompt_index": first["prompt_index"], "token_index": first["token_index"], "kind": first["kind"]},
            "max_abs_logprob_diff": dr.get("max_abs_logprob_diff") if dr.get("available") else None}


def side_records(summary: dict[str, Any]) -> list[dict[str, Any]]:
    records = artifacts.load_trace(Path(summary["path"]) / artifacts.TRACE, validate_records=False)
    return select(records, run=summary["run_index"], batch=summary["batch_size"])
