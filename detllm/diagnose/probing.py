"""Running diagnose's probes: each probe of the plan (a knob check, the batch-size ladder, the
needle, fresh-process repeats, prefill vs decode) as a job in a worker within the budget, judged
against the failing baseline, and the fresh-process confirmation a passing setting needs. Owns
the evidence of each probe; the plan is probes.py's, the order of events core.py's.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

from ..runfolder import artifacts
from ..core.config import RunConfig
from . import evidence
from .folder import slug
from .needle import trial_plan
from .pool import Pool
from .probes import LADDER, Probe

NEEDLE_TRIALS = 6
Progress = Callable[[str], None]


class ProbeRunner:
    """Runs probes against a baseline within the budget; keeps the evidence."""

    def __init__(self, pool: Pool, out: Path, base: RunConfig, tier: int, kinds: list[str], baseline: dict[str, Any],
                 prompts_file: Path, budget: Any, progress: Progress | None) -> None:
        self.pool, self.out, self.base, self.tier, self.kinds = pool, out, base, tier, kinds
        self.baseline, self.prompts, self.budget, self.progress = baseline, str(prompts_file), budget, progress
        self.started = time.monotonic()
        self.used = 0
        self.results: list[dict[str, Any]] = []
        self.fresh_repeats = 3
        # a probe compares what it ran itself: check's --negative-control (refused for runs) is not re-run
        self.probe_base = dataclasses.replace(base, negative_control=False)

    def left(self) -> bool:
        if self.budget.probes is not None and self.used >= self.budget.probes:
            return False
        return self.budget.seconds is None or time.monotonic() - self.started < self.budget.seconds

    def _say(self, text: str) -> None:
        if self.progress:
            self.progress(text)

    def _job(self, kind: str, config: RunConfig, name: str, fresh: bool, folder: str | None = None, **extra: Any) -> dict[str, Any]:
        """Run one job (in a fresh process where `fresh`); a check or run writes to probes/FOLDER
        (default: the probe name's slug)."""
        job = {"kind": kind, "config": config.to_json(), "prompts": self.prompts, "tier": self.tier, **extra}
        if kind in ("check", "run"):
            job["out"] = str(self.out / "probes" / (folder or slug(name)))
        return self.pool.fresh(job) if fresh else self.pool.shared().run(job)

    def probe_config(self, probe: Probe) -> RunConfig:
        cfg = probe.apply(self.probe_base)
        if "run" in self.kinds:  # repeats are what diverged: keep them as the user ran them
            return dataclasses.replace(cfg, runs=max(2, self.base.runs))
        return dataclasses.replace(cfg, runs=2, fresh_process=0)

    def run(self, probe: Probe) -> dict[str, Any]:
        self.used += 1
        self._say(f"probe {self.used}: {probe.name}")
        t0 = time.monotonic()
        entry: dict[str, Any] = {"name": probe.name, "knob": probe.knob, "kind": probe.kind, "setting": probe.setting(),
                                 "proves": probe.proves, "status": "ran", "outcome": None, "evidence": {}, "folder": None}
        try:
            getattr(self, f"_{probe.kind}")(probe, entry)
        except _ProbeFailed as err:
            entry["status"], entry["reason"] = "error", str(err)
        if probe.undoes:  # takes back the user's own setting: ranked above a new setting (ranking.py)
            entry["evidence"]["undoes"] = dict(probe.undoes)
        entry["seconds"] = round(time.monotonic() - t0, 2)
        self.results.append(entry)
        return entry

    def _judge(self, folder: Path, entry: dict[str, Any], config: RunConfig) -> dict[str, Any]:
        records = artifacts.load_trace(folder / artifacts.TRACE, validate_records=False)
        comps = evidence.comparisons(records, tier=self.tier, atol=config.atol, base_batch=config.batch_size, runs=config.runs)
        sig = evidence.signature(comps)
        entry["evidence"] = {**sig, "comparisons": comps}
        entry["folder"] = str(folder.relative_to(self.out))
        return sig

    def _check(self, probe: Probe, entry: dict[str, Any]) -> None:
        cfg = self.probe_config(probe)
        res = self._job("check", cfg, probe.name, probe.fresh)
        if not res.get("ok"):
            raise _ProbeFailed(res.get("error", "the probe failed"))
        sig = self._judge(Path(res["out"]), entry, cfg)
        entry["outcome"] = evidence.outcome(sig, self.baseline)

    def _ladder(self, probe: Probe, entry: dict[str, Any]) -> None:
        sizes = tuple(sorted(set(LADDER) | set(self.base.batch_sizes)))
        cfg = dataclasses.replace(self.probe_base, mode="best-effort", runs=2, batch_size=1, vary_batch=sizes, fresh_process=0)
        entry["setting"] = {"vary_batch": list(sizes)}
        res = self._job("check", cfg, probe.name, False)
        if not res.get("ok"):
            raise _ProbeFailed(res.get("error", "the probe failed"))
        sig = self._judge(Path(res["out"]), entry, cfg)
        entry["outcome"] = "follows" if sig["diverged_batch_sizes"] else "vanish"

    def _needle(self, probe: Probe, entry: dict[str, Any]) -> None:
        first = self.baseline.get("first") or {}
        target = first.get("prompt_index", 0)
        max_size = max(8, max(self.base.batch_sizes))
        cfg = dataclasses.replace(self.probe_base, mode="best-effort", runs=1, batch_size=1, vary_batch=(max_size,), fresh_process=0)
        n_company = len(Path(self.prompts).read_text(encoding="utf-8").splitlines()) - 1 + 8  # other prompts + fillers
        trials = trial_plan(max(1, n_company), trials=NEEDLE_TRIALS, max_size=max_size, seed=self.base.seed)
        res = self._job("needle", cfg, probe.name, False, target=target, plan=trials)
        if not res.get("ok"):
            raise _ProbeFailed(res.get("error", "the probe failed"))
        entry["setting"] = {"prompt_index": target, "trials": len(trials), "max_batch": max_size, "seed": self.base.seed}
        lps = [t["max_abs_logprob_diff"] for t in res["trials"] if t["max_abs_logprob_diff"] is not None]
        entry["evidence"] = {**{k: res[k] for k in ("target", "trials", "diverged", "total")},
                             "max_abs_logprob_diff": max(lps) if lps else None,
                             "argmax_flips": sum(t["argmax_flips"] for t in res["trials"])}
        entry["outcome"] = "follows" if res["diverged"] else "vanish"

    def _fresh_process(self, probe: Probe, entry: dict[str, Any]) -> None:
        n = self.fresh_repeats
        cfg = dataclasses.replace(self.probe_base, mode="best-effort", runs=1, vary_batch=(), fresh_process=0)
        folders = []
        for k in range(n):
            res = self._job("run", cfg, probe.name, True, folder=f"{slug(probe.name)}-{k}")
            if not res.get("ok"):
                raise _ProbeFailed(res.get("error", "the probe failed"))
            folders.append(Path(res["out"]))
        from ..compare.engine import compare

        ref = artifacts.load_trace(folders[0] / artifacts.TRACE, validate_records=False)
        comps = []
        for k, f in enumerate(folders[1:], 1):
            other = artifacts.load_trace(f / artifacts.TRACE, validate_records=False)
            c = compare(ref, other, name=f"process {k} vs process 0", kind="run", left_label="process_0", right_label=f"process_{k}",
                        required=True, check_logprobs=self.tier >= 2, atol=cfg.atol)
            comps.append(evidence._summary(c, "run", cfg.batch_size))
        sig = evidence.signature(comps)
        entry["evidence"] = {**sig, "processes": n, "comparisons": comps}
        entry["folder"] = str((self.out / "probes").relative_to(self.out))
        entry["outcome"] = "follows" if sig["diverged"] else "vanish"

    def _prefill(self, probe: Probe, entry: dict[str, Any]) -> None:
        cfg = dataclasses.replace(self.probe_base, mode="best-effort", runs=1, vary_batch=(), fresh_process=0)
        res = self._job("score", cfg, probe.name, False)
        if not res.get("ok"):
            raise _ProbeFailed(res.get("error", "the probe failed"))
        res.pop("ok", None)
        res.pop("seconds", None)
        entry["evidence"] = res
        if not res.get("available"):
            entry["status"], entry["reason"] = "skipped", res.get("reason", "")
        else:
            entry["outcome"] = "differs" if res["first_differing_position"] is not None else "equal"

    def confirm(self, probe: Probe, repeats: int) -> dict[str, Any]:
        """The setting that vanished, re-run as a full check in `repeats` fresh processes. Passing
        means passing in every one of them: status confirmed (repeats/repeats), failed (a check
        diverged or errored: the rest are not run), or unconfirmed (the budget ended first)."""
        cfg = self.probe_config(probe)
        passes, ran = 0, 0
        for k in range(repeats):
            if not self.left():
                break
            self.used += 1
            ran += 1
            self._say(f"confirm {k + 1}/{repeats}: {probe.name}")
            res = self._job("check", cfg, probe.name, True, folder=f"confirm-{slug(probe.name)}-{k}")
            if not res.get("ok"):
                break
            records = artifacts.load_trace(Path(res["out"]) / artifacts.TRACE, validate_records=False)
            sig = evidence.signature(evidence.comparisons(records, tier=self.tier, atol=cfg.atol, base_batch=cfg.batch_size, runs=cfg.runs))
            if sig["diverged"]:
                break
            passes += 1
        status = "confirmed" if passes == repeats else ("failed" if passes < ran else "unconfirmed")
        setting = _setting_text(probe.setting())
        if probe.undoes:
            setting = f"{setting} (your own {', '.join(f'--opt {k}={v}' for k, v in probe.undoes.items())} taken back)"
        summary = {
            "confirmed": f"{setting}: PASS at tier {self.tier} in {passes}/{repeats} fresh-process checks",
            "failed": f"{setting} vanished in the probe but failed its confirmation: PASS at tier {self.tier} in {passes}/{ran} "
                      f"fresh-process checks (--fresh-repeats {repeats})",
            "unconfirmed": f"{setting} vanished in the probe; unconfirmed: the --budget ended after {passes}/{repeats} "
                           f"fresh-process checks, all passing",
        }[status]
        return {"settings": probe.setting(), "tier": self.tier, "status": status, "fresh_process_passes": passes,
                "fresh_process_runs": ran, "fresh_repeats": repeats, "summary": summary}


class _ProbeFailed(Exception):
    pass


def _setting_text(setting: dict[str, Any]) -> str:
    return " and ".join(f"{k}={'default' if v is None else v}" for k, v in setting.items()) or "the failing settings"


__all__ = ["ProbeRunner"]
