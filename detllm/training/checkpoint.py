"""Training checkpoints: safetensors for the parameters and the optimizer's tensors, JSON for the
RNG state and everything else, a descriptor (checkpoint.json) naming each file by sha256. Nothing
is pickled. Loading reads each file's bytes once, checks them against the descriptor (and the
descriptor against the digest the pack holds) and only then parses them; a checkpoint without RNG
state is refused as not resumable. Does not own the pack's index of checkpoints (loop.py writes it).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..runfolder import schema_io
from ..core.errors import ArtifactError, IntegrityError
from .digest import CHAIN_1, chain_of, rng_digest, tensors_digest, torch_tensor_digest
from .rng import restore
from .task import Task

DESCRIPTOR = "checkpoint.json"
MODEL = "model.safetensors"
OPTIMIZER = "optimizer.safetensors"
RNG = "rng.json"
FILES = (MODEL, OPTIMIZER, RNG)


def boundary_dir(b: int) -> str:
    return f"boundary_{b:06d}"


def save_checkpoint(root: Path, b: int, task: Task, rng_state: dict[str, Any], *, seed: int, config_sha256: str,
                    params_sha256: str, commitment: str, chain: str) -> dict[str, Any]:
    """Write the state after b steps into root/boundary_<b>/ (a temporary folder renamed into place)
    and return its entry for checkpoints.json. The descriptor names the pack's chain version
    (none for detllm-train/1, as before it was recorded): its params_sha256 is that chain's H(θ)."""
    from safetensors.torch import save

    params = {n: p.detach().contiguous() for n, p in task.model.named_parameters()}
    opt, extra = optimizer_state(task)
    final = root / boundary_dir(b)
    tmp = root / (boundary_dir(b) + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    blobs = {MODEL: save(params), OPTIMIZER: save(opt)}
    for name, data in blobs.items():
        (tmp / name).write_bytes(data)
    schema_io.write_json(tmp, RNG, schema_io.stamp("train_rng_state", {"step": b, "state": rng_state}))
    files = [{"path": n, "sha256": hashlib.sha256((tmp / n).read_bytes()).hexdigest(), "size": (tmp / n).stat().st_size} for n in FILES]
    schema_io.write_json(tmp, DESCRIPTOR, schema_io.stamp("train_checkpoint", {
        "boundary": b, "seed": seed, "config_sha256": config_sha256, "params_sha256": params_sha256,
        "rng_sha256": rng_digest(rng_state).hex(), "commitment": commitment, "files": files,
        "extra": extra, **({} if chain == CHAIN_1 else {"chain": chain}),
    }))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return {"boundary": b, "dir": final.name, "descriptor_sha256": hashlib.sha256((final / DESCRIPTOR).read_bytes()).hexdigest(),
            "params_sha256": params_sha256, "commitment": commitment}


def optimizer_state(task: Task) -> tuple[dict[str, Any], dict[str, Any]]:
    """The optimizer's tensors by "<parameter>/<key>" and the JSON rest (param groups, scalar state,
    the scheduler's and the task's extra state), exactly as a checkpoint stores them."""
    names = {id(p): n for n, p in task.model.named_parameters()}
    opt: dict[str, Any] = {}
    scalars: dict[str, Any] = {}
    for p, state in task.optimizer.state.items():
        for k, v in state.items():
            key = f"{names[id(p)]}/{k}"
            if hasattr(v, "detach"):
                opt[key] = v.detach().contiguous()
            else:
                scalars[key] = v
    groups = [{k: v for k, v in g.items() if k != "params"} for g in task.optimizer.state_dict()["param_groups"]]
    extra: dict[str, Any] = {"param_groups": groups, "optimizer_scalars": scalars}
    if task.scheduler is not None:
        extra["scheduler"] = task.scheduler.state_dict()
    extra.update(task.extra)
    return opt, json.loads(schema_io.dumps(extra))


def optimizer_digest(tensors: dict[str, Any], extra: dict[str, Any]) -> str:
    """O = SHA256(H(the optimizer's named tensors) ‖ SHA256(the JSON rest, keys sorted)), hex: the
    optimizer state a re-run segment ends on, compared with the checkpoint at its stop boundary."""
    # P of detllm-train/1 (SHA-256) in every chain version: hashed at checkpoints only, where its cost is small
    h = tensors_digest((n, torch_tensor_digest(n, t, chain=CHAIN_1)) for n, t in sorted(tensors.items()))
    rest = hashlib.sha256(json.dumps(extra, sort_keys=True, separators=(",", ":")).encode("utf-8")).digest()
    return hashlib.sha256(h + rest).hexdigest()


@dataclass
class Checkpoint:
    """A checkpoint whose every byte matched its descriptor, parsed."""

    path: Path
    descriptor: dict[str, Any]
    params: dict[str, Any]  # name -> tensor
    optimizer: dict[str, Any]  # "<name>/<key>" -> tensor
    rng: dict[str, Any]  # rng.json's state

    @property
    def boundary(self) -> int:
        return self.descriptor["boundary"]


def _checked_bytes(folder: Path, entry: dict[str, Any]) -> bytes:
    where = f"{folder.name}/{entry['path']}"
    try:
        data = (folder / entry["path"]).read_bytes()
    except OSError as exc:
        raise IntegrityError(f"checkpoint {where}: cannot be read ({exc.strerror})", hint="the checkpoint is incomplete") from exc
    sha = hashlib.sha256(data).hexdigest()
    if (sha, len(data)) != (entry["sha256"], entry["size"]):
        raise IntegrityError(f"checkpoint {where}: sha256 {sha[:12]}…, {len(data)} bytes, is not its descriptor's "
                             f"{entry['sha256'][:12]}…, {entry['size']} bytes; refused before loading",
                             hint="the checkpoint changed after it was written")
    return data


def read_descriptor(folder: Path, descriptor_sha256: str | None = None) -> dict[str, Any]:
    """checkpoint.json, checked against the digest the pack's index holds (when given) and its schema."""
    folder = Path(folder)
    p = folder / DESCRIPTOR
    if not p.is_file():
        raise ArtifactError(f"{str(folder)!r} is not a detllm training checkpoint (no {DESCRIPTOR})")
    raw = p.read_bytes()
    if descriptor_sha256 is not None and hashlib.sha256(raw).hexdigest() != descriptor_sha256:
        raise IntegrityError(f"checkpoint {folder.name}/{DESCRIPTOR}: sha256 is not the one the pack's index holds "
                             f"({descriptor_sha256[:12]}…); refused before loading", hint="the checkpoint changed after it was written")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ArtifactError(f"checkpoint {folder.name}/{DESCRIPTOR}: not valid JSON") from exc
    schema_io.check_header(doc, "train_checkpoint", f"{folder.name}/{DESCRIPTOR}")
    schema_io.validate(doc, "train_checkpoint", where=f"{folder.name}/{DESCRIPTOR}")
    return doc


def load_checkpoint(folder: str | Path, descriptor_sha256: str | None = None) -> Checkpoint:
    """Every file's bytes checked against the descriptor before any is parsed; the RNG state
    required (a checkpoint without it cannot resume a run bit for bit); H(θ) of the loaded
    parameters checked against the descriptor's params_sha256."""
    from safetensors.torch import load

    folder = Path(folder)
    doc = read_descriptor(folder, descriptor_sha256)
    listed = {f["path"]: f for f in doc["files"]}
    if doc["rng_sha256"] is None or RNG not in listed:
        raise ArtifactError(f"checkpoint {folder.name} has no RNG state ({RNG}): not resumable, a restored run would draw "
                            f"other dropout masks and batches", hint="resume from a checkpoint detllm train-check wrote")
    missing = [n for n in (MODEL, OPTIMIZER) if n not in listed]
    if missing:
        raise ArtifactError(f"checkpoint {folder.name}: its descriptor lists no {missing[0]}")
    blobs = {n: _checked_bytes(folder, listed[n]) for n in FILES}  # all checked before any is parsed
    rng = json.loads(blobs[RNG])
    schema_io.check_header(rng, "train_rng_state", f"{folder.name}/{RNG}")
    schema_io.validate(rng, "train_rng_state", where=f"{folder.name}/{RNG}")
    if rng_digest(rng["state"]).hex() != doc["rng_sha256"]:
        raise IntegrityError(f"checkpoint {folder.name}/{RNG}: R is not the descriptor's rng_sha256")
    params, optimizer = load(blobs[MODEL]), load(blobs[OPTIMIZER])
    try:
        chain = chain_of(doc)
    except ValueError as exc:
        raise ArtifactError(f"checkpoint {folder.name}: {exc}") from exc
    found = tensors_digest((n, torch_tensor_digest(n, t, chain=chain)) for n, t in params.items())
    if found.hex() != doc["params_sha256"]:
        raise IntegrityError(f"checkpoint {folder.name}/{MODEL}: H(θ) {found.hex()[:12]}… is not the descriptor's "
                             f"params_sha256 {doc['params_sha256'][:12]}…")
    return Checkpoint(folder, doc, params, optimizer, rng["state"])


def apply_checkpoint(task: Task, ckpt: Checkpoint, data: Any) -> None:
    """Put the checkpoint's parameters, optimizer state and RNG state into the task and the
    process (`data`, the data-order generator, set in place)."""
    import torch

    named = dict(task.model.named_parameters())
    if set(named) != set(ckpt.params):
        extra = sorted(set(named) ^ set(ckpt.params))
        raise ArtifactError(f"checkpoint {ckpt.path.name}: its parameters are not the model's ({extra[0]} on one side only)")
    with torch.no_grad():
        for n, p in named.items():
            p.copy_(ckpt.params[n])
    names = {id(p): n for n, p in named.items()}
    sd = task.optimizer.state_dict()
    state: dict[int, dict[str, Any]] = {}
    index = 0
    for group in task.optimizer.param_groups:
        for p in group["params"]:
            prefix = names[id(p)] + "/"
            entry = {k[len(prefix):]: v for k, v in ckpt.optimizer.items() if k.startswith(prefix)}
            entry.update({k[len(prefix):]: v for k, v in ckpt.descriptor["extra"].get("optimizer_scalars", {}).items() if k.startswith(prefix)})
            if entry:
                state[index] = entry
            index += 1
    groups = ckpt.descriptor["extra"].get("param_groups", [])
    sd_groups = [{**g, **(groups[i] if i < len(groups) else {}), "params": g["params"]} for i, g in enumerate(sd["param_groups"])]
    for g in sd_groups:
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
    task.optimizer.load_state_dict({"state": state, "param_groups": sd_groups})
    if task.scheduler is not None and "scheduler" in ckpt.descriptor["extra"]:
        task.scheduler.load_state_dict(ckpt.descriptor["extra"]["scheduler"])
    restore(ckpt.rng, data)


__all__ = ["Checkpoint", "DESCRIPTOR", "FILES", "MODEL", "OPTIMIZER", "RNG", "apply_checkpoint", "boundary_dir", "load_checkpoint",
           "optimizer_digest", "optimizer_state", "read_descriptor", "save_checkpoint"]
