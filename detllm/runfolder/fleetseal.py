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

from .artifacts import MANIFEST, check_complete, mark_complete, mark_incomplete, read_json
from ..core.errors import ArtifactError, IntegrityError
from .integrity import UNSIGNED_NOTE, Seal, Verification
from .nestseal import check_nested_bytes, seal_nested

FLEET = "fleet.json"  # the fleet folder's report; fleet/folder.py writes it
_REPLICA_DIR = re.compile(r"replica_\d+")


def seal_fleet(out: Path) -> dict[str, Any]:
    """Write the fleet folder's manifest.json last (the detllm.partial marker goes after it): the seal of
    a folder of run folders (nestseal.py), each sealed replica bound through its own manifest."""
    manifest = seal_nested(out)
    mark_complete(Path(out))
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
    folder = seal.folder
    sealed = check_nested_bytes(seal, "the fleet folder")
    if odd := sorted(s for s in sealed if not _REPLICA_DIR.fullmatch(s)):
        raise IntegrityError(f"{odd[0]}/{MANIFEST}: a fleet folder holds sealed folders replica_<i>/ only")
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
    return Verification(folder, len(seal.manifest["files"]), None, None, seal.signature, seal.key_sha256, notes, verdict)


__all__ = ["begin_fleet", "is_fleet_seal", "seal_fleet", "verify_fleet"]
