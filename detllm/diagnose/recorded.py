"""Diagnosing a diff whose two sides were recorded with different settings: which of the
recorded differences the divergence follows.

Owns the knobs of a diff (RunConfig fields and backend options that differ between the two
sides' run_config.json and can change the computation, and the kernel-steering variables of their
env.json, see envknobs.py) and their probes: the left side's settings re-run as they were (is the
left side reproducible?), then with one differing setting switched to the right side's value.
The knob whose switch reproduces the right side is the one the divergence follows. Backend or
model differences are named, never probed: one knob cannot turn one engine into another.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..runfolder import artifacts
from ..compare.causes import INERT_CONFIG, INERT_OPTIONS, LOGPROBS_COUNT_MATTERS
from ..compare.engine import compare, select
from ..core.config import RunConfig
from ..runfolder.env import detllm_version
from ..core.errors import ArtifactError
from . import envknobs
from .folder import Diagnosis, prompts_from_records, slug, write_diagnosis
from .pool import Pool
from .probes import Probe
from .ranking import _lp

UNPROBED = ("backend", "model", "revision", "device")  # an engine or weights change is the cause itself
# RunConfig fields that select checks or record keeping, never the computation (with compare/causes' INERT_CONFIG)
NOT_COMPUTATION = ("runs", "vary_batch", "record_prompt_text", "atol", "fresh_process", "negative_control", *INERT_CONFIG)
SWITCHED = ("dtype", "threads", "seed", "logprobs")  # RunConfig fields set to the right side's value, None included


@dataclass
class DiffPlan:
    """What diagnose can do with a diff folder: its sides, one probe per recorded difference it
    can switch, the differences named but not probed, and the environment it cannot switch."""

    report: dict[str, Any]
    left: dict[str, Any]  # the diff's side summaries, each with its folder as "path"
    right: dict[str, Any]
    lrun: artifacts.RunFolder
    lc: RunConfig
    rc: RunConfig
    probes: list[Probe]
    named: list[dict[str, str]]  # backend, model...: the cause itself, not probed
    env: dict[str, tuple[str | None, str | None]]  # switchable variables: (left, right) values
    cannot: list[str]  # recorded environment differences not switched here

    def knobs(self) -> list[str]:
        return sorted({p.knob for p in self.probes} | {p.name for p in self.probes} | {"reproducibility"})


def sides(diff_dir: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(report, left summary, right summary) of a diff folder; each side's folder resolved (diff.folder_sides)."""
    from ..commands.diff import folder_sides

    return folder_sides(diff_dir)


def plan_diff(diff_dir: Path) -> DiffPlan:
    """Read a diff folder's sides and list its probeable differences; runs nothing, writes nothing."""
    rep, left, right = sides(diff_dir)
    lrun, rrun = artifacts.load_run(left["path"]), artifacts.load_run(right["path"])
    lc, rc = RunConfig.from_json(lrun.run_config["config"]), RunConfig.from_json(rrun.run_config["config"])
    probes, named = differences(lc, rc, left["batch_size"], right["batch_size"])
    env, cannot = envknobs.differences(lrun.env, rrun.env)
    if not named:
        probes += [Probe(f"{k}={'unset' if v[1] is None else v[1]}", k, "recorded",
                         f"whether setting {k} alone as the right side had it reproduces the right side (a fresh process)", 1.0,
                         env={k: v[1]}, fresh=True) for k, v in env.items()]
    return DiffPlan(rep, left, right, lrun, lc, rc, probes, named, env if not named else {}, cannot)


def _matters(field: str, backend: str) -> bool:
    """Whether a difference in this RunConfig field can change the computation (compare/causes' rules)."""
    if field in NOT_COMPUTATION:
        return False
    return field != "logprobs" or backend in LOGPROBS_COUNT_MATTERS


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
    for f in SWITCHED:
        if a[f] != b[f] and _matters(f, left.backend):
            probes.append(Probe(f"{f}={b[f]}", f, "recorded", f"whether switching {f} alone reproduces the right side", 1.0,
                                config={f: b[f]}))
    for f, v in b["decoding"].items():
        if a["decoding"].get(f) != v:
            probes.append(Probe(f"{f}={v}", f, "recorded", f"whether switching {f} alone reproduces the right side", 1.0,
                                config={f"decoding.{f}": v}))
    for k in sorted(set(a["options"]) | set(b["options"])):
        if a["options"].get(k) != b["options"].get(k) and k not in INERT_OPTIONS:
            probes.append(Probe(f"{k}={b['options'].get(k)}", k, "recorded", f"whether switching {k} alone reproduces the right side",
                                1.0, options={k: b["options"].get(k) or ""}))
    if lb != rb:
        probes.append(Probe(f"batch_size={rb}", "batch_size", "recorded", "whether the batch size alone reproduces the right side", 1.0,
                            config={"batch_size": rb}))
    return probes, named


def probe_config(left: RunConfig, right: RunConfig, probe: Probe | None, batch: int) -> RunConfig:
    """The left side's settings (one run at `batch`), with the probe's one switch applied: a
    RunConfig field takes the right side's value as it is (None, the engine's default, included)."""
    cfg = dataclasses.replace(left, runs=1, vary_batch=(), batch_size=batch, mode="best-effort", fresh_process=0, negative_control=False)
    if probe is None:
        return cfg
    if probe.options:
        merged = dict(cfg.options)
        for k, v in probe.options.items():
            if v:
                merged[k] = v
            else:
                merged.pop(k, None)  # the right side did not set it
        cfg = dataclasses.replace(cfg, options=tuple(sorted(merged.items())))
    for f in probe.config:
        if f == "batch_size":
            cfg = dataclasses.replace(cfg, batch_size=batch)
        elif f.startswith("decoding."):
            name = f.removeprefix("decoding.")
            cfg = dataclasses.replace(cfg, decoding=dataclasses.replace(cfg.decoding, **{name: getattr(right.decoding, name)}))
        else:
            cfg = dataclasses.replace(cfg, **{f: getattr(right, f)})
    return cfg


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


def diagnose_diff(plan: DiffPlan, diff_dir: Path, out: Path, limits, progress, only: list[str] | None = None,
                  pool_factory=None) -> Diagnosis:
    """Probe the recorded differences of a diff (plan_diff): the left side's settings again,
    then each difference switched to the right side's value; `only` keeps the probes whose knob
    or name is listed (the re-run of the left side always runs: it is what the others are read against)."""
    rep, left, right, lc, rc = plan.report, plan.left, plan.right, plan.lc, plan.rc
    tier, atol = rep["tier"]["requested"], rep["summary"].get("atol", 0.0)
    texts = prompts_from_records(plan.lrun.records, str(diff_dir))
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
    t0, used, results = time.monotonic(), 0, []
    selected = [p for p in plan.probes if not only or p.knob in only or p.name in only]
    not_run = [{"name": p.name, "reason": "not selected by --probe"} for p in plan.probes if p not in selected]
    plan_ = [None, *selected] if baseline["diverged"] else []
    with (pool_factory or Pool)(out / "logs") as pool:
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
            job = {"kind": "run", "config": cfg.to_json(), "prompts": str(prompts_file), "tier": tier, "out": str(folder)}
            if plan.env:  # the environment differs: every probe in a fresh process with the left side's variables
                res = pool.fresh(job, env=envknobs.worker_env(plan.env, probe.env if probe else {}))
            else:
                res = pool.shared().run(job)
            entry: dict[str, Any] = {"name": name, "knob": probe.knob if probe else "reproducibility", "kind": "recorded" if probe else "rerun",
                                     "setting": probe.setting() if probe else {f"env.{k}": v[0] for k, v in plan.env.items()},
                                     "proves": probe.proves if probe else
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
    knobs = _rank(results)
    follows = [k for k in knobs if k["verdict"] == "follows"]
    skipped = plan.named + unswitched(plan.cannot)
    doc = artifacts.stamp("diagnosis", {
        "detllm_version": detllm_version(), "created_at": artifacts.utc_now(),
        "source": {"kind": "diff", "path": str(diff_dir), "left": str(left["path"]), "status": rep["status"],
                   "recorded_causes": [c["code"] for c in rep["causes"]]},
        "backend": lc.backend, "model": lc.model, "config": lc.to_json(), "tier_requested": tier, "baseline": baseline,
        "budget": {"probes": limits.probes, "seconds": limits.seconds, "probes_used": used, "seconds_used": round(time.monotonic() - t0, 2),
                   "exhausted": any("budget" in n["reason"] for n in not_run)},
        "probes": results, "not_run": not_run, "skipped_knobs": skipped, "knobs": knobs, "passing_settings": None,
        "prefill_vs_decode": None, "isolated": bool(follows), "conclusion": _conclusion(plan, baseline, results, knobs, tier),
    })
    return write_diagnosis(out, doc)


def _rank(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
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
    return knobs


def unswitched(cannot: list[str]) -> list[dict[str, str]]:
    """skipped_knobs entries for the recorded environment differences diagnose cannot switch."""
    return [{"knob": c.split(" (")[0], "reason": f"a recorded environment difference diagnose cannot switch here: {c}"} for c in cannot]


def not_switched(cannot: list[str]) -> str:
    """The sentence that lists the recorded environment differences diagnose did not switch."""
    return f" Not switched here (recorded, but diagnose cannot set them): {'; '.join(cannot)}." if cannot else ""


def _conclusion(plan: DiffPlan, baseline: dict[str, Any], results: list[dict[str, Any]], knobs: list[dict[str, Any]], tier: int) -> str:
    rerun = next((r for r in results if r["kind"] == "rerun" and r["status"] == "ran"), None)
    follows = [k for k in knobs if k["verdict"] == "follows"]
    if not baseline["diverged"]:
        return f"Nothing to diagnose: the diff passes at tier {tier}."
    if plan.named:
        return "The sides differ in " + "; ".join(n["reason"].split(": ")[0].removeprefix("the sides differ in ") for n in plan.named) + \
               ": that recorded difference is the cause; no single setting can be probed across it."
    if follows:
        text = "The divergence follows " + " and ".join(f"{k['knob']} ({k['summary']})" for k in follows) + "."
    elif knobs and all(k["verdict"] == "not_followed" for k in knobs) and rerun is not None and rerun["outcome"] == "persist":
        text = ("Could not reproduce the right side here: the left side's settings reproduce the left side, and no recorded "
                "difference switched alone (" + ", ".join(k["probes"][0] for k in knobs) + ") changes its output.")
    else:
        text = "Nothing isolates it: no single recorded difference reproduces the right side."
    if rerun is not None and rerun["outcome"] != "persist":
        text += " Note: the left side's own settings did not reproduce the left side, so run variance is also at play."
    return text + (not_switched(plan.cannot) if not follows else "")
