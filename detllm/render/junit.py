"""JUnit XML from report.json: one testsuite per comparison, one testcase per prompt.

A diverged prompt in a required comparison is a <failure> typed with the cause of its own
comparison (a check's causes name the comparisons they explain) and its magnitude label;
a prompt present on one side only fails as PROMPT_MISMATCH; a divergence the tier
does not require passes with the difference in <system-out>. A tier requested but not checked
(best-effort downgrade) is each suite's <properties>, so a green gate says what it tested. CI systems read this.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from ..runfolder.artifacts import atomic_write_text
from .engaged import engagement_warning
from .github import tier_warning
from .text import cause_summary, divergence_lines


def _case(suite: ET.Element, classname: str, name: str) -> ET.Element:
    return ET.SubElement(suite, "testcase", {"classname": classname, "name": name, "time": "0"})


def cause_of(report: dict[str, Any], comp: dict[str, Any]) -> dict[str, Any] | None:
    """The most likely cause of this comparison: the first ranked cause whose evidence names
    it (a check's causes are merged over comparisons), else the report's top cause."""
    mine = [c for c in report["causes"] if comp["name"] in c["evidence"].get("comparisons", ())]
    return mine[0] if mine else (report["causes"][0] if report["causes"] else None)


def _suite(report: dict[str, Any], comp: dict[str, Any]) -> ET.Element:
    top = cause_of(report, comp)
    classname = f"detllm.{report['command']}"
    suite = ET.Element("testsuite", {"name": comp["name"]})
    warning, unverified = tier_warning(report), engagement_warning(report)
    if warning or unverified:  # <properties> comes first in a testsuite
        props = ET.SubElement(suite, "properties")
        pairs = (("detllm.tier_requested", report["tier"]["requested"]), ("detllm.tier_checked", report["tier"]["effective"]),
                 ("detllm.warning", warning)) if warning else ()
        if unverified:
            pairs += (("detllm.status", report["status"]), ("detllm.engagement", unverified))
        for name, value in pairs:
            ET.SubElement(props, "property", {"name": name, "value": str(value)})
    by_prompt = {d["prompt_index"]: d for d in comp["divergences"]}
    failures = 0
    indexes = comp.get("prompts") or sorted(by_prompt)  # reports written before "prompts" existed list no others
    for i in indexes:
        d = by_prompt.get(i)
        case = _case(suite, classname, f"prompt {i}")  # stable across runs: CI tracks tests by name
        if d is None:
            continue
        detail = "\n".join(divergence_lines(d))
        if comp["required"]:
            failures += 1
            code = top["code"] if top else "DIVERGED"
            label = (d.get("magnitude") or {}).get("label")
            msg = f"{code}: generated token {d['token_index']} differs ({d['kind']})" + (f" - {label.replace('_', ' ')}" if label else "")
            why = f"\n{code}: {cause_summary(top)}" if top else ""
            ET.SubElement(case, "failure", {"type": code, "message": msg}).text = detail + why
        else:
            ET.SubElement(case, "system-out").text = "differs, not required at this tier\n" + detail
    for where in ("left_only", "right_only"):
        for i in comp["unmatched"][where]:
            failures += 1
            case = _case(suite, classname, f"prompt {i} ({where.replace('_', ' ')})")
            ET.SubElement(case, "failure", {"type": "PROMPT_MISMATCH",
                                            "message": f"prompt {i} exists {where.replace('_', ' ')}: compared with nothing"})
    suite.set("tests", str(len(suite.findall("testcase"))))
    suite.set("failures", str(failures))
    suite.set("errors", "0")
    return suite


def render_junit(report: dict[str, Any]) -> str:
    root = ET.Element("testsuites", {"name": f"detllm {report['command']}"})
    for comp in report["comparisons"]:
        root.append(_suite(report, comp))
    root.set("tests", str(sum(int(s.get("tests", "0")) for s in root)))
    root.set("failures", str(sum(int(s.get("failures", "0")) for s in root)))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(report: dict[str, Any], path: Path) -> Path:
    atomic_write_text(Path(path), render_junit(report))
    return Path(path)
