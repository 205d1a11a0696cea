"""Is a local model readable? One check of its files before an engine loads them.

Owns recognising a truncated or corrupt model file: a JSON file of the model folder
(config, generation config, tokenizer files, a safetensors index), a .safetensors file
(header and every tensor's byte range) or a .gguf file (header and every tensor's byte
range), and saying so in one line that names the file (UsageError, exit 2: the model the
user gave is bad, nothing was written). Reads headers and JSON only, never tensor data;
engines (transformers, vLLM, llama.cpp) otherwise fail with a traceback or a server log.
Does not own model identity (hashing.py) or finding a model (models/).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import BinaryIO

from .errors import UsageError

_MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own limit on its JSON header
# ggml type id -> (elements per block, bytes per block), for the types a GGUF model holds
_GGML_SIZES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 36),
               10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
               24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 30: (1, 2)}


def corrupt(path: Path, why: str) -> UsageError:
    return UsageError(f"model file {str(path)!r} is unreadable or corrupt: {why}",
                      hint="re-download or re-export the model; detllm loads nothing from it")


def check_model_files(path: str | Path) -> None:
    """Every model file in the folder `path` (or the one file `path`): UsageError naming the
    first that is truncated or corrupt."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else []
    for p in files:
        try:
            if p.suffix == ".json":
                _check_json(p)
            elif p.suffix == ".safetensors":
                _check_safetensors(p)
            elif p.suffix == ".gguf":
                _check_gguf(p)
        except OSError as exc:
            raise corrupt(p, exc.strerror or exc.__class__.__name__) from exc


def _check_json(p: Path) -> None:
    try:
        json.loads(p.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise corrupt(p, f"not valid JSON ({str(exc)[:120]})") from exc


def _check_safetensors(p: Path) -> None:
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise corrupt(p, f"{size} bytes, shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_SAFETENSORS_HEADER):
            raise corrupt(p, f"its header claims {n} bytes, the file holds {size} (truncated?)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as exc:
            raise corrupt(p, "its header is not valid JSON") from exc
    data = size - 8 - n
    if not isinstance(header, dict):
        raise corrupt(p, "its header is not a JSON object")
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = t["data_offsets"]
        except (TypeError, KeyError, ValueError) as exc:
            raise corrupt(p, f"tensor {name!r} has no data_offsets") from exc
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end):
            raise corrupt(p, f"tensor {name!r} has bad data_offsets")
        if end > data:
            raise corrupt(p, f"tensor {name!r} ends at byte {end} of the data, which holds {data} (truncated)")


class _Reader:
    """Little-endian GGUF values from a buffered file; struct.error on a short read."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        data = self.f.read(size)
        return struct.unpack(fmt, data)[0]

    def string(self) -> bytes:
        n = self.take("<Q")
        if n > 1 << 30:
            raise struct.error("string too long")
        data = self.f.read(n)
        if len(data) < n:
            raise struct.error("short string")
        return data

    def skip_value(self, vtype: int) -> object:
        scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
        if vtype in scalar:
            return self.take(scalar[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            item, n = self.take("<I"), self.take("<Q")
            for _ in range(n):
                self.skip_value(item)
            return None
        raise struct.error(f"unknown value type {vtype}")


def _check_gguf(p: Path) -> None:
    size = p.stat().st_size
    with open(p, "rb") as f:
        r = _Reader(f)
        try:
            if f.read(4) != b"GGUF":
                raise corrupt(p, "not a GGUF file (no GGUF magic)")
            version, n_tensors, n_kv = r.take("<I"), r.take("<Q"), r.take("<Q")
            if version < 2 or n_tensors > 1 << 24 or n_kv > 1 << 24:
                raise corrupt(p, f"GGUF header is implausible (version {version}, {n_tensors} tensors, {n_kv} keys)")
            alignment = 32
            for _ in range(n_kv):
                key, vtype = r.string(), r.take("<I")
                value = r.skip_value(vtype)
                if key == b"general.alignment" and isinstance(value, int) and value > 0:
                    alignment = value
            tensors = []
            for _ in range(n_tensors):
                name, n_dims = r.string(), r.take("<I")
                if n_dims > 8:
                    raise corrupt(p, f"tensor {name.decode(errors='replace')!r} has {n_dims} dimensions")
                dims = [r.take("<Q") for _ in range(n_dims)]
                tensors.append((name.decode(errors="replace"), dims, r.take("<I"), r.take("<Q")))
        except struct.error as exc:
            raise corrupt(p, "truncated GGUF header") from exc
        data_start = -(-f.tell() // alignment) * alignment
    for name, dims, ggml_type, offset in tensors:
        block, nbytes = _GGML_SIZES.get(ggml_type, (None, None))
        count = 1
        for d in dims:
            count *= d
        end = data_start + offset + (count // block * nbytes if block else 0)
        if end > size:
            raise corrupt(p, f"tensor {name!r} ends at byte {end}, the file holds {size} (truncated)")


__all__ = ["check_model_files", "corrupt"]
