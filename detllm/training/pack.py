"""A training pack as a repro pack: recognising one, `verify` of it offline and without torch
(the manifest seal, the chain of every steps file re-derived from its digests, train_report.json's
verdict re-derived from the steps files, every checkpoint found checked by digest down to H(θ)),
and where its checkpoints are. Does not own the chain's definition (chain.py) or loading a
checkpoint for training (checkpoint.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..runfolder import schema_io
from ..core.errors import EXIT_FAIL, EXIT_PASS, IntegrityError, UsageError
from ..runfolder.integrity import Seal, Verification, check_bytes, open_seal
from .rederive import TRAIN_REPORT, rederive_report
from .digest import rng_digest
from .trainrun import is_train_run, rederive_recorded
from .chain import STEPS, TRAIN_CONFIG, ChainCheck, check_chain, read_records, safetensors_digest

CHECKPOINTS_INDEX = "checkpoints.json"
PACKED_CHECKPOINTS = "checkpoints"  # `pack --with-checkpoints` puts them here, inside the pack, checked by digest


@dataclass
class TrainingOutcome:
    """What a command on training packs (replay, diff) returns: its document, folder and text."""

    doc: dict[str, Any]
    out_dir: Path | None
    text: str

    @property
    def exit_code(self) -> int:
        return EXIT_PASS if self.doc["verdict"] == "PASS" else EXIT_FAIL


@dataclass
class TrainingVerification(Verification):
    """verify's result for a training pack: `records` counts step records (genesis included)."""

    def lines(self) -> list[str]:
        key = f" by key sha256 {self.key_sha256[:16]}…" if self.key_sha256 else ""
        head = f" (run 0 head {self.head[:16]}…)" if self.head else ""
        return [f"verified training pack {self.path}: {self.files} files unchanged, {self.records} step records chained{head}; "
                f"signature {self.signature}{key}"] + ([self.verdict] if self.verdict else []) + [f"note: {n}" for n in self.notes]


def is_training_pack(folder: Path) -> bool:
    """A folder (or extracted pack) train-check wrote: train_config.json says so."""
    p = Path(folder) / TRAIN_CONFIG
    if not p.is_file():
        return False
    try:
        return json.loads(p.read_bytes()).get("artifact_type") == "train_config"
    except (OSError, ValueError, AttributeError):
        return False


def checkpoints_dir(folder: Path, given: str | Path | None = None) -> Path | None:
    """Where the pack's checkpoints are: `given`, else packed inside (`checkpoints/`), else beside
    the pack where train-check wrote them (checkpoints.json's `location`); None when none is found."""
    if given is not None:
        return Path(given)
    if (folder / PACKED_CHECKPOINTS).is_dir():
        return folder / PACKED_CHECKPOINTS
    index = folder / CHECKPOINTS_INDEX
    if index.is_file():
        loc = (folder / json.loads(index.read_bytes())["location"]).resolve()
        if loc.is_dir():
            return loc
    return None


def packed_checkpoints(folder: Path, given: str | Path | None = None) -> dict[str, Path]:
    """`pack --with-checkpoints`: every file of every checkpoints.json entry, by its path in the
    archive (checkpoints/<boundary dir>/<file>); each is checked by digest first (verify does)."""
    where = checkpoints_dir(folder, given)
    if where is None or not (folder / CHECKPOINTS_INDEX).is_file():
        raise UsageError("--with-checkpoints: this training pack's checkpoints are not found",
                         hint="pass --checkpoints DIR (train-check writes them beside the pack, in OUT.checkpoints)")
    index = json.loads((folder / CHECKPOINTS_INDEX).read_bytes())
    verification = verify_training(open_seal(folder), checkpoints=where)
    if not any(n.startswith("checkpoints: ") and " checked by digest" in n for n in verification.notes):
        raise UsageError(f"--with-checkpoints: no checkpoint of this pack is in {str(where)!r}")
    out: dict[str, Path] = {}
    for cp in index["checkpoints"]:
        d = where / cp["dir"]
        if not d.is_dir():
            raise UsageError(f"--with-checkpoints: checkpoint {cp['dir']} is missing from {str(where)!r}")
        for name in ("checkpoint.json", *(f["path"] for f in json.loads((d / "checkpoint.json").read_bytes())["files"])):
            out[f"{PACKED_CHECKPOINTS}/{cp['dir']}/{name}"] = d / name
    return out


def records(path: Path) -> list[dict[str, Any]]:
    return [rec for _, rec in read_records(path)]


def check_checkpoints(folder: Path, where: Path, chain: ChainCheck) -> list[str]:
    """Every checkpoint of checkpoints.json found under `where`: descriptor sha256, every file's
    sha256 and size, H(θ) of model.safetensors, and their place in the reference run's chain
    (params and commitment at its boundary, R_b of step b). Without torch."""
    index = json.loads((folder / CHECKPOINTS_INDEX).read_bytes())
    ref = records(folder / STEPS)
    found = 0
    for cp in index["checkpoints"]:
        b, d = cp["boundary"], where / cp["dir"]
        if not d.is_dir():
            continue
        desc_path = d / "checkpoint.json"
        raw = desc_path.read_bytes() if desc_path.is_file() else b""
        if hashlib.sha256(raw).hexdigest() != cp["descriptor_sha256"]:
            raise IntegrityError(f"{cp['dir']}/checkpoint.json does not match its sha256 in {CHECKPOINTS_INDEX}")
        desc = json.loads(raw)
        schema_io.validate(desc, "train_checkpoint", where=f"{cp['dir']}/checkpoint.json")
        for f in desc["files"]:
            p = d / f["path"]
            data = p.read_bytes() if p.is_file() else None
            if data is None or len(data) != f["size"] or hashlib.sha256(data).hexdigest() != f["sha256"]:
                raise IntegrityError(f"{cp['dir']}/{f['path']} is missing or changed (sha256 or size differs from checkpoint.json)",
                                     hint="a checkpoint is refused before it is loaded")
        _check_rng_file(d, desc, b)
        h_params, _ = safetensors_digest(d / "model.safetensors", chain.chain)
        # ref[0] is the genesis, ref[b] step b-1: boundary b holds θ and h after step b-1
        want_params = (ref[0] if b == 0 else ref[b])["params_sha256"]
        want_commit = (ref[0] if b == 0 else ref[b])["h"]
        if h_params.hex() != desc["params_sha256"] or desc["params_sha256"] != want_params or cp["params_sha256"] != want_params:
            raise IntegrityError(f"{cp['dir']}/model.safetensors: H(θ) {h_params.hex()[:16]}… is not the committed "
                                 f"H(θ) at boundary {b} ({want_params[:16]}…)")
        if desc["commitment"] != want_commit or cp["commitment"] != want_commit:
            raise IntegrityError(f"{cp['dir']}: commitment is not h_{b - 1} of {STEPS}")
        step_b = ref[b + 1] if b + 1 < len(ref) else None
        if step_b is not None and desc["rng_sha256"] is not None and desc["rng_sha256"] != step_b["rng_sha256"]:
            raise IntegrityError(f"{cp['dir']}: rng_sha256 is not R_{b} recorded in {STEPS}")
        found += 1
    if where == folder / PACKED_CHECKPOINTS:  # inside the pack, outside the manifest: nothing unreferenced may ride along
        listed = {f"{cp['dir']}/{name}" for cp in index["checkpoints"] for name in ("checkpoint.json", "model.safetensors",
                                                                                  "optimizer.safetensors", "rng.json")}
        stray = sorted(p.relative_to(where).as_posix() for p in where.rglob("*") if not p.is_dir() and
                       p.relative_to(where).as_posix() not in listed)
        if stray:
            raise IntegrityError(f"{PACKED_CHECKPOINTS}/{stray[0]} is not a file of a checkpoint {CHECKPOINTS_INDEX} names",
                                 hint="the pack changed after it was packed")
    total = len(index["checkpoints"])
    if found == 0:
        return [f"checkpoints: none of {total} found (looked in {where}); not checked"]
    return [f"checkpoints: {found} of {total} checked by digest down to H(θ) and R ({where})", OPTIMIZER_NOTE]


OPTIMIZER_NOTE = ("checkpoints: the optimizer state (optimizer.safetensors, the descriptor's extra) is checked against its "
                  "descriptor only: nothing in the chain binds it; replay --sample checks it where a re-run segment ends")


def _check_rng_file(d: Path, desc: dict[str, Any], b: int) -> None:
    """rng.json (its bytes already checked against the descriptor): R = SHA256(JCS(state)) recomputed
    from the file, without torch, and equal to the descriptor's rng_sha256; its step is b."""
    if not any(f["path"] == "rng.json" for f in desc["files"]):
        return  # not resumable: load_checkpoint refuses it; nothing here claims R
    doc = json.loads((d / "rng.json").read_bytes())
    schema_io.validate(doc, "train_rng_state", where=f"{d.name}/rng.json")
    if rng_digest(doc["state"]).hex() != desc["rng_sha256"] or doc["step"] != b:
        raise IntegrityError(f"{d.name}/rng.json: R = SHA256(JCS(state)) of the file is not the descriptor's rng_sha256"
                             if doc["step"] == b else f"{d.name}/rng.json: its step {doc['step']} is not boundary {b}",
                             hint="a checkpoint is refused before it is loaded")


def verify_training(seal: Seal, *, checkpoints: str | Path | None = None, weights: str | Path | None = None) -> Verification:
    """verify() of a training pack: bytes and schemas (the manifest; a packed checkpoints/ folder
    is checked through its digests instead), the chain of every steps file, the report's verdict,
    the checkpoints found and, with `weights`, a safetensors file against the final commitment.
    Imports no torch."""
    folder = seal.folder
    result = check_bytes(seal, beside=PACKED_CHECKPOINTS)
    chain = check_chain(folder, weights=weights)
    if is_train_run(folder):  # one run alone: RECORDED, nothing to compare (trainrun.py)
        verdict = rederive_recorded(folder, json.loads((folder / TRAIN_REPORT).read_bytes()), chain.runs[0].head)
    else:
        verdict = rederive_report(folder, chain) if (folder / TRAIN_REPORT).is_file() else ""
    notes = list(chain.lines())
    where = checkpoints_dir(folder, checkpoints)
    if (folder / PACKED_CHECKPOINTS).exists() and not (folder / CHECKPOINTS_INDEX).is_file():
        raise IntegrityError(f"{PACKED_CHECKPOINTS}/ is in the pack but no {CHECKPOINTS_INDEX} names its files",
                             hint="files outside the manifest are accepted only as checkpoints the sealed index names")
    if (folder / CHECKPOINTS_INDEX).is_file():
        notes += check_checkpoints(folder, where, chain) if where is not None else ["checkpoints: not found beside the pack; not checked"]
    return TrainingVerification(result.path, result.files, sum(r.steps + 1 for r in chain.runs), chain.runs[0].head,
                                result.signature, result.key_sha256, notes + result.notes, verdict)


__all__ = ["CHECKPOINTS_INDEX", "PACKED_CHECKPOINTS", "TRAIN_REPORT", "TrainingOutcome", "check_checkpoints", "checkpoints_dir", "is_training_pack", "records", "rederive_report", "verify_training"]
