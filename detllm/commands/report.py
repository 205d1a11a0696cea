"""`detllm report`: find a report (run or diff folder, .tar.gz pack, or report.json) and
render it in one of the formats: txt, json, md, html, issue; or, with kld, two runs' traces
(two run folders, or the two a diff folder compared) as llama-perplexity's KLD statistics.

Owns the choice of format and where the rendering goes; the renderers live in render/.
Reads artifacts only, never an engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ..runfolder import artifacts
from ..core.errors import ArtifactError, UsageError
from ..runfolder.schema_io import to_json
from ..runfolder.seedlayout import refuse_seed_layout

FORMATS = ("txt", "json", "md", "html", "issue", "kld")
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
        from ..render.markdown import render_markdown

        return lambda r, _: render_markdown(r)
    if fmt == "html":
        from ..render.html import render_outcome

        return render_outcome
    if fmt == "issue":
        from ..render.issue import render_issue

        return render_issue
    from ..render.text import render_text

    return lambda r, folder: render_text(r) + _located(folder)


def _located(folder: Path | None) -> str:
    """txt: the folder's locate finding (html and issue show it too), in a few lines; "" without one."""
    from ..render.locate import load_located, summary_lines

    doc = load_located(folder)
    return "".join(line + "\n" for line in summary_lines(doc)) if doc is not None else ""


def render_path(path: Path, fmt: str | None = None, *, out: Path | None = None, junit: Path | None = None,
                right: str | Path | None = None, reference: str | None = None) -> str:
    """Render the report at `path`; with `out`, also write it there (atomically). `junit`
    writes JUnit XML of the same report. `right`: the second run of --format kld. `reference`: a fleet
    folder's reference replica for --format kld (fleetkld.py). Returns the rendering."""
    fmt = pick_format(fmt, out)
    if reference is not None and fmt != "kld":
        raise UsageError("--reference names the reference replica of --format kld on a fleet folder")
    from ..runfolder.archive import is_archive  # lazy: tarfile and gzip load when a pack is read

    if fmt == "kld" and right is None and junit is None and (Path(path).is_dir() or is_archive(path)):
        with artifacts.open_run_path(Path(path)) as folder:  # a fleet folder or its pack: each replica's block
            if (folder / "fleet.json").is_file() and not (folder / artifacts.REPORT).is_file():
                from ..render.kld import render_kld
                from .fleetkld import fleet_kld

                artifacts.check_complete(folder)
                text = fleet_kld(folder, reference, lambda a, b: render_kld(kld_document(a, b)))
                if out is not None:
                    artifacts.atomic_write_text(out, text)
                return text
    if reference is not None:
        raise UsageError("--reference applies to a fleet folder (detllm report --format kld FLEET --reference replica_N)")
    if fmt == "kld" or right is not None:
        if fmt != "kld" or junit is not None:
            raise UsageError("a second run folder is read by --format kld only, and kld writes no JUnit" if fmt != "kld"
                             else "--format kld compares two traces and has no JUnit form", hint="drop --junit" if junit else None)
        from ..render.kld import render_kld

        text = render_kld(kld_document(path, right))
        if out is not None:
            artifacts.atomic_write_text(out, text)
        return text
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
            if (folder / "fleet.json").is_file() and not (folder / artifacts.REPORT).is_file():
                return _render_fleet(folder, fmt, out, junit)  # a fleet folder or its pack (docs/fleet.md)
            if not (folder / artifacts.REPORT).is_file():
                raise ArtifactError(f"{str(path)!r} has no {artifacts.REPORT}", hint="pass a detllm run folder or pack")
            report = artifacts.read_json(folder / artifacts.REPORT, "report")
            text = render(report, folder)  # html/issue read env.json and the trace while the pack is open
    if junit is not None:
        from ..render.junit import write_junit

        write_junit(report, junit)
    if out is not None:
        artifacts.atomic_write_text(out, text)
    return text


def _render_fleet(path: Path, fmt: str, out: Path | None, junit: Path | None) -> str:
    from ..render import fleet

    if fmt not in ("txt", "md", "json", "html"):
        raise UsageError(f"a fleet folder renders as txt, md, json or html, not {fmt}")
    artifacts.check_complete(path)
    doc = artifacts.read_json(path / "fleet.json", "fleet")
    text = {"txt": fleet.render_text, "md": fleet.render_markdown, "html": fleet.render_html,
            "json": lambda d: to_json(d) + "\n"}[fmt](doc)
    if junit is not None:
        artifacts.atomic_write_text(junit, fleet.render_junit(doc))
    if out is not None:
        artifacts.atomic_write_text(out, text)
    return text


def kld_document(a: str | Path, b: str | Path | None = None) -> dict[str, Any]:
    """The KLD statistics of two runs (compare/kld.py): `a` and `b` are run folders, packs or
    diff selections (`FOLDER::run_N@batch_B`); `a` alone is a diff folder, whose two sides are
    read from where it recorded them (as given to diff, else next to the diff folder). The left
    run is the base (P)."""
    from ..compare.kld import positions, statistics
    from .diff import Selection, effective_dtype, load_sides, shown_device

    sels = (Selection.parse(a), Selection.parse(b)) if b is not None else _diff_sides(Path(a))
    left, right = load_sides(*sels)
    found, counts = positions(left.records or [], right.records or [])
    def side(s: Any) -> dict[str, Any]:
        cfg = s.run_config["config"]
        return {"label": s.label, "dtype": effective_dtype(s), "backend": cfg["backend"], "model": cfg["model"],
                "device": shown_device(cfg)}

    return {"left": side(left), "right": side(right), "counts": counts, "statistics": statistics(found),
            "top_k": min(s.run_config["config"]["logprobs"] for s in (left, right))}


def _diff_sides(path: Path) -> tuple[Any, Any]:
    from .diff import Selection

    if not path.exists():
        raise UsageError(f"{str(path)!r} does not exist", hint="pass two run folders, or a diff folder")
    if not path.is_dir() or not artifacts.is_diff_folder(path):
        raise UsageError("--format kld compares two runs' traces: pass two run folders, or a diff folder",
                         hint="detllm report --format kld LEFT_RUN RIGHT_RUN")
    artifacts.check_complete(path)
    summary = artifacts.read_json(path / artifacts.REPORT, "report")["summary"]
    sels = []
    for name in ("left", "right"):
        s = summary[name]
        folder = next((f for f in (Path(s["folder"]), path.parent / s["folder"]) if f.exists()), None)
        if folder is None:
            raise ArtifactError(f"the diff folder's {name} run {s['folder']!r} is not where diff read it (a diff folder holds no trace)",
                                hint="pass the two run folders: detllm report --format kld LEFT_RUN RIGHT_RUN")
        sels.append(Selection(folder, s["run_index"], s["batch_size"]))
    return sels[0], sels[1]
