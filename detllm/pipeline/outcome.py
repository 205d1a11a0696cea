"""What a finished check or diff hands back (Outcome) and how its report files are written and sealed
(write_report). Apart from runner.py so that a diff, which runs no engine, does not import the
run machinery (backends, fresh processes, batching) to write its report.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import EXIT_FAIL, EXIT_PASS, EXIT_UNVERIFIED_STRICT
from ..runfolder import artifacts

if TYPE_CHECKING:
    from ..runfolder.signing import Signer


@dataclass
class Outcome:
    out_dir: Path | None  # None: a diff without --out wrote no folder
    report: dict[str, Any]

    @property
    def status(self) -> str:
        return self.report["status"]

    @property
    def category(self) -> str:
        """The top cause code, PASS, RECORDED or UNVERIFIED (the seed's report.category)."""
        return self.report["category"]

    @property
    def details(self) -> dict[str, Any]:
        """Everything report.json says beyond status and category (the seed's report.details)."""
        return {k: v for k, v in self.report.items() if k not in ("schema_version", "artifact_type", "status", "category")}

    @property
    def exit_code(self) -> int:
        """1 FAIL; 3 UNVERIFIED in strict mode (after the folder was written and sealed); else 0."""
        if self.status == "UNVERIFIED" and (self.report.get("engagement") or {}).get("strict"):
            return EXIT_UNVERIFIED_STRICT
        return EXIT_FAIL if self.status == "FAIL" else EXIT_PASS


def write_report(out: Path, report: dict[str, Any], *, signer: Signer | None = None,
                 record_digests: list[bytes] | None = None) -> None:
    """report.json, report.txt, report.md and, on FAIL, diffs/first_divergence.json; then, last, the
    manifest that seals the folder (and manifest.sig with a signer), see integrity.py. The renderers and
    the seal are imported here, when a report is written: an Outcome alone (the Python API) needs none."""
    from ..render.markdown import render_markdown
    from ..render.text import render_text
    from ..runfolder.integrity import seal

    if report["first_divergence"] is not None:
        comp = next((c for c in report["comparisons"] if c["first_divergence"] is report["first_divergence"]), None)
        body: dict[str, Any] = {"divergence": report["first_divergence"]}
        if comp is not None:
            body["per_prompt"] = comp["divergences"]
        artifacts.write_json(out, artifacts.FIRST_DIVERGENCE, artifacts.stamp("first_divergence", body))
    artifacts.write_json(out, artifacts.REPORT, report)
    artifacts.atomic_write_text(out / artifacts.REPORT_TXT, render_text(report))
    artifacts.atomic_write_text(out / artifacts.REPORT_MD, render_markdown(report))
    seal(out, signer, record_digests)
    artifacts.mark_complete(out)  # last: until here the folder carries artifacts.PARTIAL
