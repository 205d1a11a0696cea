"""verify of a sealed `diagnose --out` or `sweep --out` folder, after nestseal.py checked its bytes and
each run folder inside: what of its report follows from what the folder holds. A diagnosis: the
baseline's recorded status against baseline/report.json (itself re-derived from its trace), and each
probe's verdict (diverged, which kinds, vanish or not) against the comparisons it records. A sweep:
each cell that ran has its run folder inside. Reads JSON only; says plainly what is not re-derived.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..core.errors import IntegrityError
from ..runfolder.artifacts import REPORT

_EDITED = "the report was edited after it was written; run it again"


def _read(p: Path) -> Any:
    return json.loads(p.read_bytes())


def rederive_nested(folder: Path) -> str:
    folder = Path(folder)
    if (folder / "diagnosis.json").is_file():
        return _diagnosis(folder)
    return _sweep(folder)


def _diagnosis(folder: Path) -> str:
    doc = _read(folder / "diagnosis.json")
    src, said = doc.get("source") or {}, []
    base = folder / "baseline" / REPORT
    if src.get("kind") == "check" and base.is_file():
        got = _read(base)["status"]
        if src.get("status") != got:
            raise IntegrityError(f"diagnosis.json: source.status is {src.get('status')!r}, but baseline/report.json "
                                 f"(re-derived from its trace) says {got!r}", hint=_EDITED)
        said.append(f"the baseline's status {got}")
    n = 0
    for p in doc.get("probes", []):
        ev = p.get("evidence") or {}
        comps = ev.get("comparisons")
        if p.get("kind") != "check" or p.get("status") != "ran" or comps is None:
            continue
        if p.get("folder") and not (folder / p["folder"] / REPORT).is_file():
            raise IntegrityError(f"diagnosis.json: probe {p['name']!r} names {p['folder']}, which holds no report.json", hint=_EDITED)
        bad = [c for c in comps if c["diverged"]]
        kinds = sorted({c["kind"] for c in bad})
        if ev["diverged"] != bool(bad) or ev["kinds"] != kinds:
            raise IntegrityError(f"diagnosis.json: probe {p['name']!r} records diverged={ev['diverged']} kinds={ev['kinds']}, "
                                 f"but its comparisons give diverged={bool(bad)} kinds={kinds}", hint=_EDITED)
        if (p.get("outcome") == "vanish") == bool(bad):
            raise IntegrityError(f"diagnosis.json: probe {p['name']!r} records outcome {p.get('outcome')!r}, but its "
                                 f"comparisons {'diverge' if bad else 'do not diverge'}", hint=_EDITED)
        n += 1
    said.append(f"{n} probe verdict(s) (diverged, kinds, vanish or not) from the comparisons they record")
    return ("re-derived: " + "; ".join(said) + ". Not re-derived: each probe's comparisons from its run folder's trace, "
            "and the conclusion (which setting isolates the divergence)")


def _sweep(folder: Path) -> str:
    doc = _read(folder / "sweep.json")
    ran = [c for c in doc["cells"] if c.get("status") == "ran"]
    for c in ran:
        if not (folder / c["folder"] / REPORT).is_file() and not (folder / c["folder"] / "trace.jsonl").is_file():
            raise IntegrityError(f"sweep.json: cell {c['cell']} names {c['folder']}, which is not in the folder", hint=_EDITED)
    return (f"the {len(ran)} cell(s) that ran are run folders inside, each verified. Not re-derived: each cell's label, "
            f"unique outputs and divergence rate against the reference cell")


__all__ = ["rederive_nested"]
