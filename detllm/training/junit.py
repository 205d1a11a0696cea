"""JUnit XML for CI from the training commands' documents (train_report.json, parity.json): one
testcase per repeat compared with run 0 (train-check), one per logprob path (parity). A failure
carries the first divergence; a path that was not compared is <skipped> with its reason, never a
pass. Reads the documents only; render/junit.py owns a check's JUnit.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from ..runfolder.artifacts import atomic_write_text
from .verdict import describe


def _xml(suite: ET.Element, failures: int, skipped: int = 0) -> str:
    tests = len(suite.findall("testcase"))
    for key, value in (("tests", tests), ("failures", failures), ("errors", 0), ("skipped", skipped)):
        suite.set(key, str(value))
    root = ET.Element("testsuites", {"name": suite.get("name", ""), "tests": str(tests), "failures": str(failures), "errors": "0"})
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def train_report_junit(report: dict[str, Any]) -> str:
    """train-check: testcase `run R (process)` per repeat; a FAIL names the step, field and parameter."""
    suite = ET.Element("testsuite", {"name": f"detllm {report['command']} {report['model']}"})
    processes = {r["run"]: r["process"] for r in report["runs"]}
    failures = 0
    for comp in report["comparisons"]:
        case = ET.SubElement(suite, "testcase", {"classname": "detllm.train_check", "time": "0",
                                                 "name": f"run {comp['run']} ({processes.get(comp['run'], '?')} process) vs run 0"})
        d = comp["first_divergence"]
        if d is None:
            ET.SubElement(case, "system-out").text = f"bitwise equal at every one of {report['steps']} steps"
            continue
        failures += 1
        code = f"TRAIN_{(d['cause'] or 'unknown').upper()}"
        ET.SubElement(case, "failure", {"type": code, "message": describe(d)}).text = f"{report['summary']}\nscope: {report['scope']}"
    return _xml(suite, failures)


def parity_junit(doc: dict[str, Any]) -> str:
    """parity: testcase per path (decode, prefill) against the trainer, within atol."""
    suite = ET.Element("testsuite", {"name": f"detllm parity {doc['model']} {doc['engine']['backend']}"})
    failures = skipped = 0
    for name, p in doc["paths"].items():
        case = ET.SubElement(suite, "testcase", {"classname": "detllm.parity", "time": "0",
                                                 "name": f"{name} vs trainer ({doc['engine']['backend']})"})
        if not p["available"]:
            skipped += 1
            ET.SubElement(case, "skipped", {"message": f"not compared: {p['reason']}"})
            continue
        f = p["first_difference"]
        summary = (f"{p['bitwise_equal_positions']}/{p['positions']} tokens bitwise equal, max |Δlogprob| {p['max_abs_diff']:.3g}, "
                   f"atol {doc['atol']}")
        if f is None:
            ET.SubElement(case, "system-out").text = summary
            continue
        failures += 1
        ET.SubElement(case, "failure", {"type": "PARITY_MISMATCH",
                                        "message": f"sequence {f['sequence']}, token {f['position']}: trainer {f['trainer']!r}, "
                                                   f"engine {f['engine']!r}"}).text = summary
    return _xml(suite, failures, skipped)


def write(text: str, path: str | Path) -> Path:
    atomic_write_text(Path(path), text)
    return Path(path)


__all__ = ["parity_junit", "train_report_junit", "write"]
