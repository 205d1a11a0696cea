"""The seal of a folder of run folders (`diagnose --out`, `sweep --out`): manifest.json over the
folder's own files (its report, renderings, prompts, worker logs) and, for each sub-folder that is a
sealed run folder (baseline/, probes/<name>/, cells/cell-NN/), that folder's manifest.json (and
manifest.sig), which binds its files by digest. Owns what such a manifest lists and the byte check
of such a folder (the fleet folder's seal, fleetseal.py, is this one plus its replica rules); a run
folder's is integrity.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import schema_io
from .artifacts import MANIFEST, read_json
from .env import detllm_version
from ..core.errors import ArtifactError, IntegrityError
from .integrity import SIG, UNSIGNED_NOTE, Seal, Verification, file_digest, walk

NESTED = {"diagnosis.json": "diagnosis", "sweep.json": "sweep"}  # the folder's report -> its artifact_type


def _subfolders(paths: set[str]) -> set[str]:
    """The sub-folders (relative, '/'-separated) that carry their own manifest.json."""
    return {rel[: -len(MANIFEST) - 1] for rel in paths if rel.endswith("/" + MANIFEST)}


def _covered(rel: str, subs: set[str]) -> bool:
    """Whether `rel` is inside a sealed sub-folder (bound through its manifest, not listed itself)."""
    return any(rel.startswith(s + "/") and rel not in (f"{s}/{MANIFEST}", f"{s}/{SIG}") for s in subs)


def seal_nested(out: Path) -> dict[str, Any]:
    """Write the folder's manifest.json, last: its own files by digest, each sealed sub-folder through
    its manifest.json (and manifest.sig). The fleet folder's seal writes the same (fleetseal.py)."""
    out = Path(out)
    files, odd = walk(out)
    if odd:
        raise ArtifactError(f"{out}: {odd[0]} is not a regular file; a sealed folder holds regular files only")
    subs = _subfolders(set(files))
    entries = []
    for rel, p in sorted(files.items()):
        if not _covered(rel, subs):
            sha, size = file_digest(p)
            entries.append({"path": rel, "sha256": sha, "size": size})
    manifest = schema_io.stamp("manifest", {"detllm_version": detllm_version(), "algorithm": "sha256",
                                            "files": entries, "trace": None})
    schema_io.write_json(out, MANIFEST, manifest)
    (out / SIG).unlink(missing_ok=True)
    return manifest


def check_nested_bytes(seal: Seal, what: str = "the folder") -> set[str]:
    """The byte check of a folder sealed by seal_nested (or the fleet's seal): every file listed is there
    and unchanged, none was added, beside the sealed sub-folders (IntegrityError, exit 6, naming the
    first problem). Returns the sealed sub-folders, for the caller to verify one by one."""
    folder, listed = seal.folder, {f["path"]: f for f in seal.manifest["files"]}
    if len(listed) != len(seal.manifest["files"]):
        raise ArtifactError(f"{MANIFEST}: lists a path twice")
    files, odd = walk(folder)
    if odd:
        raise IntegrityError(f"{odd[0]}: is a symlink or special file; a sealed folder holds regular files only")
    subs = _subfolders(set(listed))
    problems = []
    for rel in sorted(set(listed) | {r for r in files if not _covered(r, subs)}):
        if rel not in files:
            problems.append(f"{rel}: is listed in the manifest but missing (removed after sealing)")
        elif rel not in listed:
            problems.append(f"{rel}: is not in the manifest (added after sealing)")
        elif file_digest(files[rel]) != (listed[rel]["sha256"], listed[rel]["size"]):
            problems.append(f"{rel}: changed after sealing")
    if problems:
        more = f"; {len(problems) - 1} more problem(s)" if len(problems) > 1 else ""
        raise IntegrityError(problems[0], hint=f"{what} changed after it was sealed" + more)
    return subs


def nested_kind(seal: Seal) -> str | None:
    """The report file of a sealed folder of run folders ("diagnosis.json", "sweep.json"), or None."""
    listed = {f["path"] for f in seal.manifest["files"]}
    return next((n for n in NESTED if n in listed and (seal.folder / n).is_file()), None)


def verify_nested(seal: Seal, verify_sub: Callable[[Path], Verification],
                  rederive: Callable[[Path], str]) -> Verification:
    """The folder's own files against its manifest (IntegrityError, exit 6, naming the first changed
    one), its report against its schema (exit 5), each sealed sub-folder by `verify_sub` (verify_folder:
    its manifest, chain and re-derived verdict), then the report by `rederive` (handed in from commands/)."""
    folder, subs = seal.folder, check_nested_bytes(seal)
    kind = nested_kind(seal)
    assert kind is not None
    read_json(folder / kind, NESTED[kind])  # schema (exit 5)
    for sub in sorted(subs):
        try:
            verify_sub(folder / sub)
        except (IntegrityError, ArtifactError) as exc:
            raise type(exc)(f"{sub}/{exc.message}", hint=exc.hint) from exc
    notes = [] if seal.signature == "verified" else [UNSIGNED_NOTE]
    verdict = f"{len(subs)} run folder(s) inside verified (their files, chains and re-derived verdicts); " + rederive(folder)
    return Verification(folder, len(seal.manifest["files"]), None, None, seal.signature, seal.key_sha256, notes, verdict)


__all__ = ["NESTED", "check_nested_bytes", "nested_kind", "seal_nested", "verify_nested"]
