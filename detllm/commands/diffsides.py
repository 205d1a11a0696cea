"""Diff sides given as files: a run folder's trace.jsonl, or a bare trace file, and the
seed's older layout recognised (and refused) by what it is.

`detllm diff --left A --right B` (the seed's spelling) takes trace files or run folders.
A trace.jsonl inside a run folder is diffed as that folder (every cause can be known).
A bare trace file records no model, config, engine or environment, so its verdict can
only name what the records show: prompts, tokenization, batch, and the divergence itself.
Folder diffs live in diff.py; this module never imports an engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..runfolder import artifacts
from ..compare.causes import Side, explain
from ..compare.engine import compare, label
from ..compare.trace import load_records
from ..core.errors import ArtifactError, UsageError
from ..pipeline.outcome import Outcome, write_report
from ..runfolder.seedlayout import refuse_seed_layout

UNKNOWN = "unknown (bare trace file)"

def pick_sides(a: str | None, b: str | None, left: str | None, right: str | None) -> tuple[str, str]:
    """`diff A B` or the seed's `diff --left A --right B`, not a mix."""
    if left is None and right is None:
        if a is None or b is None:
            raise UsageError("diff needs two sides", hint="detllm diff A B, or detllm diff --left A --right B")
        return a, b
    if a is not None or b is not None or left is None or right is None:
        raise UsageError("give the two sides either as A B or as --left A --right B")
    return left, right


def as_folder(arg: str) -> str:
    """A run folder's trace.jsonl stands for its folder; anything else is returned as given."""
    p = Path(arg)
    if p.is_file() and p.name == artifacts.TRACE and artifacts.is_detllm_folder(p.parent):
        return str(p.parent)
    return arg


def is_bare_trace(arg: str) -> bool:
    p = Path(arg)
    return "::" not in arg and p.is_file() and p.suffix == ".jsonl"


def _may_be_training(arg: str) -> bool:
    """A folder holding train_config.json, or a file (a pack archive may hold one): only then is
    training/diffing.py imported to ask (a run-folder diff does not load the training modules)."""
    from ..training.chain import TRAIN_CONFIG

    p = Path(arg)
    return (p / TRAIN_CONFIG).is_file() if p.is_dir() else p.is_file()


def diff_any(a: str, b: str, **kw: Any) -> Outcome:
    """diff.diff for folders; bare_diff when a side is a bare trace file. The seed's layout is refused."""
    from .diff import diff

    a, b = as_folder(a), as_folder(b)
    for arg in (a, b):
        path = Path(arg.rpartition("::")[0] if "::" in arg else arg)
        if path.exists():
            refuse_seed_layout(path)
    if any(_may_be_training(arg) for arg in (a, b)):
        from ..training.diffing import diff_training_sides, is_training_side

        if is_training_side(a) or is_training_side(b):  # two training packs (docs/training.md)
            return diff_training_sides(a, b, **kw)
    if kw.pop("script", None):
        raise UsageError("--script applies to two training packs made with --script (docs/training.md)")
    if not (is_bare_trace(a) or is_bare_trace(b)):
        return diff(a, b, **kw)
    junit, plot = kw.get("junit"), kw.get("plot")
    if plot is not None:
        from ..render.plot import require_matplotlib

        require_matplotlib()
    for path, flag in ((junit, "--junit"), (plot, "--plot")):
        artifacts.check_output_file(Path(path) if path else None, flag)
    outcome = bare_diff(a, b, out=kw.get("out"), force=kw.get("force", False), atol=kw.get("atol", 0.0), tier=kw.get("tier"))
    if junit is not None:
        from ..render.junit import write_junit

        write_junit(outcome.report, Path(junit))
    if plot is not None:
        from ..render.plot import write_plot

        write_plot(outcome.report, Path(plot))
    return outcome


def _bare_side(arg: str) -> Side:
    """Run 0 at the first record's batch size, from a trace file or a run folder's trace."""
    p = Path(arg)
    trace = p / artifacts.TRACE if p.is_dir() else p
    if not trace.is_file():
        raise ArtifactError(f"{arg!r} is neither a trace file nor a run folder")
    records, _ = load_records(trace)
    if not records:
        raise ArtifactError(f"{arg!r} holds no trace records")
    run, batch = records[0]["run_index"], records[0]["batch_size"]  # a check writes run 0 at its base batch first
    chosen = [r for r in records if r["run_index"] == run and r["batch_size"] == batch]
    return Side(label=f"{p.name}::{label(run, batch)}", run_index=run, batch_size=batch, records=chosen, folder=str(p))


def bare_diff(a: str, b: str, *, out: str | Path | None = None, force: bool = False, atol: float = 0.0,
              tier: int | None = None) -> Outcome:
    """Compare two trace files: tokens, and logprobs where both recorded them (tier 2, the
    default when they did). Causes: only those the records show; RUN_VARIANCE says what is unknown."""
    if tier is not None and tier not in (1, 2):
        raise UsageError(f"a bare trace file diff compares tokens (1) or logprobs too (2), got --tier {tier}")
    out_dir = Path(out) if out is not None else None
    if out_dir is not None:
        artifacts.check_out_dir(out_dir, force=force, kind="diff")
    left, right = _bare_side(a), _bare_side(b)
    has_lp = all(r.get("logprobs") is not None for r in (left.records or [])[:1] + (right.records or [])[:1])
    effective = min(tier or 2, 2 if has_lp else 1)
    comp = compare(left.records, right.records, name=f"{left.label} vs {right.label}", kind="diff", left_label=left.label,
                   right_label=right.label, required=True, check_logprobs=effective >= 2 and left.batch_size == right.batch_size,
                   atol=atol)
    causes, info = explain(comp, left, right)
    for c in causes + info:
        if c["code"] == "RUN_VARIANCE":
            c["evidence"]["recorded_differences"] = ("unknown: bare trace files record no model, config, engine or "
                                                     "environment; diff the run folders to rank those")
    failed = comp["status"] == "FAIL"
    report = artifacts.stamp("report", {
        "command": "diff", "status": "FAIL" if failed else "PASS", "category": causes[0]["code"] if failed else "PASS",
        "tier": {"requested": tier or effective, "effective": effective},
        "causes": causes, "info": info, "first_divergence": comp["first_divergence"], "comparisons": [comp],
        "summary": {"left": _summary(left, effective), "right": _summary(right, effective), "prompts": comp["prompts_compared"],
                    "atol": atol, "noise_floor": None, "bare_traces": True},
    })
    if out_dir is not None:
        artifacts.prepare_out_dir(out_dir, force=force, kind="diff")
        write_report(out_dir, report)
    return Outcome(out_dir, report)


def _summary(side: Side, tier: int) -> dict[str, Any]:
    return {"folder": side.folder, "label": side.label, "run_index": side.run_index, "batch_size": side.batch_size,
            "backend": UNKNOWN, "model": UNKNOWN, "dtype": UNKNOWN, "device": UNKNOWN, "tier": tier,
            "records": len(side.records or ())}
