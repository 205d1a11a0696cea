"""The engagement and bound lines of a check's verdict (pipeline/engagement.py judges them): one
wording for text, Markdown, HTML, the step summary and the CLI, so no format can drop them.
"""

from __future__ import annotations

from typing import Any


def pct(x: float) -> str:
    return f"{x * 100:.3g}%"


def bound_text(b: dict[str, Any]) -> str:
    """"0 of 12 prompts diverged: divergence rate < 22% (95%), for prompts drawn like these"; under
    --fill-prompts the user's prompts and the fillers are counted and bounded apart."""
    split = b.get("fillers")
    if split:
        y, f = split["yours"], split["fillers"]
        text = (f"{y['diverged']} of {y['prompts']} of your prompts, {f['diverged']} of {f['prompts']} fillers diverged: "
                f"divergence rate < {pct(b['upper'])} ({pct(b['confidence'])}) over both, < {pct(y['upper'])} over yours alone, "
                "for prompts drawn like these")
    else:
        text = (f"0 of {b['prompts']} prompts diverged: divergence rate < {pct(b['upper'])} ({pct(b['confidence'])}), "
                "for prompts drawn like these")
    m = b.get("max_rate")
    if m:
        text += f"; --max-rate {m['rate']:g} {'met' if m['met'] else 'NOT met'} by {m['by']}"
    return text


def comparison_note(c: dict[str, Any]) -> str:
    """"  (rate < 63.2%)" on a PASS, and the engagement answer where it is not plain engaged."""
    out = ""
    if c.get("status") == "PASS" and c.get("bound"):
        out += f"  (rate < {pct(c['bound']['upper'])} at {pct(c['bound']['confidence'])})"
    e = c.get("engagement")
    if e and e["answer"] != "engaged":
        out += f"  [{e['axis']} {e['answer'].replace('_', ' ')}]"
    return out


def lines(report: dict[str, Any]) -> list[str]:
    """The engagement and bound lines every format prints under a check's verdict."""
    out = []
    eng = report.get("engagement") or {}
    by = {c["name"]: c for c in report.get("comparisons", [])}
    for name in eng.get("unverified", []):
        e = by[name]["engagement"]
        out.append(f"UNVERIFIED {name}: {e['axis']} {e['answer'].replace('_', ' ')}: {e['evidence']}"
                   + (f"; {e['fix']}" if e.get("fix") else ""))
    for name in eng.get("not_observable", []):
        out.append(f"PASS {name} (engagement not observable): {by[name]['engagement']['evidence']}")
    if report.get("status") == "PASS" and report.get("bound"):
        out.append(f"bound: {bound_text(report['bound'])} (weakest: {report['bound']['comparison']})")
    return out


def engagement_warning(report: dict[str, Any]) -> str | None:
    """One line when a check is UNVERIFIED: nothing diverged, but an axis it varied was not shown engaged."""
    names = (report.get("engagement") or {}).get("unverified") or []
    if report.get("status") != "UNVERIFIED" or not names:
        return None
    e = next(c for c in report["comparisons"] if c["name"] == names[0])["engagement"]
    return (f"UNVERIFIED: {len(names)} comparison(s) passed without their axis engaged ({', '.join(names)}): "
            f"{e['evidence']}" + (f"; {e['fix']}" if e.get("fix") else ""))


__all__ = ["bound_text", "comparison_note", "engagement_warning", "lines", "pct"]
