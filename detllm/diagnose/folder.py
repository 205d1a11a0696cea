"""The diagnosis folder: its file names, the Diagnosis a run returns and the files it is written
to, the prompts read back from a folder's records, and the folder name of each probe. Shared by
diagnose/core.py (a check's diagnosis) and diagnose/recorded.py (a diff's); runs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..runfolder import artifacts
from ..core.errors import UsageError
from ..runfolder.nestseal import seal_nested
from .render import render_html, render_markdown, render_text

DIAGNOSIS = "diagnosis.json"
OWNED = (DIAGNOSIS, "diagnosis.txt", "diagnosis.md", "diagnosis.html", "prompts.jsonl", "baseline", "probes", "logs", "layers")


@dataclass
class Diagnosis:
    out_dir: Path
    doc: dict[str, Any]

    @property
    def exit_code(self) -> int:
        return 0


def write_diagnosis(out: Path, doc: dict[str, Any]) -> Diagnosis:
    """Write diagnosis.json and its renderings (.txt, .md, .html) under `out`, then seal the folder."""
    artifacts.write_json(out, DIAGNOSIS, doc)
    artifacts.atomic_write_text(out / "diagnosis.txt", render_text(doc))
    artifacts.atomic_write_text(out / "diagnosis.md", render_markdown(doc))
    artifacts.atomic_write_text(out / "diagnosis.html", render_html(doc))
    seal_nested(out)  # last: verify and pack take the folder (runfolder/nestseal.py)
    return Diagnosis(out, doc)


def prompts_from_records(records: list[dict[str, Any]], where: str) -> list[str]:
    by_index: dict[int, str] = {}
    for r in records:
        if r.get("prompt_text") is None:
            raise UsageError(f"{where} was recorded without prompt text (--no-prompt-text), so its prompts cannot be re-run",
                             hint="run diagnose with check's options instead of a folder")
        by_index[r["prompt_index"]] = r["prompt_text"]
    return [by_index[i] for i in sorted(by_index)]


def slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "=-_." else "-" for c in name).strip("-")
