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
import json
import time
from pathlib import Path
from typing import Any

from .. import artifacts
from ..compare.engine import compare, select
from ..config import RunConfig
from ..env import detllm_version
from .folder import DIAGNOSIS, Diagnosis, prompts_from_records, slug
from .pool import Pool
from .probes import Probe
from .ranking import _lp
from .render import render_markdown, render_text

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


def diagnose_diff(diff_dir: Path, out: Path, limits, progress) -> Any:
    """Probe the recorded differences of a diff (py); None when the two sides were
    recorded with the same settings (the caller then diagnoses the left side as a check)."""
    rep, left, right = sides(diff_dir)
    lrun, rrun = artifacts.load_run(left["path"]), artifacts.load_run(right["path"])
    lc, rc = RunConfig.from_json(lrun.run_config["config"]), RunConfig.from_json(rrun.run_config["config"])
    probes, named = differences(lc, rc, left["batch_size"], right["batch_size"])
    if not probes and not named:
        return None
    tier, atol = rep["tier"]["requested"], rep["summary"].get("atol", 0.0)
    texts = prompts_from_records(lrun.records, str(diff_dir))
    comp = rep["comparisons"][0]
    first = rep["first_divergence"]
    dr = comp["drift"]
    baseline = {"diverged": rep["status"] == "FAIL", "kinds": ["diff"], "diverged_batch_sizes": [],
                "first": None if first is None else {k: first[k] for k in ("prompt_index", "token_index", "kind")},
                "max_abs_logprob_diff": dr.get("max_abs_logprob_diff") if dr.get("available") else None,
                "argmax_flips": dr.get("argmax_flips", 0) if dr.get("available") else 0, "prompts_diverged": comp["prompts_diverged"]}
    out.mkdir(parents=True, exist_ok=True)
    prompts_file = out / "prompts.jsonl"
    artifacts.atomic_write_text(prompts_file, "".join(json.dumps({"prompt": t}, ensure_ascii=False) + "\n" for t in texts))
    lrec, rrec = side_records(left), side_records(right)
    t0, used, results, not_run = time.monotonic(), 0, [], []
    plan_ = [None] + probes if baseline["diverged"] else []
    with Pool(out / "logs") as pool:
        for probe in plan_:
            name = probe.name if probe else "left settings again"
            if (limits.probes is not None and used >= limits.probes) or (limits.seconds is not None and time.monotonic() - t0 >= limits.seconds):
                not_run.append({"name": name, "reason": "skipped: the --budget is spent"})
                continue
            used += 1
            if progress:
                progress(f"probe {used}: {name}")
            batch = right["batch_size"] if probe and probe.knob == "batch_size" else left["batch_size"]
            cfg = probe_config(lc, rc, probe, batch)
            folder = out / "probes" / slug(name)
            started = time.monotonic()
            res = pool.shared().run({"kind": "run", "config": cfg.to_json(), "prompts": str(prompts_file), "tier": tier, "out": str(folder)})
            entry: dict[str, Any] = {"name": name, "knob": probe.knob if probe else "reproducibility", "kind": "recorded" if probe else "rerun",
                                     "setting": probe.setting() if probe else {}, "proves": probe.proves if probe else
                                     "whether the left side's own settings reproduce it (else the diff is run variance)",
                                     "status": "ran", "outcome": None, "evidence": {}, "folder": str(folder.relative_to(out))}
            if not res.get("ok"):
                entry.update(status="error", reason=res.get("error", "the probe failed"))
            else:
                got = select(artifacts.load_trace(folder / artifacts.TRACE, validate_records=False), run=0, batch=batch)
                vs_right = same(got, rrec, tier=tier, same_batch=batch == right["batch_size"], atol=atol)
                vs_left = same(got, lrec, tier=tier, same_batch=batch == left["batch_size"], atol=atol)
                entry["evidence"] = {"vs_right": vs_right, "vs_left": vs_left, **{k: vs_right[k] for k in ("first", "max_abs_logprob_diff")}}
                entry["outcome"] = "follows" if not vs_right["diverged"] else ("persist" if not vs_left["diverged"] else "move")
            entry["seconds"] = round(time.monotonic() - started, 2)
            results.append(entry)
    knobs = []
    for r in results:
        if r["status"] != "ran" or r["kind"] != "recorded":
            continue
        verdict = {"follows": "follows", "move": "moves", "persist": "not_followed"}[r["outcome"]]
        what = {"follows": "reproduce the right side", "move": "change the output, but not into the right side's",
                "persist": "change nothing: the output stays the left side's"}[r["outcome"]]
        knobs.append({"knob": r["knob"], "verdict": verdict, "probes": [r["name"]],
                      "summary": f"the left side's settings with {r['name']} {what}" + _lp(r["evidence"])})
    order = {"follows": 0, "moves": 1, "not_followed": 2}
    knobs.sort(key=lambda k: order[k["verdict"]])
    for i, k in enumerate(knobs, 1):
        k["rank"] = i
    rerun = next((r for r in results if r["kind"] == "rerun" and r["status"] == "ran"), None)
    follows = [k for k in knobs if k["verdict"] == "follows"]
    if not baseline["diverged"]:
        text = f"Nothing to diagnose: the diff passes at tier {tier}."
    elif named:
        text = "The sides differ in " + "; ".join(n["reason"].split(": ")[0].removeprefix("the sides differ in ") for n in named) + \
               ": that recorded difference is the cause; no single setting can be probed across it."
    elif follows:
        text = ("The divergence follows " + " and ".join(f"{k['knob']} ({k['summary']})" for k in follows) + ".")
    else:
        text = "Nothing isolates it: no single recorded difference reproduces the right side."
    if rerun is not None and rerun["outcome"] not in ("persist",) and baseline["diverged"] and not named:
        text += " Note: the left side's own settings did not reproduce the left side, so run variance is also at play."
    doc = artifacts.stamp("diagnosis", {
        "detllm_version": detllm_version(), "created_at": artifacts.utc_now(),
        "source": {"kind": "diff", "path": str(diff_dir), "left": str(left["path"]), "status": rep["status"],
                   "recorded_causes": [c["code"] for c in rep["causes"]]},
        "backend": lc.backend, "model": lc.model, "config": lc.to_json(), "tier_requested": tier, "baseline": baseline,
        "budget": {"probes": limits.probes, "seconds": limits.seconds, "probes_used": used, "seconds_used": round(time.monotonic() - t0, 2),
                   "exhausted": bool(not_run)},
        "probes": results, "not_run": not_run, "skipped_knobs": named, "knobs": knobs, "passing_settings": None,
        "prefill_vs_decode": None, "isolated": bool(follows), "conclusion": text,
    })
    artifacts.write_json(out, DIAGNOSIS, doc)
    artifacts.atomic_write_text(out / "diagnosis.txt", render_text(doc))
    artifacts.atomic_write_text(out / "diagnosis.md", render_markdown(doc))
    return Diagnosis(out, doc)
