"""verify's re-derivation of train_report.json from the steps files a training pack holds: every
run (each fixed by its file's name, its genesis and its head), one comparison per repeat, each
first divergence (step, field, parameter, cause, detail; max |Δ| within the bounds the records
give), the top-level first divergence, the verdict and the summary. Reads records only, never
torch; the comparison itself is verdict.py's, the chain chain.py's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..core.errors import IntegrityError
from .chain import REPEATS, STEPS, TRAIN_CONFIG, ChainCheck, read_records
from .verdict import differing_parameters, earlier, first_divergence, summary

TRAIN_REPORT = "train_report.json"
REPORT_TXT = "report.txt"  # the verdict as text, its first line the summary
_HINT = "the report does not follow from the sealed steps files"


def _bad(what: str) -> IntegrityError:
    return IntegrityError(f"{TRAIN_REPORT}: {what}", hint=_HINT)


def run_of_file(rel: str) -> int:
    """The run a steps file must hold, by its name: steps.jsonl is run 0, repeats/run_<r>.jsonl run r."""
    return 0 if rel == STEPS else int(Path(rel).stem.removeprefix("run_"))


def _records(path: Path) -> list[dict[str, Any]]:
    return [rec for _, rec in read_records(path)]


def max_abs_bounds(a: dict[str, Any], b: dict[str, Any], param: str) -> tuple[float, float, str] | None:
    """What the records say of max |Δ| over `param`'s tensor at one step (its gradient when the
    gradient digests differ, else its value): |max|a| - max|b|| <= max |a - b| <= max|a| + max|b|,
    in float64 as train-check computes it. None when a figure is missing."""
    kind = "grad" if differing_parameters(a, b, "grad_sha256") and param in differing_parameters(a, b, "grad_sha256") else "value"
    ta, tb = a["tensors"].get(param) or {}, b["tensors"].get(param) or {}
    ma, mb = ta.get(f"{kind}_max_abs"), tb.get(f"{kind}_max_abs")
    if kind == "grad" and (ma is None or mb is None):  # a None gradient: train-check measured the value
        kind, ma, mb = "value", ta.get("value_max_abs"), tb.get("value_max_abs")
    if ma is None or mb is None:
        return None
    return abs(ma - mb), ma + mb, kind


def _check_divergence(said: dict[str, Any] | None, derived: list[dict[str, Any] | None], ref: list[dict[str, Any]],
                      other: list[dict[str, Any]], run: int) -> None:
    """One comparison's recorded divergence against the re-derived one (the rule of the report's
    version; a version-3 report may follow either rule): every field equal but max_abs_diff, which
    must lie within the records' bounds (the tensors are not in the pack)."""
    keys = ("run", "step", "where", "parameter", "parameters_differing", "cause", "detail")
    found = next((f for f in derived if said is not None and f is not None and all(said.get(k) == f[k] for k in keys)), derived[0])
    if (found is None) != (said is None):
        at = "no difference" if found is None else f"a first difference at step {found['step']} ({found['where']})"
        raise _bad(f"run {run}'s first divergence is recorded as {'none' if said is None else 'step ' + str(said['step'])}, "
                   f"but its steps file shows {at}")
    if found is None or said is None:
        return
    for key in keys:
        if said.get(key) != found[key]:
            raise _bad(f"run {run}'s first divergence says {key} {said.get(key)!r}; its steps file gives {found[key]!r}")
    got = said["max_abs_diff"]
    if got is None:
        return
    if found["step"] is None or found["parameter"] is None:
        raise _bad(f"run {run}: max |Δ| {got!r} is recorded where no parameter's tensor differs")
    a = next(r for r in ref[1:] if r["step"] == found["step"])
    b = next(r for r in other[1:] if r["step"] == found["step"])
    bounds = max_abs_bounds(a, b, found["parameter"])
    if bounds is not None and not bounds[0] <= got <= bounds[1]:
        raise _bad(f"run {run}: max |Δ| {got!r} of {found['parameter']} is outside what the records allow "
                   f"({bounds[0]!r} to {bounds[1]!r}, from its {bounds[2]}'s max |x| on each side)")


def rederive_report(folder: Path, chain: ChainCheck) -> str:
    """train_report.json re-derived from every steps file of the pack (the chain already checked);
    IntegrityError naming the first thing that does not follow."""
    folder = Path(folder)
    report = json.loads((folder / TRAIN_REPORT).read_bytes())
    config = json.loads((folder / TRAIN_CONFIG).read_bytes())
    for rc in chain.runs:
        if rc.run != run_of_file(rc.file):
            raise IntegrityError(f"{rc.file}: its genesis is of run {rc.run}, its name says run {run_of_file(rc.file)}",
                                 hint=_HINT)
    held = sorted(rc.run for rc in chain.runs)
    listed = [r["run"] for r in report["runs"]]
    if sorted(listed) != held:
        raise _bad(f"names runs {sorted(listed)}, but the pack holds the steps files of runs {held} "
                   f"({STEPS} and {REPEATS}/run_<r>.jsonl)")
    by_run = {r["run"]: r for r in report["runs"]}
    for rc in chain.runs:
        rr = by_run[rc.run]
        for key, want in (("file", rc.file), ("seed", rc.seed), ("genesis", rc.genesis), ("head", rc.head),
                          ("process", "reference" if rc.run == 0 else rr["process"] if rr["process"] != "reference" else "same or fresh")):
            if rr[key] != want and key == "file":
                raise _bad(f"run {rc.run} is recorded in {rr[key]!r}, but run {rc.run}'s steps file is {want!r}")
            if rr[key] != want:
                raise _bad(f"run {rc.run}'s {key} is recorded as {rr[key]!r}, but its steps file {rc.file} gives {want!r}")
    for key, want in (("steps", config["steps"]), ("seed", config["seed"]), ("test_options", config["test_options"]),
                      ("model", config["model"]["id"])):
        if report[key] != want:
            raise _bad(f"{key} {report[key]!r} is not {TRAIN_CONFIG}'s {want!r}")
    compared = [c["run"] for c in report["comparisons"]]
    if compared != held[1:]:
        raise _bad(f"compares runs {compared}; every repeat the pack holds must be compared once, in order ({held[1:]})")
    ref = _records(folder / STEPS)
    first: dict[str, Any] | None = None
    for comp in report["comparisons"]:
        other = _records(folder / by_run[comp["run"]]["file"])
        derived = [first_divergence(ref, other, run=comp["run"], test_options=config["test_options"], dtype=config["dtype"], rule=rule)
                   for rule in ((4, 3) if int(report["schema_version"]) <= 3 else (4,))]
        found = derived[0]
        if comp["equal"] != (found is None):
            at = "no difference" if found is None else f"a first difference at step {found['step']} ({found['where']})"
            raise _bad(f"run {comp['run']} is recorded as {'equal' if comp['equal'] else 'different'}, "
                       f"but its steps file shows {at}")
        _check_divergence(comp["first_divergence"], derived, ref, other, comp["run"])
        if found is not None and (first is None or earlier(comp["first_divergence"], first)):
            first = comp["first_divergence"]
    if report["first_divergence"] != first:
        raise _bad("the top-level first_divergence is not the earliest of the comparisons' "
                   f"({'none' if first is None else 'run ' + str(first['run']) + ', step ' + str(first['step'])})")
    verdict = "PASS" if first is None else "FAIL"
    if report["verdict"] != verdict:
        raise _bad(f"verdict {report['verdict']} does not follow from the steps files ({verdict})")
    if report["summary"] != summary(first, len(held), config["steps"]):
        raise _bad("the summary is not the one its verdict and first divergence give")
    text = folder / REPORT_TXT
    if text.is_file() and text.read_text(encoding="utf-8").split("\n", 1)[0] != report["summary"]:
        raise IntegrityError(f"{REPORT_TXT}: its first line is not {TRAIN_REPORT}'s summary", hint=_HINT)
    return f"verdict {verdict} re-derived from the {len(held)} runs' steps files (every comparison, cause and detail)"


__all__ = ["TRAIN_REPORT", "max_abs_bounds", "rederive_report", "run_of_file"]
