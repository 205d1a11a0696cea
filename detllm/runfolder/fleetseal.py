"""The fleet folder's seal: manifest.json over the fleet's own files (fleet.json, .txt, .md) and, for
each replica_<i>/ that is a sealed run folder, that folder's manifest.json (and manifest.sig), which
binds every replica file by digest; a replica that failed before it was sealed has its files listed
one by one. Owns what a fleet manifest lists and the byte check of a fleet folder (docs/fleet.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import schema_io
from .artifacts import MANIFEST, check_complete, mark_complete, mark_incomplete, read_json
from .env import detllm_version
from ..core.errors import ArtifactError, IntegrityError
from .integrity import SIG, UNSIGNED_NOTE, Seal, Verification, file_digest, walk

FLEET = "fleet.json"  # the fleet folder's report; fleet/folder.py writes it
_REPLICA = re.compile(r"^(replica_\d+)/(.+)$")


def _sealed_replicas(files: dict[str, Path]) -> set[str]:
    """The replica folders (names) that carry their own manifest.json on disk."""
    return {m.group(1) for rel in files if (m := _REPLICA.match(rel)) and m.group(2) == MANIFEST}


def _covered(rel: str, sealed: set[str]) -> bool:
    """Whether `rel` is inside a sealed replica (bound through its manifest, not listed itself)."""
    m = _REPLICA.match(rel)
    return m is not None and m.group(1) in sealed and m.group(2) not in (MANIFEST, SIG)


def seal_fleet(out: Path) -> dict[str, Any]:
    """Write the fleet folder's manifest.json last (the detllm.partial marker goes after it)."""
    out = Path(out)
    files, odd = walk(out)
    if odd:
        raise ArtifactError(f"{out}: {odd[0]} is not a regular file; a sealed folder holds regular files only")
    sealed = _sealed_replicas(files)
    entries = []
    for rel, p in sorted(files.items()):
        if not _covered(rel, sealed):
            sha, size = file_digest(p)
            entries.append({"path": rel, "sha256": sha, "size": size})
    manifest = schema_io.stamp("manifest", {"detllm_version": detllm_version(), "algorithm": "sha256",
                                            "files": entries, "trace": None})
    schema_io.write_json(out, MANIFEST, manifest)
    (out / SIG).unlink(missing_ok=True)
    mark_complete(out)
    return manifest


def begin_fleet(out: Path) -> None:
    """The fleet folder is incomplete until seal_fleet: an interrupted check leaves the marker."""
    mark_incomplete(Path(out))


def is_fleet_seal(seal: Seal) -> bool:
    return any(f["path"] == FLEET for f in seal.manifest["files"]) and (seal.folder / FLEET).is_file()


def verify_fleet(seal: Seal, verify_replica: Callable[[Path], Verification],
                 rederive: Callable[[Path], str]) -> Verification:
    """The fleet's own files against its manifest (IntegrityError, exit 6, naming the first changed
    one), fleet.json against its schema, then each sealed replica folder by `verify_replica`
    (verify_folder: its manifest, chain and re-derived verdict), then the fleet verdict by `rederive`
    (commands/fleetverify: from the replicas; handed in, as this layer sits below the verdict)."""
    folder, listed = seal.folder, {f["path"]: f for f in seal.manifest["files"]}
    if len(listed) != len(seal.manifest["files"]):
        raise ArtifactError(f"{MANIFEST}: lists a path twice")
    files, odd = walk(folder)
    if odd:
        raise IntegrityError(f"{odd[0]}: is a symlink or special file; a sealed folder holds regular files only")
    sealed = {m.group(1) for rel in listed if (m := _REPLICA.match(rel)) and m.group(2) == MANIFEST}
    problems = []
    for rel in sorted(set(listed) | {r for r in files if not _covered(r, sealed)}):
        if rel not in files:
            problems.append(f"{rel}: is listed in the manifest but missing (removed after sealing)")
        elif rel not in listed:
            problems.append(f"{rel}: is not in the manifest (added after sealing)")
        elif file_digest(files[rel]) != (listed[rel]["sha256"], listed[rel]["size"]):
            problems.append(f"{rel}: changed after sealing")
    if problems:
        more = f"; {len(problems) - 1} more problem(s)" if len(problems) > 1 else ""
        raise IntegrityError(problems[0], hint="the fleet folder changed after it was sealed" + more)
    read_json(folder / FLEET, "fleet")  # schema (exit 5)
    for name in sorted(sealed, key=lambda s: int(s.split("_")[1])):
        check_complete(folder / name)
        try:
            verify_replica(folder / name)
        except (IntegrityError, ArtifactError) as exc:
            raise type(exc)(f"{name}/{exc.message}", hint=exc.hint) from exc
    notes = [] if seal.signature == "verified" else [UNSIGNED_NOTE]
    verdict = (f"{len(sealed)} replica folder(s) verified (their files, chains and re-derived verdicts); "
               + rederive(folder))
    return Verification(folder, len(listed), None, None, seal.signature, seal.key_sha256, notes, verdict)


__all__ = ["begin_fleet", "is_fleet_seal", "seal_fleet", "verify_fleet"]
