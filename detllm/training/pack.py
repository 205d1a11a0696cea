"""A training pack as a repro pack: recognising one, `verify` of it offline and without torch
(the manifest seal, the chain of every steps file re-derived from its digests, train_report.json's
verdict re-derived from the steps files, every checkpoint found checked by digest down to H(θ)),
and where its checkpoints are. Does not own the chain's definition (chain.py) or loading a
checkpoint for training (checkpoint.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from .. import schema_io
from ..errors import IntegrityError
from ..integrity import Seal, Verification, check_bytes
from .chain import STEPS, TRAIN_CONFIG, ChainCheck, check_chain, read_records, safetensors_digest

CHECKPOINTS_INDEX = "checkpoints.json"
TRAIN_REPORT = "train_report.json"
PACKED_CHECKPOINTS = "checkpoints"  # `pack --with-checkpoints` puts them here, inside the pack, checked by digest
NOT_COMPARED = ("seconds", "run")  # the only fields two bitwise-equal step records may differ in


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


def records(path: Path) -> list[dict[str, Any]]:
    return [rec for _, rec in read_records(path)]


def first_difference(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """The first field (docs/training.md's order) in which two step records differ; None: bitwise equal."""
    if a["artifact_type"] == "train_genesis" or b["artifact_type"] == "train_genesis":
        for key, where in (("config_sha256", "config"), ("seed", "seed"), ("params_sha256", "params_init"), ("h", "genesis")):
            if a.get(key) != b.get(key):
                return where
        return None if _strip(a) == _strip(b) else "value"
    for key, where in (("rng_sha256", "rng"), ("batch_sha256", "batch"), ("samples", "batch"), ("grads_sha256", "grad"),
                       ("loss", "loss"), ("params_sha256", "value")):
        if a.get(key) != b.get(key):
            return where
    return None if _strip(a) == _strip(b) else "value"


def _strip(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in rec.items() if k not in NOT_COMPARED}


def first_divergent_step(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[int | None, str] | None:
    """(step, where) of the first record that differs (step None: the genesis), ("length") when one
    run holds fewer steps; None when every record is bitwise equal."""
    for ra, rb in zip(a, b):
        where = first_difference(ra, rb)
        if where is not None:
            return (ra.get("step"), where)
    if len(a) != len(b):
        return (min(len(a), len(b)) - 1, "length")
    return None


def rederive_report(folder: Path) -> str:
    """train_report.json's verdict and first divergent step re-derived from the steps files it
    names; IntegrityError when they do not follow."""
    report = json.loads((folder / TRAIN_REPORT).read_bytes())
    ref = records(folder / STEPS)
    equal = True
    for comp in report["comparisons"]:
        run = next((r for r in report["runs"] if r["run"] == comp["run"]), None)
        if run is None or not (folder / run["file"]).is_file():
            raise IntegrityError(f"{TRAIN_REPORT}: run {comp['run']} names no steps file in the pack")
        found = first_divergent_step(ref, records(folder / run["file"]))
        said = comp["first_divergence"]
        if (found is None) != comp["equal"] or (found is not None and said is not None and said["step"] != found[0]):
            at = "no difference" if found is None else f"a first difference at step {found[0]} ({found[1]})"
            raise IntegrityError(f"{TRAIN_REPORT}: run {comp['run']} is recorded as "
                                 f"{'equal' if comp['equal'] else 'different'}, but its steps file shows {at}",
                                 hint="the report does not follow from the sealed steps files")
        equal &= found is None
    if (report["verdict"] == "PASS") != equal:
        raise IntegrityError(f"{TRAIN_REPORT}: verdict {report['verdict']} does not follow from the steps files")
    return f"verdict {report['verdict']} re-derived from the {len(report['comparisons']) + 1} runs' steps files"


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
        h_params, _ = safetensors_digest(d / "model.safetensors")
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
    total = len(index["checkpoints"])
    if found == 0:
        return [f"checkpoints: none of {total} found (looked in {where}); not checked"]
    return [f"checkpoints: {found} of {total} checked by digest down to H(θ) ({where})"]


def verify_training(seal: Seal, *, checkpoints: str | Path | None = None, weights: str | Path | None = None) -> Verification:
    """verify() of a training pack: bytes and schemas (the manifest; a packed checkpoints/ folder
    is checked through its digests instead), the chain of every steps file, the report's verdict,
    the checkpoints found and, with `weights`, a safetensors file against the final commitment.
    Imports no torch."""
    folder = seal.folder
    result = check_bytes(seal, beside=PACKED_CHECKPOINTS)
    chain = check_chain(folder, weights=weights)
    verdict = rederive_report(folder) if (folder / TRAIN_REPORT).is_file() else ""
    notes = list(chain.lines())
    where = checkpoints_dir(folder, checkpoints)
    if (folder / CHECKPOINTS_INDEX).is_file():
        notes += check_checkpoints(folder, where, chain) if where is not None else ["checkpoints: not found beside the pack; not checked"]
    head = chain.runs[0]
    result.records = sum(r.steps + 1 for r in chain.runs)
    result.head = head.head
    result.verdict = verdict
    result.notes = notes + result.notes
    return result


__all__ = ["CHECKPOINTS_INDEX", "PACKED_CHECKPOINTS", "TRAIN_REPORT", "check_checkpoints", "checkpoints_dir", "first_difference",
           "first_divergent_step", "is_training_pack", "records", "rederive_report", "verify_training"]
