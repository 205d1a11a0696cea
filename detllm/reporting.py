"""`detllm report`: find a report (run or diff folder, .tar.gz pack, or report.json) and
render it in one of the formats: txt, json, md, html, issue.

Owns the choice of format and where the rendering goes; the renderers live in render/.
Reads artifacts only, never an engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from . import artifacts
from .errors import ArtifactError, UsageError
from .schema_io import to_json
from .seedlayout import refuse_seed_layout

FORMATS = ("txt", "json", "md", "html", "issue")
_SUFFIX = {".txt": "txt", ".json": "json", ".md": "md", ".html": "html", ".htm": "html"}


def pick_format(fmt: str | None, out: Path | None) -> str:
    """--format as given, else from --out's suffix, else txt."""
    if fmt is None:
        return _SUFFIX.get(out.suffix.lower(), "txt") if out is not None else "txt"
    if fmt not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}",
                         hint="for JUnit XML pass --junit FILE" if fmt.lower() in ("junit", "xml") else None)
    return fmt


def _renderer(fmt: str) -> Callable[[dict[str, Any], Path | None], str]:
    if fmt == "json":
        return lambda r, _: to_json(r) + "\n"
    if fmt == "md":
        from .render.markdown import render_markdown

        return lambda r, _: render_markdown(r)
    if fmt == "html":
        from .render.html import render_outcome

        return render_outcome
    if fmt == "issue":
        from .render.issue import render_issue

        return render_issue
    from .render.text import render_text

    return lambda r, _: render_text(r)


def render_path(path: Path, fmt: str | None = None, *, out: Path | None = None, junit: Path | None = None) -> str:
    """Render the report at `path`; with `out`, also write it there (atomically). `junit`
    writes JUnit XML of the same report. Returns the rendering."""
    fmt = pick_format(fmt, out)
    render = _renderer(fmt)
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{str(path)!r} does not exist", hint="pass a run folder, a .tar.gz pack or a report.json")
    refuse_seed_layout(path)
    if path.is_file() and path.suffix == ".json":
        artifacts.check_complete(path.parent)
        report = artifacts.read_json(path, "report")
        text = render(report, path.parent)
    else:
        with artifacts.open_run_path(path) as folder:
            artifacts.check_complete(folder)
            if not (folder / artifacts.REPORT).is_file():
                raise ArtifactError(f"{str(path)!r} has no {artifacts.REPORT}", hint="pass a detllm run folder or pack")
            report = artifacts.read_json(folder / artifacts.REPORT, "report")
            text = render(report, folder)  # html/issue read env.json and the trace while the pack is open
    if junit is not None:
        from .render.junit import write_junit

        write_junit(report, junit)
    if out is not None:
        artifacts.atomic_write_text(out, text)
    return text
