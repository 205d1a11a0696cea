"""`detllm diagnose`: from a failing check (or diff) to the knob the divergence follows.

Owns the order of events: read the failing folder or run the check, judge it at the tier the
user asked for, run the probe plan (diagnose/probes.py) in real worker processes within the
budget, stop once a setting makes the divergence vanish, confirm that setting in fresh
processes, rank the knobs and write the diagnosis folder. Judging lives in evidence.py,
rendering in render.py; every probe is a real run on the real engine.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..runfolder import artifacts
from ..runfolder.archive import is_archive, open_run_path
from ..core.config import RunConfig, check_atol
from ..runfolder.env import detllm_version
from ..core.errors import ArtifactError, UsageError
from . import evidence, recorded, served
from .folder import DIAGNOSIS, OWNED, Diagnosis, prompts_from_records, write_diagnosis
from .pool import Pool
from .probes import Probe, plan
from .probing import ProbeRunner
from .ranking import conclusion, rank_knobs

DEFAULT_BUDGET = "12"  # probes
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Budget:
    probes: int | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str | int | None) -> "Budget":
        """`12` (probes), `90s`, `5m`; a bad value is a UsageError."""
        raw = str(text if text is not None else DEFAULT_BUDGET).strip().lower()
        try:
            if raw.endswith("m"):
                b = cls(seconds=float(raw[:-1]) * 60)
            elif raw.endswith("s"):
                b = cls(seconds=float(raw[:-1]))
            else:
                b = cls(probes=int(raw))
        except ValueError as exc:
            raise UsageError(f"--budget expects a probe count (12) or a time (90s, 5m), got {text!r}") from exc
        if (b.probes is not None and b.probes < 1) or (b.seconds is not None and b.seconds <= 0):
            raise UsageError(f"--budget must be positive, got {text!r}")
        return b


# ------------------------------------------------------------------ inputs


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not (out / DIAGNOSIS).is_file():
            raise UsageError(f"--out {str(out)!r} is not empty and is not a diagnosis folder", hint="choose another --out")
        if not force:
            raise UsageError(f"--out {str(out)!r} holds an earlier diagnosis", hint="pass --force to replace it")


def read_failing(run_dir: Path, shown: str | None = None) -> tuple[RunConfig, int, list[dict[str, Any]], list[str], dict[str, Any]]:
    """(config, requested tier, records, prompts, source) of a check (or run) folder; `shown`: the
    path the user gave (a pack, where `run_dir` is its extracted copy)."""
    run_dir = Path(run_dir)
    shown = shown or str(run_dir)
    if not artifacts.is_detllm_folder(run_dir):
        raise ArtifactError(f"{shown!r} is not a detllm run or diff folder, nor a pack of one",
                            hint="pass the folder (or .tar.gz pack) a failing check or diff wrote")
    folder = artifacts.load_run(run_dir)
    rep = folder.report or {}
    source = {"kind": "folder", "path": shown, "status": rep.get("status"), "recorded_causes": [c["code"] for c in rep.get("causes", [])]}
    config = RunConfig.from_json(folder.run_config["config"])
    return config, folder.applied["tier_requested"], folder.records, prompts_from_records(folder.records, shown), source


def _run_check_cli(args: list[str], out: Path, progress: Progress | None) -> Path:
    """`python -m detllm check ARGS --out OUT/baseline` in a child process; its usage or backend
    error becomes ours (same exit code), with nothing left behind."""
    import subprocess
    import sys

    from ..core.errors import (
        EXIT_CODES,
        ArtifactError,
        BackendError,
        BackendUnavailableError,
        TierUnsupportedError,
    )

    if any(a in ("--out", "-o") or a.startswith("--out=") for a in args):
        raise UsageError("diagnose's --out is the diagnosis folder; the check it runs goes to OUT/baseline")
    if progress:
        progress("baseline check: detllm check " + " ".join(args))
    created = not out.exists()
    baseline = out / "baseline"
    proc = subprocess.run([sys.executable, "-m", "detllm", "check", *args, "--out", str(baseline), "--no-progress"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode in (0, 1) and artifacts.is_detllm_folder(baseline):
        return baseline
    if created:
        shutil.rmtree(out, ignore_errors=True)
    elif baseline.is_dir():
        shutil.rmtree(baseline, ignore_errors=True)
    line = next((ln for ln in proc.stderr.splitlines() if ln.startswith("detllm: error: ")), proc.stderr.strip()[-300:])
    err = {2: UsageError, 3: TierUnsupportedError, 4: BackendUnavailableError, 5: ArtifactError}.get(proc.returncode, BackendError)
    code = proc.returncode if proc.returncode in EXIT_CODES else 8
    raise err(f"the check to diagnose stopped (exit {code}): {line.removeprefix('detllm: error: ')}")


PROBE_KINDS = {"ladder", "needle", "fresh_process", "prefill", "layers"}
KNOWN_KNOBS = {"threads", "dtype", "attn_implementation", "batch_invariant", "kv_type", "flash_attn", "ubatch", "cache_prompt",
               "enforce_eager", "prefix_caching", "max_num_seqs", "concurrency"}


def _selected(probe: Probe, only: list[str]) -> bool:
    return probe.kind in only or probe.knob in only or probe.name in only


# ------------------------------------------------------------------ the command


def diagnose(config: RunConfig | None = None, *, run_dir: str | Path | None = None, prompts: str | Path | None = None,
             out: str | Path | None = None, force: bool = False, budget: str | int | None = None, fresh_repeats: int = 3,
             progress: Progress | None = None, check_args: list[str] | None = None, only: list[str] | None = None,
             tier: int | None = None, atol: float | None = None, pool_factory: Callable[[Path], Any] | None = None) -> Diagnosis:
    """Diagnose a failing check folder or diff folder (`run_dir`, or a .tar.gz pack of a check
    folder), or run the check `config` first; write diagnosis.json/.txt/.md under `out` and return
    it. `only` keeps the probes whose knob, name or kind is listed (e.g. ["ladder", "kv_type", "prefill"]).
    `tier`/`atol`: judge the divergence at this tier and logprob tolerance instead of the recorded ones
    (tier 3 diagnoses logprobs that move with the batch size, which a tier-2 check records without failing).
    `pool_factory`: where the probe jobs run instead of local workers (diagnose --ray: cluster/probes.py)."""
    if tier is not None and tier not in (1, 2, 3):
        raise UsageError(f"--tier must be 1, 2 or 3, got {tier}")
    if atol is not None:
        check_atol(atol)
    if run_dir is not None and is_archive(run_dir):  # a pack: read from a temporary extraction, nothing written into it
        with open_run_path(run_dir) as folder:
            return _diagnose(config, run_dir=folder, prompts=prompts, out=out, force=force, budget=budget, fresh_repeats=fresh_repeats,
                             progress=progress, check_args=check_args, only=only, shown=str(run_dir), tier_asked=tier, atol=atol,
                             pool_factory=pool_factory)
    return _diagnose(config, run_dir=run_dir, prompts=prompts, out=out, force=force, budget=budget, fresh_repeats=fresh_repeats,
                     progress=progress, check_args=check_args, only=only, tier_asked=tier, atol=atol, pool_factory=pool_factory)


def _drift_recorded(run_dir: Path | None, tier: int) -> str | None:
    """What a passing check recorded without failing on: its comparisons that diverged although not
    required at its tier (logprobs that moved with the batch size), in one sentence; None without any."""
    if run_dir is None or not (Path(run_dir) / artifacts.REPORT).is_file():
        return None
    rep = artifacts.read_json(Path(run_dir) / artifacts.REPORT, "report")
    moved = [c for c in rep.get("comparisons", []) if not c.get("required") and c.get("prompts_diverged")]
    if not moved:
        return None
    c = moved[0]
    worst = (c.get("drift") or {}).get("max_abs_logprob_diff")
    codes = sorted({x["code"] for x in rep.get("info", []) if isinstance(x, dict) and x.get("code")})
    return (f"Nothing failed at tier {tier}, but the check recorded a difference that does not fail at that tier: {c['name']}: "
            f"{c['prompts_diverged']}/{c['prompts_compared']} prompts diverged"
            + (f", max |dlogprob| {worst:.3g}" if isinstance(worst, float) else "")
            + (f" ({', '.join(codes)})" if codes else "")
            + ". To diagnose that drift: detllm diagnose FOLDER --tier 3 (logprobs across batch sizes), or --atol to set the "
              "logprob tolerance.")


def _diagnose(config: RunConfig | None, *, run_dir: str | Path | None, prompts: str | Path | None, out: str | Path | None,
              force: bool, budget: str | int | None, fresh_repeats: int, progress: Progress | None, check_args: list[str] | None,
              only: list[str] | None, shown: str | None = None, tier_asked: int | None = None, atol: float | None = None,
              pool_factory: Callable[[Path], Any] | None = None) -> Diagnosis:
    if sum(x is not None for x in (config, run_dir, check_args)) != 1:
        raise UsageError("diagnose takes a failing run folder or check's options, not both")
    limits = Budget.parse(budget)
    if fresh_repeats < 2:
        raise UsageError(f"--fresh-repeats must be at least 2, got {fresh_repeats}")
    only = [o.strip() for o in only or [] if o.strip()]
    out = Path(out) if out is not None else artifacts.default_out_dir("diagnose")
    diff_plan = recorded.plan_diff(Path(run_dir)) if run_dir is not None and artifacts.is_diff_folder(Path(run_dir)) else None
    sides_differ = diff_plan is not None and bool(diff_plan.probes or diff_plan.named)  # else: diagnosed as a check
    if sides_differ:
        unknown = [o for o in only if o not in diff_plan.knobs()]
        if unknown:  # the sides differ: their recorded differences are the knobs
            raise UsageError(f"--probe {unknown[0]!r} is not a recorded difference of this diff",
                             hint=f"its knobs: {', '.join(diff_plan.knobs())}")
    else:
        unknown = [o for o in only if o not in PROBE_KINDS and o not in KNOWN_KNOBS]
        if unknown:
            raise UsageError(f"unknown --probe {unknown[0]!r}", hint=f"one of: {', '.join(sorted(PROBE_KINDS | KNOWN_KNOBS))}")
    _check_out(out, force)
    if sides_differ:
        return recorded.diagnose_diff(diff_plan, Path(run_dir), out, limits, progress, only, pool_factory=pool_factory)
    if check_args is not None:  # the CLI: run `detllm check ARGS` as the user would, then diagnose its folder
        run_dir = _run_check_cli(list(check_args), out, progress)
    if diff_plan is not None:
        # the sides were recorded with the same settings: diagnose the left side's as a check
        rep, left, right = diff_plan.report, diff_plan.left, diff_plan.right
        folder = diff_plan.lrun
        texts = prompts_from_records(folder.records, str(run_dir))
        sizes = tuple(sorted({1, left["batch_size"], right["batch_size"]}))
        config = dataclasses.replace(RunConfig.from_json(folder.run_config["config"]), tier=rep["tier"]["requested"], runs=3,
                                     batch_size=left["batch_size"], vary_batch=sizes if len(sizes) > 1 else (), fresh_process=0)
        prompts_list, diff_dir, run_dir = texts, Path(run_dir), None
        diff_failed, cannot = rep["status"] == "FAIL", diff_plan.cannot
    else:
        prompts_list, diff_dir, diff_failed, cannot = None, None, False, []
    if run_dir is not None:
        base, tier, records, texts, source = read_failing(Path(run_dir), shown)
        if check_args is not None:
            source["kind"] = "check"
    else:
        config.validate(command="check")
        from ..core.prompts import load_prompts

        texts = prompts_list or list(load_prompts(prompts).texts)  # a bad prompt file is refused before anything is written
        base, tier, records = config, config.tier, None
        source = {"kind": "diff" if prompts_list else "check", "path": str(diff_dir) if prompts_list else None, "status": None,
                  "recorded_causes": []}
    drift = _drift_recorded(Path(run_dir), tier) if run_dir is not None and tier_asked is None and atol is None else None
    if tier_asked is not None:
        tier = tier_asked
    if atol is not None:
        base = dataclasses.replace(base, atol=atol)
    server = served.identify(base)  # a served check: the live server's kind; unreachable is exit 4 before any write
    for name in OWNED:
        if name == "baseline" and check_args is not None:
            continue  # the check diagnose just ran
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    prompts_file = out / "prompts.jsonl"
    artifacts.atomic_write_text(prompts_file, "".join(json.dumps({"prompt": t}, ensure_ascii=False) + "\n" for t in texts))
    t0 = time.monotonic()
    with (pool_factory or Pool)(out / "logs") as pool:
        if records is None:
            if progress:
                progress("baseline check")
            res = pool.shared().run({"kind": "check", "config": dataclasses.replace(base, mode="best-effort", fresh_process=0).to_json(),
                                     "prompts": str(prompts_file), "tier": tier, "out": str(out / "baseline")})
            if not res.get("ok"):
                from ..core.errors import BackendError

                raise BackendError(f"the baseline check failed: {res.get('error')}")
            source.update(status=res["status"], path=str(out / "baseline"))
            rep = artifacts.read_json(out / "baseline" / artifacts.REPORT, "report")
            source["recorded_causes"] = [c["code"] for c in rep["causes"]]
            records = artifacts.load_trace(out / "baseline" / artifacts.TRACE, validate_records=False)
        comps = evidence.comparisons(records, tier=tier, atol=base.atol, base_batch=base.batch_size, runs=base.runs)
        baseline = {**evidence.signature(comps), "comparisons": comps}
        runner = ProbeRunner(pool, out, base, tier, baseline["kinds"], baseline, prompts_file, limits, progress)
        runner.fresh_repeats = fresh_repeats
        probes, skipped = plan(base, baseline["kinds"], tier=tier, fresh_repeats=fresh_repeats) if baseline["diverged"] else ([], [])
        if baseline["diverged"]:
            probes, skipped = served.add_cache_knob(probes, skipped, base, server)
            probes = [p for p in probes if p.undoes] + [p for p in probes if not p.undoes]  # your own settings first
        if only:
            not_run_only = [p for p in probes if not _selected(p, only)]
            probes = [p for p in probes if _selected(p, only)]
        else:
            not_run_only = []
        passing, confirmation = None, None
        not_run: list[dict[str, str]] = [{"name": p.name, "reason": "not selected by --probe"} for p in not_run_only]
        isolated_by: Probe | None = None

        def attempt(probe: Probe) -> None:
            nonlocal passing, confirmation, isolated_by
            got = runner.run(probe)
            if probe.kind == "check" and got["outcome"] == "vanish":  # passing only once every fresh-process check passes
                got["evidence"]["confirmation"] = runner.confirm(probe, fresh_repeats)
                if isolated_by is not None:  # a later undo: its own evidence, the passing setting stays the first confirmed
                    return
                confirmation = got["evidence"]["confirmation"]
                if confirmation["status"] == "confirmed":
                    isolated_by = probe
                    passing = {k: confirmation[k] for k in ("settings", "tier", "fresh_process_passes", "fresh_process_runs", "summary")}

        for probe in probes:
            if isolated_by is not None and probe.kind in ("check", "fresh_process") and not probe.undoes:  # every undo is tried
                not_run.append({"name": probe.name, "reason": f"skipped: the cause is isolated ({isolated_by.name} makes it vanish)"})
                continue
            if not runner.left():
                not_run.append({"name": probe.name, "reason": "skipped: the --budget is spent"})
                continue
            attempt(probe)
        if baseline["diverged"] and isolated_by is None:
            moved = [p for p in probes if p.kind == "check" and any(r["name"] == p.name and r["outcome"] == "move" for r in runner.results)]
            if len(moved) >= 2 and runner.left():  # no single knob: try the ones that changed it, together
                attempt(Probe(" + ".join(p.name for p in moved), " + ".join(p.knob for p in moved), "check",
                              "whether the knobs that each changed the divergence remove it together", 0,
                              threads=next((p.threads for p in moved if p.threads is not None), None),
                              dtype=next((p.dtype for p in moved if p.dtype), None),
                              options={k: v for p in moved for k, v in p.options.items()}, fresh=any(p.fresh for p in moved)))
        prefill = None
        if runner.left() and ((baseline["diverged"] and not only) or "prefill" in only):  # asked for by name: even on a PASS
            got = runner.run(Probe("prefill vs decode", "prefill/decode path", "prefill",
                                   "whether scoring the generated sequence as a prompt gives the logprobs seen while decoding", 1.0))
            prefill = {"status": got["status"], "reason": got.get("reason"), **got["evidence"]}
        layers = None
        if runner.left() and ((baseline["diverged"] and not only) or "layers" in only):  # where in the model: detllm locate
            from .layers import layers_probe

            if progress:
                progress("layers probe (detllm locate --layers-only)")
            layers = layers_probe(pool, base, source.get("path") if source.get("status") == "FAIL" else None, out)
    knobs = served.rank_cache_evidence(rank_knobs(runner.results, baseline), records, base, tier, server)
    cannot_text = recorded.not_switched(cannot)
    unreproduced = None
    if diff_failed and not baseline["diverged"]:  # the diff FAILed; its left side's settings pass here
        unreproduced = (f"Could not reproduce the diff's FAIL here: the two sides were recorded with the same settings, and the "
                        f"left side's, re-run as a check ({base.runs} runs, batch sizes {', '.join(map(str, base.batch_sizes))}), "
                        f"pass at tier {tier}." + (cannot_text or " Nothing recorded differs that diagnose could switch: the "
                                                   "difference came from outside what detllm records."))
    doc = artifacts.stamp("diagnosis", {
        "detllm_version": detllm_version(),
        "created_at": artifacts.utc_now(),
        "source": source,
        "backend": base.backend,
        "model": base.model,
        "config": base.to_json(),
        "tier_requested": tier,
        "baseline": baseline,
        "budget": {"probes": limits.probes, "seconds": limits.seconds, "probes_used": runner.used,
                   "seconds_used": round(time.monotonic() - t0, 2), "exhausted": not runner.left()},
        "probes": runner.results,
        "not_run": not_run,
        "skipped_knobs": skipped + recorded.unswitched(cannot),
        "knobs": knobs,
        "passing_settings": passing,
        "prefill_vs_decode": prefill,
        "layers": layers,
        "isolated": isolated_by is not None,
        "conclusion": conclusion(knobs, passing, baseline["kinds"], confirmation) + cannot_text if baseline["diverged"]
        else unreproduced or drift or f"Nothing to diagnose: the check passes at tier {tier} (every comparison agreed).",
    })
    return write_diagnosis(out, doc)
