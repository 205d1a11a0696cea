"""`detllm pack`: verify a sealed run folder, then write exactly its sealed files to a
reproducible .tar.gz (the format itself is archive.py's). A changed folder, or one whose
report no longer follows from its trace, is never packed.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..runfolder.archive import ALLOWED_SUFFIXES, ARCHIVE_SUFFIXES, FAILED_REPLICA, is_archive, write_tar_gz
from ..core.errors import UsageError
from ..runfolder.fleetseal import FLEET
from ..runfolder.integrity import SEAL_FILES, walk
from .verify import verify_folder


def create_pack(run_dir: str | Path, dest: str | Path, *, force: bool = False, with_checkpoints: bool = False,
                checkpoints: str | Path | None = None) -> Path:
    """Verify `run_dir` against its manifest, then write exactly its sealed files to `dest`
    (.tar.gz, one top-level folder named after `dest`). A training pack's checkpoints go in
    (under checkpoints/, checked by digest) only `with_checkpoints`. Returns `dest`."""
    run_dir, dest = Path(run_dir), Path(dest)
    if not str(dest).lower().endswith(ARCHIVE_SUFFIXES):
        raise UsageError(f"-o {str(dest)!r} must end in .tar.gz or .tgz")
    if dest.exists() and not force:
        raise UsageError(f"-o {str(dest)!r} exists", hint="choose another name or pass --force")
    if is_archive(run_dir):
        raise UsageError(f"{str(run_dir)!r} is already a pack")
    if dest.resolve().is_relative_to(run_dir.resolve()):
        raise UsageError(f"-o {str(dest)!r} is inside the run folder (it would break its seal)", hint="write the pack elsewhere")
    from ..training.pack import is_training_pack, packed_checkpoints

    training = is_training_pack(run_dir)
    if (with_checkpoints or checkpoints is not None) and not training:
        raise UsageError("--with-checkpoints applies to a training pack (detllm train-check)")
    verify_folder(run_dir)  # never pack a folder that changed after sealing
    extra = packed_checkpoints(run_dir, checkpoints) if training and with_checkpoints else {}
    files, _ = walk(run_dir)
    names = sorted(files) + [n for n in SEAL_FILES if (run_dir / n).is_file()]
    failed = fleet_failures(run_dir)
    for rel in names:
        if rel.lower().endswith(ALLOWED_SUFFIXES) or (FAILED_REPLICA.match(rel) and rel.split("/")[0] in failed):
            continue  # a fleet's failed replica goes in as it was left, its detllm.partial marking it
        raise UsageError(f"{rel} in {str(run_dir)!r} is not a detllm artifact ({', '.join(ALLOWED_SUFFIXES)})",
                         hint="packs hold JSON and text only; move it out of the run folder and re-run")
    return write_tar_gz(run_dir, names, dest, extra)


def fleet_failures(folder: str | Path) -> dict[str, str]:
    """A fleet folder's replicas that failed (fleet.json: status error) by folder name, each with its
    error's kind and line; {} for any other folder. verify has checked fleet.json by then."""
    path = Path(folder) / FLEET
    if not path.is_file():
        return {}
    doc = json.loads(path.read_bytes())
    return {r["folder"]: f"{r['error']['kind']}: {r['error']['message']}" for r in doc.get("replicas", [])
            if r.get("status") == "error" and r.get("folder") and r.get("error")}


