"""`detllm verify`: a run folder or .tar.gz pack checked offline, its bytes (integrity.py: the
manifest, the trace's hash chain, schemas, the signature) and its verdict (rederive.py: report.json
re-derived from the sealed trace), the two at once on two cores for a large trace.

Owns the order of the checks: a changed byte is named before a verdict that no longer follows.
"""

from __future__ import annotations

from pathlib import Path

from ..runfolder.archive import open_run_path
from ..runfolder.integrity import Verification, check_bytes, open_seal
from ..pipeline.rederive import Ahead, rederive_verdict

__all__ = ["Verification", "verify", "verify_folder"]


def verify(path: str | Path, *, pubkey: str | Path | None = None, weights: str | Path | None = None) -> Verification:
    """Check a run folder or .tar.gz pack against its manifest, chain, schemas and (optionally)
    signature, then its verdict against its trace. Raises IntegrityError (exit 6) naming the first
    changed file or trace line, ArtifactError (exit 5) when it is not a pack or a file breaks its schema."""
    with open_run_path(Path(path)) as folder:
        result = verify_folder(folder, pubkey=pubkey, weights=weights)
    result.path = Path(path)
    return result


def verify_folder(folder: Path, *, pubkey: str | Path | None = None, weights: str | Path | None = None) -> Verification:
    """verify() of an unpacked folder, then its locate.json where one was written into it (locateverify.py)."""
    result = _verify_folder(folder, pubkey=pubkey, weights=weights)
    from .locateverify import rederive_locate

    located = rederive_locate(Path(folder))
    if located is not None:
        mine = result.verdict if not result.verdict.startswith("no report.json") else ""  # locate's own folder
        result.verdict = "; ".join(v for v in (mine, located) if v)
    return result


def _verify_folder(folder: Path, *, pubkey: str | Path | None = None, weights: str | Path | None = None) -> Verification:
    """verify_folder() without locate.json. `weights` (a training pack only): a safetensors file checked
    against the final commitment."""
    seal = open_seal(Path(folder), pubkey)
    from ..training.pack import is_training_pack, verify_training

    if is_training_pack(seal.folder):  # a training pack: its chain and report instead of a trace's (docs/training.md)
        return verify_training(seal, weights=weights)
    from ..runfolder.fleetseal import is_fleet_seal, verify_fleet

    if is_fleet_seal(seal) and weights is None:  # a fleet folder: its own files, then each replica folder (docs/fleet.md)
        from .fleetverify import rederive_fleet

        return verify_fleet(seal, verify_folder, rederive_fleet)
    from ..runfolder.nestseal import nested_kind, verify_nested

    if nested_kind(seal) is not None and weights is None:  # diagnose/sweep --out: its files, then each run folder inside
        from .nestverify import rederive_nested

        return verify_nested(seal, verify_folder, rederive_nested)
    if weights is not None:
        from ..core.errors import UsageError

        raise UsageError("--weights applies to a training pack (detllm train-check): a run pack commits no weights")
    from ..training.results import rederive_result, result_kind

    if seal.manifest["trace"] is None and result_kind(seal.folder) is not None:  # parity, train_diff, axes (training/results.py)
        result = check_bytes(seal)
        result.verdict = rederive_result(seal.folder) or ""
        return result
    # the verdict is re-derived on the other core while the bytes are checked; its answer is read
    # only once the bytes check out, so a changed file is still the first problem named
    from .diffverify import is_diff_folder, rederive_diff

    if seal.manifest["trace"] is None and is_diff_folder(seal.folder):  # diff --out: its verdict from its comparison
        result = check_bytes(seal)
        result.verdict = rederive_diff(seal.folder)
        return result
    ahead = Ahead.start(seal.folder) if seal.manifest["trace"] is not None else None
    try:
        result = check_bytes(seal)
        result.verdict = ahead.result() if ahead is not None else rederive_verdict(seal.folder)
        return result
    finally:
        if ahead is not None:
            ahead.close()
