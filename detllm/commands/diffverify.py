"""verify of a sealed `diff --out` folder (two run folders, two packs or two bare traces): the
verdict re-derived from the comparison the folder records, since the two sides' traces are not in it.

Owns which of report.json's fields follow from its recorded comparison (each comparison's status
from its divergences and unmatched prompts; the report's status, category and first divergence from
the comparisons; diffs/first_divergence.json from the report), and the sentence saying what is not
re-derived (the comparison itself and the ranking of causes). Reads JSON only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..core.errors import IntegrityError
from ..pipeline.rederive import as_written
from ..runfolder.artifacts import FIRST_DIVERGENCE, REPORT

_EDITED = "the verdict was edited after the diff; run the diff again"


def is_diff_folder(folder: Path) -> bool:
    """Whether `folder` holds a diff's report.json (and no trace: a run folder's verdict is rederive.py's)."""
    p = Path(folder) / REPORT
    try:
        doc = json.loads(p.read_bytes()) if p.is_file() else None
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("command") == "diff"


def _same(a: Any, b: Any) -> bool:
    return as_written(a) == as_written(b)


def _refuse(what: str) -> IntegrityError:
    return IntegrityError(f"{REPORT}: {what}", hint=_EDITED)


def _check_comparison(c: dict[str, Any]) -> None:
    divs, unmatched = c["divergences"], c["unmatched"]
    name = c["name"]
    if c["prompts_diverged"] != len(divs):
        raise _refuse(f"comparison {name!r} records {c['prompts_diverged']} prompt(s) diverged, but lists {len(divs)} divergence(s)")
    first = divs[0] if divs else None
    if not _same(c["first_divergence"], first):
        raise _refuse(f"comparison {name!r}: its first_divergence is not the first of its divergences")
    diverged = bool(divs) or bool(unmatched["left_only"]) or bool(unmatched["right_only"])
    status = "PASS" if not diverged else ("FAIL" if c["required"] else "INFO")
    if c["status"] != status:
        raise _refuse(f"comparison {name!r}: status is {c['status']!r}, but its divergences and unmatched prompts give {status!r}")


def rederive_diff(folder: Path) -> str:
    """Raise IntegrityError naming the first field of a diff's report.json that does not follow from the
    comparison it records; return what was and was not re-derived, in words, for `verify` to print."""
    folder = Path(folder)
    report = json.loads((folder / REPORT).read_bytes())
    try:
        return _rederive(folder, report)
    except (KeyError, TypeError, IndexError) as exc:  # a layout this re-derivation does not know (an older detllm)
        return f"diff verdict not re-derived: its report.json lacks {exc} in the layout this detllm reads; its report is as sealed"


def _rederive(folder: Path, report: dict[str, Any]) -> str:
    comps = report["comparisons"]
    for c in comps:
        _check_comparison(c)
    failed = any(c["status"] == "FAIL" for c in comps)
    status = "FAIL" if failed else "PASS"
    if report["status"] != status:
        raise _refuse(f"status is {report['status']!r}, but its recorded comparison gives {status!r}")
    causes = report["causes"]
    if failed and not causes:
        raise _refuse("status is 'FAIL' but no cause is recorded")
    category = causes[0]["code"] if failed else "PASS"
    if report["category"] != category:
        raise _refuse(f"category is {report['category']!r}, but {'its first cause is' if failed else 'a PASS gives'} {category!r}")
    first = next((c["first_divergence"] for c in comps if c["first_divergence"] is not None), None)
    if not _same(report["first_divergence"], first):
        raise _refuse("first_divergence is not the one its recorded comparison gives")
    tier = report["tier"]
    if tier["effective"] > tier["requested"]:
        raise _refuse(f"effective tier {tier['effective']} is above the requested tier {tier['requested']}")
    fd = folder / FIRST_DIVERGENCE
    if (first is not None) != fd.is_file():
        raise IntegrityError(f"{FIRST_DIVERGENCE}: {'missing' if first is not None else 'present'}, but the report's "
                             f"first divergence is {'set' if first is not None else 'null'}", hint=_EDITED)
    if first is not None and not _same(json.loads(fd.read_bytes())["divergence"], first):
        raise IntegrityError(f"{FIRST_DIVERGENCE}: its divergence is not report.json's first divergence", hint=_EDITED)
    sides = report["summary"]
    left, right = (sides.get(k, {}).get("folder") or "?" for k in ("left", "right"))
    return (f"diff verdict {status}" + (f" ({category})" if failed else "")
            + f" re-derived from the {len(comps)} comparison(s) it records; not re-derived: the comparison itself and "
            f"the ranking of causes, as the two sides' traces are not in the folder "
            f"(detllm diff {left} {right} compares them again)")


__all__ = ["is_diff_folder", "rederive_diff"]
