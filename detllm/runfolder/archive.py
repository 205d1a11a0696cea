"""The .tar.gz format of a repro pack, both ways: write a folder's files reproducibly, and
extract a pack without trusting it.

Writing is reproducible (sorted members, zeroed times and owners, no gzip timestamp); what
goes in (a verified, sealed folder) is pack.py's decision. Extraction refuses absolute paths, `..`, links, devices,
fifos, duplicate names, files that are not JSON/text artifacts, oversize members or totals
and too many members, and writes only regular files into a fresh temporary folder.
Nothing from a pack is ever executed or unpickled: callers read its JSON.
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import tarfile
import tempfile
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Iterator

from ..core.errors import ArtifactError, IntegrityError
from .schema_io import _UMASK

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz")
# What a run folder holds: JSON, JSON lines, rendered text, the signature, plots, and a training
# pack's checkpoints when packed (.safetensors: tensor data, no code; each file is checked against
# its digest before it is read). Anything else (.pkl, .py, .so, ...) is refused at extraction,
# so it can never reach a loader.
ALLOWED_SUFFIXES = (".json", ".jsonl", ".txt", ".md", ".html", ".log", ".sig", ".png", ".svg", ".safetensors")
# A fleet folder's replica that failed mid-run is packed as it was left (docs/fleet.md): its marker
# (one line of text) and its unfinished trace (JSON lines), under replica_<i>/ only
FAILED_REPLICA = re.compile(r"^replica_\d+/(detllm\.partial|trace\.jsonl\.partial)$")
_CHUNK = 1 << 20  # 1 MiB copies
_DRIVE = re.compile(r"^[A-Za-z]:")


@dataclass(frozen=True)
class Limits:
    """Extraction ceilings (docs/integrity.md). A run folder holds about ten files; a 1M-step
    trace (1,000 prompts x 1,000 tokens, top-5) is ~120 MB. Checked on the raw tar headers
    before `tarfile` reads anything, so no header or gzip stream can make it read more."""

    max_members: int = 1_000  # files and folders
    max_member_bytes: int = 1 << 30  # 1 GiB per file
    max_total_bytes: int = 2 << 30  # 2 GiB of member data in all
    max_depth: int = 8  # path components
    max_header_bytes: int = 4 << 10  # a PAX extended header or GNU long name/link: 4 KiB (tarfile reads them whole)


def is_archive(path: str | Path) -> bool:
    return str(path).lower().endswith(ARCHIVE_SUFFIXES) and Path(path).is_file()


@contextmanager
def open_run_path(path: str | Path) -> Iterator[Path]:
    """A run folder as given, or a .tar.gz pack safely extracted to a temporary folder that is
    removed when the block ends."""
    if is_archive(path):
        with extracted(path) as folder:
            yield folder
    else:
        yield Path(path)


# ---------------------------------------------------------------- write


def write_tar_gz(run_dir: Path, names: list[str], dest: Path, extra: dict[str, Path] | None = None) -> Path:
    """Write `names` (paths relative to `run_dir`) into `dest` under one top-level folder named
    after `dest`, atomically (a temporary name, then a rename). `extra`: more files, by the
    relative path they get in the archive. Returns `dest`."""
    root = _root_name(dest)
    sources = {rel: run_dir / rel for rel in names} | dict(extra or {})
    names = list(sources)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; a pack is shared (CI caches, other users) like any file asked for
        with os.fdopen(fd, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6) as gz, \
                tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for d in sorted({""} | {str(PurePosixPath(n).parent) for n in names} - {"."}):
                tar.addfile(_info(f"{root}/{d}".rstrip("/"), tarfile.DIRTYPE, 0, 0o755))
            for rel in sorted(names):
                p = sources[rel]
                with open(p, "rb") as f:
                    tar.addfile(_info(f"{root}/{rel}", tarfile.REGTYPE, os.fstat(f.fileno()).st_size, 0o644), f)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest


def _root_name(dest: Path) -> str:
    name = dest.name
    for suf in ARCHIVE_SUFFIXES:
        if name.lower().endswith(suf):
            name = name[: -len(suf)]
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).strip(".") or "detllm-pack"


def _info(name: str, kind: bytes, size: int, mode: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.size, ti.mode, ti.mtime = kind, size, mode, 0
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


# ---------------------------------------------------------------- extract


@contextmanager
def extracted(archive: str | Path, limits: Limits = Limits()) -> Iterator[Path]:
    """Extract `archive` into a new temporary folder; yield the run folder inside; remove it all on exit."""
    tmp = Path(tempfile.mkdtemp(prefix="detllm-pack-"))
    try:
        yield extract(archive, tmp, limits)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def extract(archive: str | Path, dest: Path, limits: Limits = Limits()) -> Path:
    """Safely extract into the empty folder `dest`; returns the run folder (dest or its one subfolder)."""
    archive = Path(archive)
    try:
        # the scan bounds what tarfile will read, before it reads anything; it keeps the stream it
        # decompressed, so tarfile reads a plain tar and the pack is decompressed once, not twice
        with tempfile.TemporaryFile() as plain:
            scan_headers(archive, limits, copy=plain)
            plain.seek(0)
            with tarfile.open(fileobj=plain, mode="r:") as tar:
                _extract_members(tar, dest, limits, archive.name)
    except (tarfile.TarError, gzip.BadGzipFile, zlib.error, EOFError, *_inflate_errors()) as exc:
        raise ArtifactError(f"{str(archive)!r} is not a readable .tar.gz pack ({exc.__class__.__name__}: {str(exc)[:120]})") from exc
    except OSError as exc:
        raise ArtifactError(f"{str(archive)!r} cannot be read ({exc.__class__.__name__})") from exc
    entries = [p for p in dest.iterdir()]
    if len(entries) == 1 and entries[0].is_dir():
        return entries[0]
    return dest


_META_TYPES = {b"x": "a PAX extended header", b"g": "a PAX global header", b"L": "a GNU long name", b"K": "a GNU long link name"}
_BLOCK = 512


def scan_headers(archive: Path, limits: Limits, copy: IO[bytes] | None = None) -> None:
    """Walk the raw 512-byte tar headers of the decompressed stream without tarfile: refuse
    (IntegrityError) a PAX/GNU metadata member over max_header_bytes, a member over
    max_member_bytes, more than max_members headers, or a stream that decompresses to more
    than the member limits allow (a gzip bomb). Reads the stream once, in 1 MiB chunks;
    `copy` receives every decompressed byte read (within those bounds)."""
    write = copy.write if copy is not None else (lambda b: None)
    label = archive.name
    cap = limits.max_total_bytes + (2 * limits.max_members + 2) * _BLOCK + limits.max_members * limits.max_header_bytes
    read = headers = 0
    with _open_gzip(archive) as gz:
        while True:
            block = gz.read(_BLOCK)
            write(block)
            if len(block) < _BLOCK or block == b"\0" * _BLOCK:
                return  # end of archive (or a truncated one: tarfile names it)
            headers += 1
            if headers > 2 * limits.max_members + 1:  # every member may carry one metadata header
                raise IntegrityError(f"{label}: more than {limits.max_members} members; refusing to extract")
            try:
                size = tarfile.nti(block[124:136])
            except tarfile.TarError as exc:
                raise ArtifactError(f"{label}: header {headers} is not a tar header ({exc})") from exc
            kind = block[156:157]
            if size < 0:
                raise IntegrityError(f"{label}: header {headers} declares a negative size")
            if kind in _META_TYPES and size > limits.max_header_bytes:
                raise IntegrityError(f"{label}: {_META_TYPES[kind]} of {size} bytes (over the {limits.max_header_bytes}-byte "
                                     f"limit); refusing to extract")
            if size > limits.max_member_bytes and kind not in _META_TYPES:
                name = block[:100].split(b"\0", 1)[0].decode("utf-8", "replace")
                raise IntegrityError(f"{label}: member {name!r} is {size} bytes, over the {limits.max_member_bytes}-byte limit")
            padded = -(-size // _BLOCK) * _BLOCK
            read += _BLOCK + padded
            if read > cap:
                raise IntegrityError(f"{label}: decompresses to more than {cap} bytes; refusing to extract")
            while padded > 0:  # skip the data, in bounded chunks
                chunk = gz.read(min(_CHUNK, padded))
                if not chunk:
                    return
                write(chunk)
                padded -= len(chunk)


def _open_gzip(archive: Path) -> IO[bytes]:
    """The decompressed stream of `archive`: ISA-L's igzip when it is installed (the `isal`
    dependency: it inflates ~3x faster than zlib, the bulk of reading a pack), else gzip."""
    try:
        from isal import igzip
    except ImportError:
        return gzip.open(archive, "rb")
    return igzip.open(archive, "rb")


def _inflate_errors() -> tuple[type[BaseException], ...]:
    """What igzip raises for a corrupt deflate stream (zlib raises zlib.error)."""
    try:
        from isal.isal_zlib import error
    except ImportError:
        return ()
    return (error,)


def _extract_members(tar: tarfile.TarFile, dest: Path, limits: Limits, label: str) -> None:
    seen: set[str] = set()
    total = 0
    for count, member in enumerate(_members(tar), 1):
        if count > limits.max_members:
            raise IntegrityError(f"{label}: more than {limits.max_members} members; refusing to extract")
        parts = _safe_parts(member.name, label)
        key = "/".join(parts).lower()  # case-insensitive: two names must not land on one file
        if key in seen:
            raise IntegrityError(f"{label}: member {member.name!r} appears twice; refusing to extract")
        seen.add(key)
        if len(parts) > limits.max_depth:
            raise IntegrityError(f"{label}: member {member.name!r} is nested deeper than {limits.max_depth} folders")
        if member.isdir():
            dest.joinpath(*parts).mkdir(parents=True, exist_ok=True)
            continue
        if not member.isreg() or member.issparse():
            kind = "a symlink" if member.issym() else "a hard link" if member.islnk() else \
                "a fifo" if member.isfifo() else "a device" if member.isdev() else "a special file"
            raise IntegrityError(f"{label}: member {member.name!r} is {kind}; a pack holds regular files only")
        if not parts[-1].lower().endswith(ALLOWED_SUFFIXES) and not FAILED_REPLICA.match("/".join(parts[-2:])):
            raise IntegrityError(f"{label}: member {member.name!r} is not a detllm artifact; packs hold only "
                                 f"{', '.join(ALLOWED_SUFFIXES)} files and nothing in them is ever executed or unpickled")
        if member.size > limits.max_member_bytes:
            raise IntegrityError(f"{label}: member {member.name!r} is {member.size} bytes, over the {limits.max_member_bytes}-byte limit")
        total += member.size
        if total > limits.max_total_bytes:
            raise IntegrityError(f"{label}: members add up to more than {limits.max_total_bytes} bytes; refusing to extract")
        _write_member(tar, member, dest.joinpath(*parts))


def _members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """Members one at a time (never getmembers(): a crafted archive may hold millions of headers)."""
    while (member := tar.next()) is not None:
        yield member


def _safe_parts(name: str, label: str) -> list[str]:
    if not name or "\x00" in name or "\\" in name or name.startswith("/") or _DRIVE.match(name):
        raise IntegrityError(f"{label}: member {name!r} has an absolute or unsafe path; refusing to extract")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise IntegrityError(f"{label}: member {name!r} leaves the pack ('..'); refusing to extract")
    return parts


def _write_member(tar: tarfile.TarFile, member: tarfile.TarInfo, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    src = tar.extractfile(member)
    if src is None:
        raise IntegrityError(f"member {member.name!r} has no data")
    # O_EXCL + O_NOFOLLOW: never overwrite, never write through a link (there are none: we made every folder)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as out, src:
        done = _copy_in_kernel(tar, member, fd)
        src.seek(done)
        left = member.size - done
        while left > 0:  # what the kernel did not copy (none, where the plain tar is a real file)
            chunk = src.read(min(_CHUNK, left))
            if not chunk:
                raise ArtifactError(f"member {member.name!r} is truncated")
            out.write(chunk)
            left -= len(chunk)


def _copy_in_kernel(tar: tarfile.TarFile, member: tarfile.TarInfo, dst: int) -> int:
    """Copy the member's bytes from the plain tar into `dst` with os.copy_file_range (no trip
    through Python; a regular, non-sparse member's data is one run of the file); returns how
    many bytes were copied: all of them, or fewer where the file ends early or the call is
    not supported (the caller reads the rest, and names a truncated member as before)."""
    copy = getattr(os, "copy_file_range", None)
    try:
        src = tar.fileobj.fileno()
    except (AttributeError, OSError, ValueError):
        return 0
    done = 0
    while copy is not None and done < member.size:
        try:
            n = copy(src, dst, member.size - done, member.offset_data + done)
        except OSError:  # EXDEV, ENOSYS, EINVAL (an older kernel or another filesystem)
            break
        if n <= 0:
            break
        done += n
    return done
