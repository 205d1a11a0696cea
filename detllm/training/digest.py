"""The digests of the training chain, byte for byte as docs/training.md defines them: P(name, T)
of one tensor, H over a set of named tensors, H(B_t) of a batch, RFC 8785 canonical JSON and
H(config), the RNG-state digest R_t. Pure Python over bytes; the torch adapters import torch
only when called, so verify can recompute every digest from files without torch. P depends on
the chain version a pack names (chain_of): SHA-256 in detllm-train/1, BLAKE3 in detllm-train/2.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from typing import Any, Iterable, Sequence

CHAIN_1 = "detllm-train/1"  # P is SHA-256: packs and checkpoints that name no chain
CHAIN_2 = "detllm-train/2"  # P is BLAKE3 (~3.5x faster on a 538 MB model; issue 36): what train-check writes
CHAIN = CHAIN_2
CHAINS = (CHAIN_1, CHAIN_2)
TENSOR_TAG = b"detllm-train/1 tensor\x00"
TENSOR_TAG_2 = b"detllm-train/2 tensor\x00"
TENSORS_TAG = b"detllm-train/1 tensors\x00"
BATCH_TAG = b"detllm-train/1 batch\x00"
NONE_DTYPE = "none"  # a gradient that is None
# torch dtype name -> safetensors dtype name (the dtype string hashed)
SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
MAX_SAFE_INT = 2**53 - 1  # I-JSON: integers past this are refused by jcs()


def le64(x: int) -> bytes:
    return int(x).to_bytes(8, "little", signed=False)


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return le64(len(b)) + b


def chain_of(doc: dict[str, Any]) -> str:
    """The chain version a train_config.json or a checkpoint descriptor names; none named is
    detllm-train/1 (every pack and checkpoint written before `chain` was recorded)."""
    chain = doc.get("chain") or CHAIN_1
    if chain not in CHAINS:
        raise ValueError(f"chain {chain!r} is not one this detllm knows ({', '.join(CHAINS)})")
    return chain


def tensor_digest_bytes(name: str, dtype: str, shape: Sequence[int], data: Any, *, chain: str) -> bytes:
    """P(name, T): 32 raw bytes. `data` is the tensor's row-major little-endian bytes (any
    object with the buffer protocol: hashed in place, never copied)."""
    head = _str(name) + _str(dtype) + le64(len(shape)) + b"".join(le64(d) for d in shape)
    if chain == CHAIN_2:
        import blake3  # the Rust package; lets go of the GIL over a large buffer, as hashlib does

        h = blake3.blake3(TENSOR_TAG_2 + head)
    elif chain == CHAIN_1:
        h = hashlib.sha256(TENSOR_TAG + head)
    else:
        raise ValueError(f"chain {chain!r} is not one this detllm knows ({', '.join(CHAINS)})")
    h.update(data)
    return h.digest()


def none_digest(name: str, *, chain: str) -> bytes:
    """P(name, none): a parameter whose gradient is None."""
    return tensor_digest_bytes(name, NONE_DTYPE, (), b"", chain=chain)


def tensors_digest(named: Iterable[tuple[str, bytes]]) -> bytes:
    """H over (name, P) pairs: sorted by the names' UTF-8 bytes, P concatenated after LE64(n)."""
    items = sorted(named, key=lambda kv: kv[0].encode("utf-8"))
    return hashlib.sha256(TENSORS_TAG + le64(len(items)) + b"".join(p for _, p in items)).digest()


def batch_digest(micro_batches: Iterable[tuple[int, int, Any]]) -> bytes:
    """H(B_t) over (rows, columns, LE int64 row-major bytes) per micro-batch, in order."""
    parts = list(micro_batches)
    h = hashlib.sha256(BATCH_TAG + le64(len(parts)))
    for rows, cols, data in parts:
        h.update(le64(rows) + le64(cols))
        h.update(data)
    return h.digest()


# ---------------------------------------------------------------- torch adapters (torch imported by the caller)


def tensor_bytes(t: Any) -> Any:
    """A tensor's elements as row-major little-endian bytes (a uint8 numpy view of the tensor's
    storage: no copy when it is contiguous and on the CPU)."""
    import torch

    flat = t.detach().contiguous().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
    elif flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    arr = flat.numpy()
    arr = arr if sys.byteorder == "little" or arr.dtype.itemsize == 1 else arr.byteswap()
    return arr.view("u1")  # the same memory as bytes (blake3 takes a byte buffer only)


def dtype_name(t: Any) -> str:
    name = str(t.dtype).removeprefix("torch.")
    try:
        return SAFETENSORS_DTYPES[name]
    except KeyError:
        raise ValueError(f"tensor dtype {name} has no safetensors name; it cannot be hashed") from None


def torch_tensor_digest(name: str, t: Any, *, chain: str) -> bytes:
    """P(name, T) of a torch tensor; P(name, none) for None."""
    if t is None:
        return none_digest(name, chain=chain)
    return tensor_digest_bytes(name, dtype_name(t), tuple(t.shape), tensor_bytes(t), chain=chain)


def torch_batch_digest(micro_batches: Iterable[Any]) -> bytes:
    """H(B_t) of 2-dim integer tensors of token ids, widened to int64."""
    import torch

    return batch_digest((int(b.shape[0]), int(b.shape[1]), tensor_bytes(b.to(torch.int64))) for b in micro_batches)


# ---------------------------------------------------------------- RFC 8785 canonical JSON


def _number(x: float) -> str:
    """ECMAScript Number::toString of a finite double (RFC 8785 section 3.2.2.3)."""
    if x == 0:
        return "0"
    if x < 0:
        return "-" + _number(-x)
    digits, exp = _shortest(x)  # x = 0.digits * 10**exp
    k, n = len(digits), exp
    if k <= n <= 21:
        return digits + "0" * (n - k)
    if 0 < n <= 21:
        return digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return "0." + "0" * (-n) + digits
    e = n - 1
    sign = "+" if e >= 0 else "-"
    mant = digits if k == 1 else digits[0] + "." + digits[1:]
    return f"{mant}e{sign}{abs(e)}"


def _shortest(x: float) -> tuple[str, int]:
    """The shortest round-trip decimal digits of x (Python's repr is that) and n with x = 0.d1d2... * 10**n."""
    r = repr(x)
    mant, _, e = r.partition("e")
    exp = int(e) if e else 0
    whole, _, frac = mant.partition(".")
    digits = (whole + frac).lstrip("0")
    lead = len(whole) if whole.strip("0") else -(len(frac) - len(frac.lstrip("0")))
    digits = digits.rstrip("0") or "0"
    return digits, lead + exp


def _jcs(obj: Any, out: list[str]) -> None:
    if obj is None or obj is True or obj is False:
        out.append("null" if obj is None else "true" if obj else "false")
    elif isinstance(obj, int):
        if abs(obj) > MAX_SAFE_INT:
            raise ValueError(f"integer {obj} is beyond 2^53: RFC 8785 (I-JSON) cannot carry it exactly")
        out.append(str(obj))
    elif isinstance(obj, float):
        if not math.isfinite(obj):
            raise ValueError(f"{obj} has no JSON form")
        out.append(_number(obj))
    elif isinstance(obj, str):
        out.append(json.dumps(obj, ensure_ascii=False))
    elif isinstance(obj, (list, tuple)):
        out.append("[")
        for i, v in enumerate(obj):
            if i:
                out.append(",")
            _jcs(v, out)
        out.append("]")
    elif isinstance(obj, dict):
        bad = next((k for k in obj if not isinstance(k, str)), None)
        if bad is not None:
            raise ValueError(f"JSON object key {bad!r} is not a string")
        out.append("{")
        for i, k in enumerate(sorted(obj, key=lambda s: s.encode("utf-16-be", "surrogatepass"))):  # UTF-16 code units
            if i:
                out.append(",")
            out.append(json.dumps(k, ensure_ascii=False) + ":")
            _jcs(obj[k], out)
        out.append("}")
    else:
        raise ValueError(f"{type(obj).__name__} has no JSON form")


def jcs(obj: Any) -> bytes:
    """RFC 8785 JSON Canonicalization Scheme, UTF-8. Raises ValueError for what it cannot carry
    exactly (NaN, infinities, integers past 2^53, lone surrogates)."""
    out: list[str] = []
    _jcs(obj, out)
    try:
        return "".join(out).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError("a string holds a lone surrogate; RFC 8785 needs well-formed Unicode") from exc


def config_digest(config: dict[str, Any]) -> bytes:
    """H(config) = SHA256(JCS(train_config.json's object))."""
    return hashlib.sha256(jcs(config)).digest()


def rng_digest(state: dict[str, Any]) -> bytes:
    """R_t = SHA256(JCS(rng.json's `state`))."""
    return hashlib.sha256(jcs(state)).digest()


__all__ = ["BATCH_TAG", "CHAIN", "CHAINS", "CHAIN_1", "CHAIN_2", "TENSOR_TAG_2", "chain_of", "SAFETENSORS_DTYPES", "TENSORS_TAG", "TENSOR_TAG", "batch_digest", "config_digest", "dtype_name", "jcs", "le64",
           "none_digest", "rng_digest", "tensor_bytes", "tensor_digest_bytes", "tensors_digest", "torch_batch_digest",
           "torch_tensor_digest"]
