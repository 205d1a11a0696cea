"""The GitHub Actions job summary: report.md appended to $GITHUB_STEP_SUMMARY when set, headed by
the warning a CI reader must see (a tier that was requested but not checked).

The CLI calls this after `check` and `diff`; the library never reads the environment.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from .engaged import engagement_warning
from .markdown import render_markdown


def tier_warning(report: dict[str, Any]) -> str | None:
    """One line when the verdict checked a lower tier than was asked for (best-effort mode
    downgraded it): a green gate that tested less than it says. None when the tiers agree."""
    tier = report["tier"]
    if tier["requested"] == tier["effective"]:
        return None
    why = "best-effort mode downgraded it; pass --mode strict to fail instead" if report["command"] in ("check", "run") \
        else "the most the sides' records allow"
    return f"tier {tier['requested']} requested, tier {tier['effective']} checked ({why})"


def step_summary_target(environ: Mapping[str, str] = os.environ) -> Path | None:
    return Path(environ["GITHUB_STEP_SUMMARY"]) if environ.get("GITHUB_STEP_SUMMARY") else None


def append_step_summary(report: dict[str, Any], environ: Mapping[str, str] = os.environ) -> Path | None:
    """Append the Markdown report (after the tier warning, when there is one) to the file GitHub
    names; None when not in Actions. An OSError on that file is the caller's to report."""
    target = step_summary_target(environ)
    if target is None:
        return None
    head = "".join(f"> **Warning:** {w}\n\n" for w in (tier_warning(report), engagement_warning(report)) if w)
    with open(target, "a", encoding="utf-8") as f:  # GitHub gives each step its own file: append, never replace
        f.write(head + render_markdown(report) + "\n")
    return target
