"""The fleet folder: fleet.json (schemas/fleet.schema.json), fleet.txt and fleet.md, and for a fleet
check one run folder per endpoint (replica_<i>/). Owns the --out checks (refused before anything
runs), the atomic writes and the outcome handed to the CLI; the verdict is verdict.py's.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..runfolder import artifacts
from ..core.errors import EXIT_FAIL, EXIT_PASS, BackendError, UsageError
from ..render.fleet import render_markdown, render_text
from ..runfolder.fleetseal import FLEET

OWNED = (FLEET, "fleet.txt", "fleet.md", artifacts.MANIFEST, "manifest.sig", artifacts.PARTIAL)
REPLICA = "replica_{}"


@dataclass
class FleetOutcome:
    out_dir: Path | None  # None: an N-way diff without --out wrote nothing
    report: dict[str, Any]

    @property
    def status(self) -> str:
        return self.report["status"]

    @property
    def category(self) -> str:
        return self.report["category"]

    @property
    def exit_code(self) -> int:
        """0 all agree, 1 otherwise; 8 (a backend error) when no replica produced a verdict."""
        if not any(r["status"] == "ok" for r in self.report["replicas"]):
            return BackendError.exit_code
        return EXIT_FAIL if self.status == "FAIL" else EXIT_PASS


def is_fleet_folder(path: Path) -> bool:
    return (path / FLEET).is_file()


def _interrupted_fleet(path: Path) -> bool:
    """A fleet folder an interrupted check left: its marker, and only the fleet's own names."""
    return (path / artifacts.PARTIAL).is_file() and all(p.name in OWNED or p.name.startswith("replica_") for p in path.iterdir())


def check_fleet_out(out: Path) -> None:
    """--out must be new, empty, or an earlier fleet folder (whose files are replaced)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r} exists and is not a folder")
    artifacts.check_output_file(out / FLEET, "--out")
    if out.is_dir() and any(out.iterdir()) and not (is_fleet_folder(out) or _interrupted_fleet(out)):
        raise UsageError(f"--out {str(out)!r} is not empty and is not a detllm fleet folder", hint="choose another --out")


def prepare_fleet_out(out: Path) -> Path:
    """Create `out`, clearing what an earlier fleet left there (its files and replica folders)."""
    check_fleet_out(out)
    out.mkdir(parents=True, exist_ok=True)
    for p in out.iterdir():
        if p.name in OWNED or (p.name.startswith("replica_") and p.is_dir() and not p.is_symlink()):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    return out


def write_fleet(out: Path, report: dict[str, Any]) -> None:
    """fleet.json (validated), then its txt and md."""
    artifacts.write_json(out, FLEET, report)
    artifacts.atomic_write_text(out / "fleet.txt", render_text(report))
    artifacts.atomic_write_text(out / "fleet.md", render_markdown(report))


__all__ = ["FLEET", "REPLICA", "FleetOutcome", "check_fleet_out", "is_fleet_folder", "prepare_fleet_out", "write_fleet"]
