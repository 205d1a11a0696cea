"""The GitHub Actions job summary: report.md appended to $GITHUB_STEP_SUMMARY when set.

The CLI calls this after `check` and `diff`; the library never reads the environment.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from .markdown import render_markdown


def append_step_summary(report: dict[str, Any], environ: Mapping[str, str] = os.environ) -> Path | None:
    """Append the Markdown report to the file GitHub names; None when not in Actions."""
    target = environ.get("GITHUB_STEP_SUMMARY")
    if not target:
        return None
    with open(target, "a", encoding="utf-8") as f:  # GitHub gives each step its own file: append, never replace
        f.write(render_markdown(report) + "\n")
    return Path(target)
