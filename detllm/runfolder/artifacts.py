"""The run folder: its layout, atomic writes, schema validation, loading.

Owns the contract of what a run folder holds. Every JSON file carries
`schema_version` and `artifact_type` and is validated against
`schemas/<artifact_type>.schema.json` before it is written and after it is read.
Does not own what goes into the files (runner, compare) or manifests (integrity).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..core.errors import ArtifactError, UsageError
from .records import check_trace_record  # the schema's fast equivalent: jsonschema is ~100x slower on traces
# Schemas, stamping, JSON text and atomic writes live in schema_io (the bottom module); these
# names stay importable from here for the code that has always used them.
from .schema_io import (  # noqa: F401
    READABLE_SCHEMA_VERSIONS, SCHEMA_VERSION, _UMASK, _validator, atomic_write_text, check_header, dumps, load_schema,
    schema_dir, stamp, utc_now, validate, write_json,
)
from .schema_io import finite as _finite  # noqa: F401

ENV = "env.json"
RUN_CONFIG = "run_config.json"
APPLIED = "determinism_applied.json"
TRACE = "trace.jsonl"
REPORT = "report.json"
REPORT_TXT = "report.txt"
REPORT_MD = "report.md"
FIRST_DIVERGENCE = "diffs/first_divergence.json"
MANIFEST = "manifest.json"
JSON_FILES = {ENV: "env", RUN_CONFIG: "run_config", APPLIED: "determinism_applied", REPORT: "report", FIRST_DIVERGENCE: "first_divergence",
              MANIFEST: "manifest"}
# Names detllm writes into a run folder; a re-used --out loses all of them first.
OWNED_NAMES = (ENV, RUN_CONFIG, APPLIED, TRACE, REPORT, REPORT_TXT, REPORT_MD, MANIFEST, "manifest.sig", "diffs", "plots")
# Present from the first write into a folder until it is sealed: a run that fails or is killed
# part-way leaves it behind, and report, diff, verify, replay and pack refuse the folder.
PARTIAL = "detllm.partial"


def mark_incomplete(out: Path) -> None:
    """The first write into `out`: the marker that says it is not finished."""
    atomic_write_text(out / PARTIAL, f"incomplete: detllm (pid {os.getpid()}) began writing this folder at {utc_now()}; "
                                     f"this file is removed once the folder is sealed\n")


def mark_complete(out: Path) -> None:
    """The last step of a run (after manifest.json is written): remove the marker."""
    (out / PARTIAL).unlink(missing_ok=True)


def check_complete(folder: Path) -> None:
    """ArtifactError (exit 5) for a folder a run left incomplete."""
    if (Path(folder) / PARTIAL).exists():
        raise ArtifactError(f"{str(folder)!r} is incomplete: the run that wrote it failed, was interrupted or is still "
                            f"running ({PARTIAL} is there)", hint="re-run it; a partial folder is never compared, reported or packed")


_ENCODE = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode  # a trace line's spelling
_SORTED = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode  # canonical_json's


class TraceWriter:
    """Appends validated records to `trace.jsonl.partial`; `finish()` renames it into place,
    so an interrupted run never leaves a trace.jsonl that looks complete. Keeps the sha256 of
    each record's canonical JSON (`digests`), so sealing need not parse the trace again."""

    def __init__(self, folder: Path) -> None:
        self.final = folder / TRACE
        self.partial = folder / (TRACE + ".partial")
        self._f = open(self.partial, "w", encoding="utf-8")
        self.count = 0
        self.digests: list[bytes] = []  # sha256(canonical JSON) of each record written, in order

    def write(self, record: dict[str, Any]) -> None:
        try:
            parts = {k: _ENCODE(v) for k, v in record.items()}
        except ValueError:  # a NaN/inf logprob: rare, so the record is walked only then
            record = _finite(record)
            parts = {k: _ENCODE(v) for k, v in record.items()}
        problem = check_trace_record(record)
        if problem is not None:
            raise ArtifactError(f"{TRACE} line {self.count + 1}: schema violation: {problem}")
        # the line keeps the runner's field order (compare/trace.py reads payloads by it); the chain is over
        # canonical JSON (canonical_json: sorted keys). Each value is encoded once for both: a valid record's
        # values hold no object but the evidence (and what it nests), which the digest takes with sorted keys
        keys = {k: _ENCODE(k) for k in record}
        self._f.write("{" + ",".join(f"{keys[k]}:{parts[k]}" for k in record) + "}\n")
        canonical = "{" + ",".join(f"{keys[k]}:{_SORTED(record[k]) if type(record[k]) is dict else parts[k]}" for k in sorted(record)) + "}"
        self.digests.append(hashlib.sha256(canonical.encode("utf-8")).digest())
        self.count += 1

    def finish(self) -> Path:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.partial, self.final)
        return self.final

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()


def is_detllm_folder(path: Path) -> bool:
    """A run folder detllm wrote (run, check, replay)."""
    cfg = path / RUN_CONFIG
    if not cfg.is_file():
        return False
    try:
        return json.loads(cfg.read_text()).get("artifact_type") == "run_config"
    except (OSError, ValueError, AttributeError):
        return False


def is_diff_folder(path: Path) -> bool:
    """A folder `diff --out` wrote: a report.json of command diff and no run_config.json."""
    if (path / RUN_CONFIG).exists():
        return False
    try:
        rep = json.loads((path / REPORT).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(rep, dict) and rep.get("artifact_type") == "report" and rep.get("command") == "diff"


def default_out_dir(command: str, root: Path = Path("artifacts")) -> Path:
    """A new folder name under `root`: UTC time plus the process id, so two runs started in the
    same second (two CI jobs, say) never share a folder."""
    stamp_ = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    base = root / f"{command}-{stamp_}-{os.getpid()}"
    out, n = base, 1
    while out.exists():
        n += 1
        out = Path(f"{base}-{n}")
    return out


def check_out_dir(out: Path, *, force: bool, kind: str = "run") -> None:
    """Refuse, before anything runs, an --out detllm must not write into: a file, a path under a
    file or an unwritable folder, a run folder as a diff's output (kind "diff") or a diff folder as
    a run's, and a non-empty folder detllm did not write unless --force (and even then one that
    holds a name detllm would overwrite)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r} exists and is not a folder")
    _check_writable_parent(out, "--out")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if {p.name for p in out.iterdir()} <= {PARTIAL, TRACE + ".partial"}:
        return  # a run was killed right after its first write: nothing else is there
    ours = is_diff_folder(out) if kind == "diff" else is_detllm_folder(out)
    theirs = is_detllm_folder(out) if kind == "diff" else is_diff_folder(out)
    if ours:
        return
    if theirs:
        what = "a run folder" if kind == "diff" else "a diff folder"
        raise UsageError(f"--out {str(out)!r} is {what}; writing there would destroy it", hint="choose another --out")
    if not force:
        raise UsageError(f"--out {str(out)!r} is not empty and is not a detllm {kind} folder", hint="choose another --out or pass --force")
    clash = [n for n in OWNED_NAMES if (out / n).exists() or (out / n).is_symlink()]
    if clash:
        raise UsageError(f"--out {str(out)!r} holds {clash[0]!r}, which detllm would overwrite", hint="choose another --out")


def check_output_file(path: Path | None, flag: str) -> None:
    """Refuse, before anything runs, an output file (--junit, --plot) that cannot be written."""
    if path is None:
        return
    if path.is_dir():
        raise UsageError(f"{flag} {str(path)!r} is a folder; give a file name")
    _check_writable_parent(path, flag)


def _check_writable_parent(path: Path, flag: str) -> None:
    anc = path.absolute().parent
    while not anc.exists():
        anc = anc.parent
    if not anc.is_dir():
        raise UsageError(f"{flag} {str(path)!r}: {str(anc)!r} is not a folder")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {str(path)!r}: cannot write under {str(anc)!r}")


def prepare_out_dir(out: Path, *, force: bool, kind: str = "run") -> Path:
    """Create `out`; in a folder detllm wrote earlier, first remove every file it left there, so no
    stale artifact survives. A --force folder keeps all its files (check_out_dir saw no clash)."""
    check_out_dir(out, force=force, kind=kind)
    ours = is_diff_folder(out) if kind == "diff" else is_detllm_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    mark_incomplete(out)  # before anything is cleared: a failure from here on leaves the folder marked
    if not ours:
        return out
    for name in (MANIFEST, "manifest.sig") + OWNED_NAMES + (TRACE + ".partial",):  # the seal first: no stale manifest
        if name == PARTIAL:
            continue
        p = out / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
    return out


# ---------------------------------------------------------------- loading


@dataclass
class RunFolder:
    """A loaded run folder; every file already validated against its schema."""

    path: Path
    env: dict[str, Any]
    run_config: dict[str, Any]
    applied: dict[str, Any]
    records: list[dict[str, Any]]
    report: dict[str, Any] | None
    extra: dict[str, Any] = field(default_factory=dict)


def read_json(path: Path, artifact_type: str) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
        obj = json.loads(text)
    except FileNotFoundError as exc:
        raise ArtifactError(f"{path}: missing", hint="is this a detllm run folder?") from exc
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{path}: not valid JSON ({exc})") from exc
    check_header(obj, artifact_type, str(path))
    # a small file is settled by schemalite as a write is (its True is final; anything else goes on to
    # jsonschema-rs and jsonschema): reading a folder's env, config and settings loads neither (~20 ms)
    validate(obj, artifact_type, where=str(path), size=len(text))
    return obj


def iter_trace(path: Path) -> Iterator[dict[str, Any]]:
    try:
        f = open(path, encoding="utf-8")
    except FileNotFoundError as exc:
        raise ArtifactError(f"{path}: missing", hint="the run may have been interrupted") from exc
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as exc:
                raise ArtifactError(f"{path} line {n}: not valid JSON") from exc
            check_header(rec, "trace_record", f"{path} line {n}")
            yield rec


def load_trace(path: Path, *, validate_records: bool = True) -> list[dict[str, Any]]:
    recs = list(iter_trace(path))
    if validate_records:
        for n, rec in enumerate(recs, 1):
            validate(rec, "trace_record", where=f"{path} line {n}")
    return recs


def load_run(path: Path, *, validate_records: bool = True) -> RunFolder:
    """Load and validate a run folder; ArtifactError names the first bad file. A .tar.gz pack is
    safely extracted (archive.py), read into memory, and its extracted copy removed."""
    from .archive import is_archive  # lazy: tarfile and gzip load when a run is read, not with every command

    path = Path(path)
    if is_archive(path):
        with open_run_path(path) as folder:
            run = load_run(folder, validate_records=validate_records)
        run.path = path  # everything is in memory; the extracted copy is gone
        return run
    check_complete(path)
    if not path.is_dir():
        raise ArtifactError(f"{str(path)!r} is not a folder", hint="pass a detllm run folder")
    if not (path / RUN_CONFIG).is_file():
        raise ArtifactError(f"{str(path)!r} is not a detllm run folder (no {RUN_CONFIG})")
    report = read_json(path / REPORT, "report") if (path / REPORT).is_file() else None
    return RunFolder(
        path=path,
        env=read_json(path / ENV, "env"),
        run_config=read_json(path / RUN_CONFIG, "run_config"),
        applied=read_json(path / APPLIED, "determinism_applied"),
        records=load_trace(path / TRACE, validate_records=validate_records),
        report=report,
    )


def iter_json_files(folder: Path) -> Iterable[tuple[str, str]]:
    """(relative name, artifact_type) of each JSON artifact present in `folder`."""
    for name, kind in JSON_FILES.items():
        if (folder / name).is_file():
            yield name, kind


def validate_folder(folder: Path) -> list[str]:
    """Validate every JSON artifact present and every trace line; returns the names checked."""
    folder = Path(folder)
    checked = []
    for name, kind in iter_json_files(folder):
        read_json(folder / name, kind)
        checked.append(name)
    if (folder / TRACE).is_file():
        load_trace(folder / TRACE)
        checked.append(TRACE)
    return checked


def open_run_path(path: str | Path) -> Any:
    """archive.open_run_path (a run folder as given, or a .tar.gz pack extracted for the block),
    imported when first used: a folder is given as it is without it (tarfile and gzip: ~14 ms)."""
    if Path(path).is_dir():
        return nullcontext(Path(path))
    from .archive import open_run_path as opened

    return opened(path)
