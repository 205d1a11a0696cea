"""The training chain: h_genesis and h_t from their inputs, and the offline check of a training
pack's steps files against train_config.json (every recorded digest re-derived, every link
re-computed) and of a weights file against the final commitment. Reads bytes and JSON only,
never torch: `detllm verify` calls check_chain. Does not own the digests' definitions (digest.py)
or the checkpoints' (checkpoint.py).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..runfolder import schema_io
from ..core.errors import ArtifactError, IntegrityError
from .digest import chain_of, config_digest, le64, none_digest, tensor_digest_bytes, tensors_digest

TRAIN_CONFIG = "train_config.json"
STEPS = "steps.jsonl"
REPEATS = "repeats"
_MAX_HEADER = 100 << 20  # a safetensors header past 100 MiB is not one


def genesis(params_sha256: bytes, config_sha256: bytes, seed: int) -> bytes:
    """h_genesis = SHA256(H(θ_init) ‖ H(config) ‖ LE64(seed))."""
    return hashlib.sha256(params_sha256 + config_sha256 + le64(seed)).digest()


def link(prev: bytes, params_sha256: bytes, batch_sha256: bytes, t: int) -> bytes:
    """h_t = SHA256(h_{t-1} ‖ H(θ_t) ‖ H(B_t) ‖ LE64(t))."""
    return hashlib.sha256(prev + params_sha256 + batch_sha256 + le64(t)).digest()


def read_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) of a steps file, each validated against its artifact_type's schema."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
            except ValueError as exc:
                raise ArtifactError(f"{path.name} line {n}: not valid JSON") from exc
            kind = rec.get("artifact_type") if isinstance(rec, dict) else None
            if kind not in ("train_genesis", "train_step"):
                raise ArtifactError(f"{path.name} line {n}: artifact_type {kind!r} is not train_genesis or train_step")
            schema_io.check_header(rec, kind, f"{path.name} line {n}")
            schema_io.validate(rec, kind, where=f"{path.name} line {n}")
            yield n, rec


def steps_files(folder: Path) -> list[Path]:
    """steps.jsonl, then repeats/run_<r>.jsonl by r."""
    reps = sorted((folder / REPEATS).glob("run_*.jsonl"), key=lambda p: int(p.stem.removeprefix("run_") or 0)) \
        if (folder / REPEATS).is_dir() else []
    return [folder / STEPS] + reps


@dataclass
class RunChain:
    """One steps file whose chain checked out."""

    file: str
    run: int
    seed: int
    steps: int
    genesis: str
    head: str  # h_{K-1} (the genesis when no step)
    final_params: str | None  # H(θ_{K-1}) hex
    final_tensors: dict[str, str] = field(default_factory=dict)  # name -> P hex of θ_{K-1}


@dataclass
class ChainCheck:
    """What check_chain checked, when everything matched."""

    config_sha256: str
    runs: list[RunChain]
    weights: str | None = None  # "matched: <file>" when a weights file was checked
    chain: str = "detllm-train/1"  # the chain version train_config.json names (digest.chain_of)

    def lines(self) -> list[str]:
        out = [f"chain: {r.file}: genesis and {r.steps} steps re-derived (head {r.head[:16]}…)" for r in self.runs]
        return out + ([f"weights: {self.weights}"] if self.weights else [])


def _bad(where: str, what: str) -> IntegrityError:
    return IntegrityError(f"{where}: {what}", hint="the training record does not follow from its own digests")


def _set_digest(tensors: dict[str, Any], key: str, where: str, chain: str) -> bytes:
    pairs = []
    for name, t in tensors.items():
        hexd = t[key]
        if hexd is None and key == "grad_sha256":
            pairs.append((name, none_digest(name, chain=chain)))
        else:
            pairs.append((name, bytes.fromhex(hexd)))
    return tensors_digest(pairs)


def check_run(path: Path, config: dict[str, Any], config_sha: bytes) -> RunChain:
    """Re-derive one steps file: genesis from H(θ_init) (itself from the per-parameter digests),
    H(config) and the seed; each step's H(θ_t), H(∇_t) from its per-parameter digests and h_t from
    h_{t-1}. Raises IntegrityError naming the first line that does not follow."""
    rel = path.name if path.parent.name != REPEATS else f"{REPEATS}/{path.name}"
    records = read_records(path)
    first = next(records, None)
    if first is None or first[1]["artifact_type"] != "train_genesis":
        raise ArtifactError(f"{rel}: line 1 is not a train_genesis record")
    _, g = first
    run, seed = g["run"], g["seed"]
    expected_seed = config["seed"]
    rs = config.get("test_options", {}).get("repeat_seed")
    if rs and rs["run"] == run:
        expected_seed = rs["seed"]
    if seed != expected_seed:
        raise _bad(f"{rel} line 1", f"seed {seed} is not the seed {expected_seed} {TRAIN_CONFIG} gives run {run}")
    if bytes.fromhex(g["config_sha256"]) != config_sha:
        raise _bad(f"{rel} line 1", f"config_sha256 is not H({TRAIN_CONFIG}) ({config_sha.hex()[:16]}…)")
    names = set(g["tensors"])
    chain = chain_of(config)
    if bytes.fromhex(g["params_sha256"]) != _set_digest(g["tensors"], "value_sha256", rel, chain):
        raise _bad(f"{rel} line 1", "params_sha256 is not H(θ_init) of the per-parameter digests")
    h = genesis(bytes.fromhex(g["params_sha256"]), config_sha, seed)
    if h.hex() != g["h"]:
        raise _bad(f"{rel} line 1", "h is not SHA256(H(θ_init) ‖ H(config) ‖ LE64(seed))")
    out = RunChain(rel, run, seed, 0, h.hex(), h.hex(), None)
    for n, rec in records:
        where = f"{rel} line {n}"
        if rec["artifact_type"] != "train_step" or rec["run"] != run:
            raise _bad(where, f"expected a train_step record of run {run}")
        if rec["step"] != out.steps:
            raise _bad(where, f"step {rec['step']} where step {out.steps} was due (a step removed, repeated or reordered)")
        if set(rec["tensors"]) != names:
            raise _bad(where, "names other parameters than the genesis")
        if bytes.fromhex(rec["params_sha256"]) != _set_digest(rec["tensors"], "value_sha256", where, chain):
            raise _bad(where, f"params_sha256 is not H(θ_{rec['step']}) of the per-parameter digests")
        if bytes.fromhex(rec["grads_sha256"]) != _set_digest(rec["tensors"], "grad_sha256", where, chain):
            raise _bad(where, f"grads_sha256 is not H(∇_{rec['step']}) of the per-parameter digests")
        h = link(h, bytes.fromhex(rec["params_sha256"]), bytes.fromhex(rec["batch_sha256"]), rec["step"])
        if h.hex() != rec["h"]:
            raise _bad(where, f"h is not h_{rec['step']} = SHA256(h_{rec['step'] - 1} ‖ H(θ) ‖ H(B) ‖ LE64({rec['step']}))")
        out.steps += 1
        out.head, out.final_params = h.hex(), rec["params_sha256"]
        out.final_tensors = {k: v["value_sha256"] for k, v in rec["tensors"].items()}
    if out.final_params is None:
        out.final_params = g["params_sha256"]
        out.final_tensors = {k: v["value_sha256"] for k, v in g["tensors"].items()}
    if out.steps != config["steps"] and run == 0:
        raise _bad(rel, f"holds {out.steps} steps; {TRAIN_CONFIG} says {config['steps']}")
    return out


def load_config(folder: Path) -> tuple[dict[str, Any], bytes]:
    """train_config.json, validated, and H(config)."""
    p = Path(folder) / TRAIN_CONFIG
    if not p.is_file():
        raise ArtifactError(f"{str(folder)!r} is not a training pack (no {TRAIN_CONFIG})")
    try:
        config = json.loads(p.read_bytes())
    except ValueError as exc:
        raise ArtifactError(f"{TRAIN_CONFIG}: not valid JSON") from exc
    schema_io.check_header(config, "train_config", TRAIN_CONFIG)
    schema_io.validate(config, "train_config", where=TRAIN_CONFIG)
    try:
        return config, config_digest(config)
    except ValueError as exc:
        raise ArtifactError(f"{TRAIN_CONFIG}: {exc}") from exc


def check_chain(folder: str | Path, *, weights: str | Path | None = None) -> ChainCheck:
    """Re-derive the chain of every steps file of a training pack (steps.jsonl and repeats/) from
    train_config.json and the recorded digests, offline and without torch; with `weights` (a
    safetensors file), check its H(θ) against the reference run's final commitment. Raises
    IntegrityError (exit 6) naming the first record or the parameters that do not match."""
    folder = Path(folder)
    config, config_sha = load_config(folder)
    if not (folder / STEPS).is_file():
        raise ArtifactError(f"{str(folder)!r} has no {STEPS}")
    runs = [check_run(p, config, config_sha) for p in steps_files(folder)]
    result = ChainCheck(config_sha.hex(), runs, chain=chain_of(config))
    if weights is not None:
        result.weights = check_weights(Path(weights), runs[0], result.chain)
    return result


def check_weights(path: Path, ref: RunChain, chain: str) -> str:
    """A safetensors file's H(θ) (by the P of `chain`) against the run's final committed H(θ_{K-1})."""
    found, per = safetensors_digest(path, chain)
    if found.hex() == ref.final_params:
        return f"matched: {path.name} is θ_{ref.steps - 1}, committed in h_{ref.steps - 1} {ref.head[:16]}…"
    changed = sorted(n for n in set(per) | set(ref.final_tensors) if per.get(n) != ref.final_tensors.get(n))
    names = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    raise IntegrityError(
        f"{path.name}: H(θ) {found.hex()[:16]}… is not the final commitment's H(θ_{ref.steps - 1}) {ref.final_params[:16]}… "
        f"(h_{ref.steps - 1} {ref.head[:16]}…); parameters that differ: {names}",
        hint="these are not the weights the recorded training produced, whatever its logged losses say")


def safetensors_digest(path: Path, chain: str) -> tuple[bytes, dict[str, str]]:
    """H(θ) of a safetensors file and each tensor's P (hex) by the P of `chain`, read without torch:
    the file stores every tensor as row-major little-endian bytes, exactly the bytes P hashes."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise ValueError("header length is not plausible")
            header = json.loads(f.read(n))
            base = 8 + n
            per: dict[str, str] = {}
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                begin, end = info["data_offsets"]
                f.seek(base + begin)
                data = f.read(end - begin)
                if len(data) != end - begin:
                    raise ValueError(f"tensor {name!r} runs past the end of the file")
                per[name] = tensor_digest_bytes(name, info["dtype"], tuple(info["shape"]), data, chain=chain).hex()
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ArtifactError(f"{path.name}: not a readable safetensors file ({exc})") from exc
    return tensors_digest((k, bytes.fromhex(v)) for k, v in per.items()), per


__all__ = ["ChainCheck", "RunChain", "STEPS", "TRAIN_CONFIG", "check_chain", "check_run", "check_weights", "genesis", "link",
           "load_config", "read_records", "safetensors_digest", "steps_files"]
