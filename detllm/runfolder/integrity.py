"""Tamper evidence for run folders: manifest.json, the trace's hash chain, sealing, and the
check of a folder's bytes against its seal.

Owns what manifest.json holds, how it is computed (byte for byte in docs/integrity.md) and
how a folder's bytes are checked against it. Reads bytes and JSON only and never imports an
engine. Does not own reading trace lines fast (tracescan.py), signatures (signing.py),
archives (archive.py), the verdict check and the `verify` command (verify.py, rederive.py)
or re-running a pack (replay.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from . import artifacts, schema_io
from .artifacts import APPLIED, ENV, MANIFEST, RUN_CONFIG, TRACE
from .env import detllm_version
from ..core.errors import ArtifactError, IntegrityError
from ..core.hashing import canonical_json
from .records import check_trace_record
from .signing import Signer, check_signature
from .tracescan import Lines, digest, scan_line, scan_record

SIG = "manifest.sig"
SEAL_FILES = (MANIFEST, SIG)  # never listed in the manifest itself
# The chain format a manifest names (trace.chain). /2 (schema_version 3 on) binds every input verify's
# re-derivation reads: run_config.json, env.json and determinism_applied.json (the effective tier, the
# applied settings that set the noise floor). /1 (schema_versions 1 and 2) bound run_config.json and
# env.json only; its folders still verify by that rule.
CHAIN = "detllm-trace-chain/2"
CHAIN_V1 = "detllm-trace-chain/1"
GENESIS_TAG = b"detllm-trace-chain/2 genesis\x00"  # 29 bytes
RECORD_TAG = b"detllm-trace-chain/2 record\x00"  # 28 bytes
_TAGS = {CHAIN: (GENESIS_TAG, RECORD_TAG),
         CHAIN_V1: (b"detllm-trace-chain/1 genesis\x00", b"detllm-trace-chain/1 record\x00")}
UNHASHED = hashlib.sha256(b"detllm: not hashed (remote)").digest()  # genesis input for a null model digest
LOCATOR_HEX = 16  # hex digits of each h_i kept in the manifest to name the first broken line
_CHUNK = 1 << 20  # 1 MiB reads


# ---------------------------------------------------------------- the chain


def genesis(run_config: bytes, env: bytes, applied: bytes | None, chain: str = CHAIN) -> bytes:
    """h_0 = SHA256(GENESIS_TAG || SHA256(run_config.json) || SHA256(env.json) || SHA256(determinism_applied.json)
    || weights || tokenizer); chain /1 (schema_versions 1-2) leaves determinism_applied.json out (`applied` unused).
    A digest recorded as null (a remote server's weights, "weights not hashed: remote") enters as
    UNHASHED, 32 bytes that no sha256 of real files is known to produce."""
    try:
        model = json.loads(run_config)["model"]
        ident = b"".join(UNHASHED if model[k] is None and model.get("remote") else bytes.fromhex(model[k])
                         for k in ("weights_sha256", "tokenizer_sha256"))
    except (ValueError, KeyError, TypeError) as exc:
        raise ArtifactError(f"{RUN_CONFIG}: cannot read the model identity the chain starts from") from exc
    if len(ident) != 64:
        raise ArtifactError(f"{RUN_CONFIG}: model weights_sha256/tokenizer_sha256 are not sha256 digests")
    if chain == CHAIN_V1:
        return _sha(_TAGS[chain][0] + _sha(run_config) + _sha(env) + ident)
    if applied is None:
        raise ArtifactError(f"{APPLIED} is missing; the trace's hash chain starts from it")
    return _sha(_TAGS[chain][0] + _sha(run_config) + _sha(env) + _sha(applied) + ident)


def step(prev: bytes, record: Any, index: int, chain: str = CHAIN) -> bytes:
    """h_i = SHA256(RECORD_TAG || h_{i-1} || SHA256(canonical JSON of record i) || i as 8 bytes LE); i from 1."""
    return step_digest(prev, _sha(canonical_json(record)), index, chain)


def step_digest(prev: bytes, record_sha256: bytes, index: int, chain: str = CHAIN) -> bytes:
    return _sha(_TAGS[chain][1] + prev + record_sha256 + index.to_bytes(8, "little"))


def folder_genesis(folder: Path, chain: str = CHAIN) -> bytes:
    """genesis() of the files in `folder` (determinism_applied.json read only where the chain binds it)."""
    applied = folder / APPLIED
    return genesis((folder / RUN_CONFIG).read_bytes(), (folder / ENV).read_bytes(),
                   applied.read_bytes() if chain != CHAIN_V1 and applied.is_file() else None, chain)


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def file_digest(path: Path) -> tuple[str, int]:
    """(sha256 hex, size) read from disk now; deliberately not hashing.sha256_file's mtime memo,
    which cannot see an edit made within the filesystem's timestamp granularity."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def walk(folder: Path) -> tuple[dict[str, Path], list[str]]:
    """Regular files under `folder` by '/'-separated relative path (manifest.json and
    manifest.sig excluded), and the relative paths of anything else (symlinks, fifos, devices)."""
    files: dict[str, Path] = {}
    odd: list[str] = []
    for root, dirs, names in os.walk(folder):
        for name in sorted(dirs) + sorted(names):
            p = Path(root) / name
            rel = p.relative_to(folder).as_posix()
            mode = os.lstat(p).st_mode
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode):
                odd.append(rel)
            elif rel not in SEAL_FILES and rel != artifacts.PARTIAL:  # the marker goes once the seal is written
                files[rel] = p
    return files, sorted(odd)


# ---------------------------------------------------------------- sealing


def build_manifest(folder: Path, record_digests: list[bytes] | None = None) -> dict[str, Any]:
    """The manifest of `folder` as it is on disk now. `record_digests` (from the TraceWriter
    that wrote the trace) spare parsing it again; they are used only if their count matches."""
    files, odd = walk(folder)
    if odd:
        raise ArtifactError(f"{folder}: {odd[0]} is not a regular file; a sealed folder holds regular files only")
    entries, trace = [], None
    for rel, p in sorted(files.items()):
        if rel == TRACE:
            trace, (sha, size) = _chain_of(folder, record_digests)
        else:
            sha, size = file_digest(p)
        entries.append({"path": rel, "sha256": sha, "size": size})
    return schema_io.stamp("manifest", {
        "detllm_version": detllm_version(), "algorithm": "sha256", "files": entries, "trace": trace,
    })


def _chain_of(folder: Path, digests: list[bytes] | None = None) -> tuple[dict[str, Any], tuple[str, int]]:
    for name in (RUN_CONFIG, ENV, APPLIED):
        if not (folder / name).is_file():
            raise ArtifactError(f"{folder}: {name} is missing; the trace's hash chain starts from it")
    h0 = folder_genesis(folder)
    h, locators, lines = h0, [], Lines(folder / TRACE)
    if digests is not None:
        if sum(1 for _ in lines) == len(digests):  # every byte is still read: the file's sha256 and size
            for n, record_sha in enumerate(digests, 1):
                h = step_digest(h, record_sha, n)
                locators.append(h.hex()[:LOCATOR_HEX])
            return _trace_entry(h0, h, locators), (lines.sha.hexdigest(), lines.size)
        lines = Lines(folder / TRACE)  # not the trace the writer wrote: chain it from disk
    for n, body in lines:
        try:
            rec = json.loads(body)
        except ValueError as exc:
            raise ArtifactError(f"{TRACE} line {n}: not valid JSON; refusing to seal it") from exc
        h = step(h, rec, n)
        locators.append(h.hex()[:LOCATOR_HEX])
    return _trace_entry(h0, h, locators), (lines.sha.hexdigest(), lines.size)


def _trace_entry(h0: bytes, head: bytes, locators: list[str]) -> dict[str, Any]:
    return {"path": TRACE, "chain": CHAIN, "records": len(locators), "genesis": h0.hex(), "head": head.hex(),
            "record_hashes": locators}


def seal(folder: Path, signer: Signer | None = None, record_digests: list[bytes] | None = None) -> dict[str, Any]:
    """Write manifest.json (last, atomically) and, with a signer, manifest.sig over its bytes.
    A stale manifest.sig is removed when not signing: it could not verify any more."""
    folder = Path(folder)
    manifest = build_manifest(folder, record_digests)
    schema_io.write_json(folder, MANIFEST, manifest)
    if signer is not None:
        schema_io.atomic_write_text(folder / SIG, signer.sign((folder / MANIFEST).read_bytes()))
    else:
        (folder / SIG).unlink(missing_ok=True)
    return manifest


# ---------------------------------------------------------------- verify


@dataclass
class Problem:
    where: str  # the file (and line) at fault
    message: str
    schema: bool = False  # True: a schema or JSON error in bytes that match the manifest (exit 5)

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass
class Verification:
    """What `verify` checked, when everything matched."""

    path: Path
    files: int  # files listed in the manifest and found unchanged
    records: int | None  # trace records whose chain matched; None without a trace
    head: str | None  # the chain head (hex)
    signature: str  # "verified", "not checked" (manifest.sig present, no --pubkey) or "absent"
    key_sha256: str | None = None  # sha256 of the raw Ed25519 public key that verified it
    notes: list[str] = field(default_factory=list)
    verdict: str = ""  # whether report.json's verdict was re-derived from the trace (rederive.py), in words

    def lines(self) -> list[str]:
        """What `detllm verify` prints."""
        chain = f", {self.records} trace records chained (head {self.head[:16]}…)" if self.head else ", no trace"
        key = f" by key sha256 {self.key_sha256[:16]}…" if self.key_sha256 else ""
        return [f"verified {self.path}: {self.files} files unchanged{chain}; signature {self.signature}{key}"] + \
            ([self.verdict] if self.verdict else []) + [f"note: {n}" for n in self.notes]

    def to_json(self) -> dict[str, Any]:
        return {"ok": True, "path": str(self.path), "files": self.files, "records": self.records, "head": self.head,
                "signature": self.signature, "key_sha256": self.key_sha256, "verdict": self.verdict, "notes": self.notes}


def open_seal(folder: Path, pubkey: str | Path | None = None) -> Seal:
    """The folder's manifest and signature, read and checked before any file is: a folder with
    no manifest, a manifest that is not one, or a bad signature is refused here."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ArtifactError(f"{str(folder)!r} is not a folder or a .tar.gz pack")
    artifacts.check_complete(folder)
    raw = _read_manifest_bytes(folder)
    manifest = _parse_manifest(raw)
    signature, key_sha = check_signature(folder / SIG, raw, pubkey)
    return Seal(folder, manifest, signature, key_sha)


@dataclass(frozen=True)
class Seal:
    """A folder's manifest and what its signature check found (open_seal)."""

    folder: Path
    manifest: dict[str, Any]
    signature: str  # "verified", "not checked" or "absent"
    key_sha256: str | None


def check_bytes(seal: Seal, *, beside: str | None = None) -> Verification:
    """Every file against the manifest, the trace against its hash chain, every JSON file against its
    schema. Raises IntegrityError (exit 6) naming the first changed file or trace line, ArtifactError
    (exit 5) for a schema or JSON error in unchanged bytes. The verdict is not checked here (verify.py).
    `beside`: a folder left to the caller, whose files are checked through digests the sealed files
    hold (a training pack's packed checkpoints/)."""
    folder, manifest = seal.folder, seal.manifest
    problems: list[Problem] = []
    files, odd = walk(folder)
    if beside is not None:
        files = {rel: p for rel, p in files.items() if not rel.startswith(beside + "/")}
    problems += [Problem(rel, "is a symlink or special file; a pack holds regular files only") for rel in odd]
    listed = {f["path"]: f for f in manifest["files"]}
    if len(listed) != len(manifest["files"]):
        raise ArtifactError(f"{MANIFEST}: lists a path twice")
    trace = manifest["trace"]
    for rel in sorted(set(listed) | set(files)):
        if rel not in files:
            problems.append(Problem(rel, "is listed in the manifest but missing (removed after sealing)"))
        elif rel not in listed:
            problems.append(Problem(rel, "is not in the manifest (added after sealing)"))
        elif rel == TRACE and trace is not None:
            problems += _check_trace(folder, trace, listed[rel])
        else:
            sha, size = file_digest(files[rel])
            if (sha, size) != (listed[rel]["sha256"], listed[rel]["size"]):
                problems.append(Problem(rel, f"changed after sealing (sha256 {sha[:12]}…, {size} bytes; "
                                             f"manifest {listed[rel]['sha256'][:12]}…, {listed[rel]['size']} bytes)"))
    if trace is None and TRACE in listed:
        problems.append(Problem(MANIFEST, f"lists {TRACE} but carries no hash chain for it"))
    if trace is not None and TRACE not in listed:
        problems.append(Problem(MANIFEST, f"carries a hash chain but does not list {TRACE}"))
    _raise_first([p for p in problems if not p.schema], IntegrityError, "the pack changed after it was sealed")
    problems += [Problem(rel, msg, schema=True) for rel, msg in _schema_problems(folder, files)]
    _raise_first(problems, ArtifactError, "the pack was sealed with invalid content")
    notes = [] if seal.signature == "verified" else [UNSIGNED_NOTE]
    return Verification(folder, len(listed), trace["records"] if trace else None, trace["head"] if trace else None,
                        seal.signature, seal.key_sha256, notes)


UNSIGNED_NOTE = ("unsigned: this shows the files are unchanged since sealing and consistent with each other, "
                 "not who wrote them; anyone can write such a folder, only a signature (--pubkey) says who")


def _raise_first(problems: list[Problem], cls: type, why: str) -> None:
    if problems:
        more = f"; {len(problems) - 1} more problem(s)" if len(problems) > 1 else ""
        raise cls(str(problems[0]), hint=why + more)


def _read_manifest_bytes(folder: Path) -> bytes:
    p = folder / MANIFEST
    if not p.is_file() or p.is_symlink():
        what = "a detllm run folder without a manifest" if artifacts.is_detllm_folder(folder) else "not a detllm pack"
        hint = ("every folder this detllm writes is sealed, so this one was written by hand, copied without it or by an "
                "older detllm; a folder is never sealed after the fact: run the command that made it again, then `detllm pack`"
                ) if what.startswith("a detllm") else \
            "pass a folder detllm wrote (it holds manifest.json) or a .tar.gz pack"
        raise ArtifactError(f"{str(folder)!r} is {what} (no {MANIFEST})", hint=hint)
    return p.read_bytes()


def _parse_manifest(raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise ArtifactError(f"{MANIFEST}: not valid JSON") from exc
    schema_io.check_header(obj, "manifest", MANIFEST)
    schema_io.validate(obj, "manifest", where=MANIFEST)
    return obj


def _check_trace(folder: Path, trace: dict[str, Any], entry: dict[str, Any]) -> list[Problem]:
    """Stream trace.jsonl once: its file digest, every record's schema, and the chain.
    Locating runs from the manifest's genesis so an edited env.json does not hide a bad line."""
    out: list[Problem] = []
    chain = trace["chain"]  # the manifest's schema allows only the chain of its own schema_version
    try:
        h0 = folder_genesis(folder, chain)
    except (OSError, ArtifactError):
        h0 = None  # the missing or changed file is already named
    genesis_ok = h0 is not None and h0.hex() == trace["genesis"]
    if h0 is not None and not genesis_ok:
        bound = f"{RUN_CONFIG}, {ENV}" + ("" if chain == CHAIN_V1 else f", {APPLIED}")
        out.append(Problem(TRACE, f"chain genesis does not match: {bound} or the model identity changed"))
    h, locators, expected = bytes.fromhex(trace["genesis"]), trace["record_hashes"], trace["records"]
    first: Problem | None = None
    lines, n = Lines(folder / TRACE), 0
    for n, body in lines:
        if first is not None:
            continue  # keep reading: the file digest still needs every byte
        try:
            fields, prechecked, guess = scan_record(body)
        except ValueError:
            first = Problem(f"{TRACE} line {n}", "not valid JSON", schema=True)
            continue
        bad = check_trace_record(fields, prechecked)
        if bad is not None:
            first = Problem(f"{TRACE} line {n}", f"schema violation: {bad}", schema=True)
            continue
        # hashed here, not on Lines' thread: hashlib lets go of the GIL on the long pieces, which is
        # when that thread gets it to hash the file (handing lines to it stalls both on the GIL)
        nxt = step_digest(h, digest(guess), n, chain)
        if n <= expected and nxt.hex()[:LOCATOR_HEX] != locators[n - 1]:
            nxt = step(h, json.loads(body), n, chain)  # the guess was not canonical: re-serialise (at most once)
        h = nxt
        if n > expected or h.hex()[:LOCATOR_HEX] != locators[n - 1]:
            first = Problem(f"{TRACE} line {n}", "record does not match the hash chain (edited, reordered, inserted or removed)")
    sha, size = lines.sha.hexdigest(), lines.size
    changed = (sha, size) != (entry["sha256"], entry["size"])
    if first is not None:
        first.schema = first.schema and not changed  # bad bytes that were sealed as-is are a schema error
        out.append(first)
    elif n != expected:
        out.append(Problem(TRACE, f"holds {n} records, the manifest records {expected} (truncated or lines appended)"))
    elif genesis_ok and h.hex() != trace["head"]:
        out.append(Problem(TRACE, "chain head does not match the manifest"))
    if changed and not out:
        out.append(Problem(TRACE, "changed after sealing (bytes differ; the records still chain: re-serialised?)"))
    elif not changed and first is not None and not first.schema:
        first.message += f"; the file's digest matches, so {MANIFEST}'s chain was edited"
    return out


def _schema_problems(folder: Path, files: dict[str, Path]) -> Iterator[tuple[str, str]]:
    """Every .json file against the schema its artifact_type names; every other .jsonl line too."""
    for rel, p in sorted(files.items()):
        if rel == TRACE or not rel.endswith((".json", ".jsonl")):
            continue
        docs = [(rel, p.read_bytes())] if rel.endswith(".json") else \
            [(f"{rel} line {n}", body) for n, body in Lines(p)]
        for where, body in docs:
            try:
                obj = json.loads(body)
                kind = obj.get("artifact_type") if isinstance(obj, dict) else None
                if not isinstance(kind, str):
                    yield where, "has no artifact_type, so no schema to check it against"
                    break
                schema_io.check_header(obj, kind, where)
                schema_io.validate(obj, kind, where=where)
            except ValueError:
                yield where, "not valid JSON"
                break
            except ArtifactError as exc:
                yield where, exc.message.removeprefix(f"{where}: ")
                break




__all__ = ["CHAIN", "CHAIN_V1", "Problem", "Seal", "Verification", "build_manifest", "check_bytes", "check_trace_record", "folder_genesis", "genesis",
           "open_seal", "scan_line", "seal", "step"]
