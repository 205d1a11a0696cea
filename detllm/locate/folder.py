"""Where `locate` writes: locate.json (schemas/locate.schema.json), locate.txt and locate.md, into
the folder the two sides came from (a run folder both selections share, or the diff or check
folder given), which is then sealed again so `verify` and `pack` hold locate.json too; or into a
folder of its own, which is sealed the same way. Everything is checked before anything is re-run; the writes are atomic.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..runfolder import artifacts
from ..commands.diff import Selection
from ..core.errors import UsageError
from ..runfolder.folderlock import exclusive_writer
from ..runfolder.integrity import MANIFEST, SIG, seal
from ..render.locate import render_markdown, render_text
from .nextstep import next_step

LOCATE = "locate.json"
OWNED = (LOCATE, "locate.txt", "locate.md")


@dataclass
class Located:
    """What locate wrote: the folder and locate.json's content."""

    out_dir: Path
    doc: dict[str, Any]

    @property
    def exit_code(self) -> int:
        return 0  # written, located or not


@dataclass(frozen=True)
class Target:
    path: Path
    reseal: bool  # a sealed detllm folder or locate's own folder: its manifest is written (again) to hold the new files


def _home(left: Selection, right: Selection, source: str) -> Path | None:
    """The folder the sides came from, when there is one (not a .tar.gz pack)."""
    if source != "selections":
        return None
    if left.folder.resolve() == right.folder.resolve() and left.folder.is_dir():
        return left.folder
    return None


def check_out(out: str | Path | None, force: bool, left: Selection, right: Selection, source: str,
              given: str | None = None) -> Target:
    """The folder to write, refused now (UsageError) when it cannot be written."""
    if out is None:
        home = Path(given) if source != "selections" and given and Path(given).is_dir() else _home(left, right, source)
        out = home if home is not None else artifacts.default_out_dir("locate")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r} exists and is not a folder")
    if artifacts.is_detllm_folder(out) or artifacts.is_diff_folder(out):
        artifacts.check_complete(out)
        if (out / SIG).exists():
            raise UsageError(f"{str(out)!r} is signed: adding locate.json would break its signature",
                             hint="pass --out to write the located op to a folder of its own")
        return Target(out, (out / MANIFEST).is_file())
    if out.is_dir() and any(out.iterdir()) and not (out / LOCATE).is_file() and not force:
        raise UsageError(f"--out {str(out)!r} is not empty and holds no locate.json", hint="choose another --out or pass --force")
    artifacts.check_output_file(out / LOCATE, "--out")
    return Target(out, True)  # a folder of its own: sealed once written, so verify and pack take it


def write_locate(target: Target, doc: dict[str, Any]) -> Located:
    """Write locate.json (validated), locate.txt and locate.md; seal the folder again where it was sealed."""
    doc["next"] = next_step(doc)
    target.path.mkdir(parents=True, exist_ok=True)
    with exclusive_writer(target.path):
        artifacts.write_json(target.path, LOCATE, doc)
        artifacts.atomic_write_text(target.path / "locate.txt", render_text(doc))
        artifacts.atomic_write_text(target.path / "locate.md", render_markdown(doc))
        if target.reseal:
            seal(target.path)
    return Located(target.path, doc)
