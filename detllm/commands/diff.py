"""`detllm diff A B`: compare two run folders, or two selections of them, and say
where and why they differ.

Owns the selection syntax, loading each side without torch, the diff report and its
optional folder. Alignment, divergences and drift live in compare/engine.py, causes
in compare/causes/, rendering in render/.

A side is `FOLDER` (a run folder or .tar.gz pack; run 0 at its --batch-size) or
`FOLDER::SELECTION` with SELECTION one of `run_N`, `batch_B` (run 0 at batch size B)
or `run_N@batch_B`; the last `::` in the argument separates the two.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..runfolder import artifacts
from ..compare.causes import Notes, Side, explain
from ..compare.divergence import applied_dtype, run_noise_floor
from ..compare.engine import compare, label, report_magnitude
from ..compare.trace import load_records
from ..core.config import check_atol
from ..core.errors import ArtifactError, UsageError
from ..runfolder.folderlock import exclusive_writer
from ..pipeline.outcome import Outcome, write_report

_SELECTION = re.compile(r"run_(\d+)(?:@batch_(\d+))?|batch_(\d+)")
SELECTION_HINT = "write FOLDER, FOLDER::run_N, FOLDER::batch_B or FOLDER::run_N@batch_B"


@dataclass(frozen=True)
class Selection:
    """Which records of which folder one side of a diff compares."""

    folder: Path
    run: int | None = None  # None: run 0
    batch: int | None = None  # None: the folder's base batch size

    @classmethod
    def parse(cls, arg: "str | Path | Selection") -> "Selection":
        if isinstance(arg, Selection):
            return arg
        if isinstance(arg, Path) or "::" not in str(arg):
            return cls(Path(arg))
        folder, _, sel = str(arg).rpartition("::")
        m = _SELECTION.fullmatch(sel)
        if not folder or m is None:
            raise UsageError(f"cannot read the selection {sel!r} in {str(arg)!r}", hint=SELECTION_HINT)
        run, batch = m.group(1), m.group(2) or m.group(3)
        return cls(Path(folder), int(run) if run is not None else None, int(batch) if batch is not None else None)


def diff(
    a: str | Path | Selection,
    b: str | Path | Selection,
    *,
    out: str | Path | None = None,
    force: bool = False,
    atol: float = 0.0,
    tier: int | None = None,
    junit: str | Path | None = None,
    plot: str | Path | None = None,
) -> Outcome:
    """Compare side `a` with side `b` (folders or `FOLDER::run_N@batch_B` selections).

    tier: 1 tokens, 2 tokens + logprobs and top-k (bitwise, or within `atol`), 3 the same
    across batch sizes; default: the lower tier the two runs were recorded at. `out`
    writes report.json, report.txt, report.md (and diffs/ on a divergence); `junit` a
    JUnit XML file; `plot` a PNG of drift by position (needs matplotlib). Without `out`
    nothing is written but those two. Returns the outcome; exit_code 1 on FAIL."""
    left_sel, right_sel = Selection.parse(a), Selection.parse(b)
    check_atol(atol)  # finite and in RunConfig.atol's range: a NaN would compare as "within tolerance" nowhere
    if tier is not None and tier not in (1, 2, 3):
        raise UsageError(f"diff compares outputs: --tier must be 1, 2 or 3, got {tier}")
    if plot is not None:
        from ..render.plot import require_matplotlib

        require_matplotlib()
    out_dir = _check_out(out, force, (left_sel, right_sel))
    artifacts.check_output_file(Path(junit) if junit else None, "--junit")
    artifacts.check_output_file(Path(plot) if plot else None, "--plot")
    left, right = load_sides(left_sel, right_sel)
    report = diff_report(left, right, atol=atol, tier=tier)
    if out_dir is not None:
        with exclusive_writer(out_dir):  # one writer per --out (folderlock.py)
            artifacts.prepare_out_dir(out_dir, force=force, kind="diff")  # checked above, before anything was read
            write_report(out_dir, report)
    if junit is not None:
        from ..render.junit import write_junit

        write_junit(report, Path(junit))
    if plot is not None:
        from ..render.plot import write_plot

        write_plot(report, Path(plot))
    return Outcome(out_dir, report)


def _check_out(out: str | Path | None, force: bool, sels: tuple[Selection, ...]) -> Path | None:
    if out is None:
        return None
    out = Path(out)
    for s in sels:
        if s.folder.exists() and out.exists() and out.resolve() == s.folder.resolve():
            raise UsageError(f"--out {str(out)!r} is one of the folders being compared", hint="choose another --out")
    artifacts.check_out_dir(out, force=force, kind="diff")
    return out


# ------------------------------------------------------------------ loading


def _read_folder(path: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(env, run_config, determinism_applied), each validated; ArtifactError otherwise."""
    if not path.is_dir():
        raise ArtifactError(f"{str(path)!r} is not a folder", hint="pass a detllm run folder")
    artifacts.check_complete(path)
    if not (path / artifacts.RUN_CONFIG).is_file():
        hint = ("a diff folder holds no trace: pass the run folders it compared" if artifacts.is_diff_folder(path)
                else "pass a folder written by detllm run or check")
        raise ArtifactError(f"{str(path)!r} is not a detllm run folder (no {artifacts.RUN_CONFIG})", hint=hint)
    run_config = artifacts.read_json(path / artifacts.RUN_CONFIG, "run_config")
    return artifacts.read_json(path / artifacts.ENV, "env"), run_config, artifacts.read_json(path / artifacts.APPLIED, "determinism_applied")


def load_sides(*sels: Selection) -> tuple[Side, ...]:
    """Each side (two for diff, N for the fleet), from folders or .tar.gz packs; a folder used twice is read once."""
    with contextlib.ExitStack() as stack:
        folders: dict[Path, tuple[Path, tuple[dict, dict, dict]]] = {}  # resolved path -> (as given, files)
        wanted: dict[Path, set[tuple[int, int]]] = {}
        picks = []
        for sel in sels:
            key = sel.folder.resolve()
            if key not in folders:
                real = stack.enter_context(artifacts.open_run_path(sel.folder))
                folders[key] = (real, _read_folder(real))
            run_config = folders[key][1][1]
            pick = (sel.run or 0, sel.batch if sel.batch is not None else run_config["config"]["batch_size"])
            wanted.setdefault(key, set()).add(pick)
            picks.append((sel, key, pick))
        loaded = {key: load_records(folders[key][0] / artifacts.TRACE, keep=lambda h, w=want: (h["run_index"], h["batch_size"]) in w)
                  for key, want in wanted.items()}
    names = {(s.folder.name, s.folder.resolve()) for s in sels}
    same_name = len({n for n, _ in names}) < len(names)  # two folders of one name: label them by path
    sides = []
    for sel, key, (run, batch) in picks:
        records, present = loaded[key]
        chosen = [r for r in records if r["run_index"] == run and r["batch_size"] == batch]
        if not chosen:
            have = ", ".join(label(r, b) for r, b in sorted(present)) or "none"
            raise UsageError(f"{str(sel.folder)!r} has no records for {label(run, batch)}", hint=f"it holds {have}")
        env, run_config, applied = folders[key][1]
        name = str(sel.folder) if same_name else sel.folder.name
        sides.append(Side(label=f"{name}::{label(run, batch)}", run_index=run, batch_size=batch, records=chosen,
                          folder=str(sel.folder), env=env, run_config=run_config, applied=applied))
    return tuple(sides)


def folder_sides(diff_dir: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(report, left summary, right summary) of a folder `diff --out` wrote; each side's folder resolved
    (as recorded, or relative to the diff folder's parent) into the summary's "path"."""
    rep = artifacts.read_json(diff_dir / artifacts.REPORT, "report")
    out = []
    for key in ("left", "right"):
        s = dict(rep["summary"][key])
        folder = Path(s["folder"])
        if not artifacts.is_detllm_folder(folder) and artifacts.is_detllm_folder(diff_dir.parent / folder):
            folder = diff_dir.parent / folder
        if not artifacts.is_detllm_folder(folder):
            raise ArtifactError(f"the diff's {key} side {s['folder']!r} is not a run folder here", hint="pass the run folders themselves")
        s["path"] = folder
        out.append(s)
    return rep, out[0], out[1]


# ------------------------------------------------------------------ the report


def effective_dtype(side: Side) -> str:
    """The dtype actually in effect where the backend recorded it (config "auto" resolves
    there; a GGUF file fixes it, e.g. Q4_1), else the one asked for."""
    return applied_dtype(side.applied["settings"]) or side.run_config["config"]["dtype"]


def side_noise_floor(side: Side) -> float | None:
    """The noise floor of the dtype in effect and the weights' quantization (as check uses)."""
    return run_noise_floor(side.run_config["config"]["dtype"], side.applied["settings"], side.run_config["model"]["quantization"])


def _tiers(left: Side, right: Side, tier: int | None) -> tuple[int, int]:
    """(requested, effective): logprobs can only be compared where both sides recorded them."""
    requested = tier if tier is not None else max(1, min(left.applied["tier_effective"], right.applied["tier_effective"]))
    logprobs = left.applied["capabilities"]["logprobs"] and right.applied["capabilities"]["logprobs"]
    return requested, requested if requested < 2 or logprobs else 1


def diff_report(left: Side, right: Side, *, atol: float = 0.0, tier: int | None = None) -> dict[str, Any]:
    """report.json of `diff`: status, ranked causes, info, first divergence, the comparison."""
    requested, effective = _tiers(left, right, tier)
    floors = [f for f in (side_noise_floor(left), side_noise_floor(right)) if f is not None]
    floor = max(floors) if floors else None  # the noisier side decides what counts as a tie
    # logprobs across batch sizes are only promised at tier 3, as in check
    logprobs = effective >= 3 or (effective == 2 and left.batch_size == right.batch_size)
    sampled = any(s.run_config["config"]["decoding"].get("temperature", 0.0) > 0 for s in (left, right))
    comp = compare(left.records, right.records, name=f"{left.label} vs {right.label}", kind="diff",
                   left_label=left.label, right_label=right.label, required=True,
                   check_logprobs=logprobs, atol=atol, noise_floor=floor, sampled=sampled)
    notes = Notes()
    causes, info = explain(comp, left, right, notes)
    failed = comp["status"] == "FAIL"
    report = artifacts.stamp("report", {
        "command": "diff",
        "status": "FAIL" if failed else "PASS",
        "category": causes[0]["code"] if failed else "PASS",
        "tier": {"requested": requested, "effective": effective},
        "causes": causes,
        "info": info,
        "first_divergence": comp["first_divergence"],
        "comparisons": [comp],
        "summary": {
            "left": _side_summary(left),
            "right": _side_summary(right),
            "prompts": comp["prompts_compared"],
            "atol": atol,
            "noise_floor": floor,
        },
        "magnitude": report_magnitude([comp]),
        "not_compared": notes.not_compared,
        "inert_differences": notes.inert,
    })
    return report  # validated when written (artifacts.write_json); tests validate the rest


def shown_device(cfg: dict[str, Any]) -> str:
    """The device a side ran on, as far as detllm can see it: a served endpoint's (--backend openai)
    is the remote server's, which a client cannot see, not the --device it was given."""
    return "remote" if cfg["backend"] == "openai" else cfg["device"]


def _side_summary(side: Side) -> dict[str, Any]:
    cfg = side.run_config["config"]
    return {"folder": side.folder, "label": side.label, "run_index": side.run_index, "batch_size": side.batch_size,
            "backend": cfg["backend"], "model": cfg["model"], "dtype": effective_dtype(side), "device": shown_device(cfg),
            "tier": side.applied["tier_effective"], "records": len(side.records or ())}


__all__ = ["Selection", "diff", "diff_report", "load_sides", "shown_device"]
