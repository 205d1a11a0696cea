"""GGUF files: write the built-in `tiny` model as GGUF (f32, same weights), read GGUF headers.

Writing uses only the `gguf` package, numpy and safetensors (no llama.cpp build, no
torch), mirroring llama.cpp's convert_hf_to_gguf.py for a Llama with a GPT-2 byte-level
BPE tokenizer, q/k row permutation included. Reading is a small pure-Python header parser
(metadata, tensor types, token bytes) the llamacpp backend uses for model identity.
Owns no caching (models/__init__.py) and no engine code.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GGUF_NAME = "model.gguf"
_TOKEN_NORMAL, _TOKEN_CONTROL = 1, 3  # gguf.TokenType values
_LAYER_TENSORS = {  # HF name inside model.layers.N -> GGUF name inside blk.N
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def permute_qk(w: Any, n_head: int) -> Any:
    """HF rotates halves of each head (rotate_half); llama.cpp's Llama rope rotates
    adjacent pairs. Reorder the output rows of q/k so both compute the same thing.
    w: (n_head * head_dim, hidden)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_map(config: dict[str, Any]) -> list[tuple[str, str, int | None]]:
    """(HF name, GGUF name, heads to permute by or None), in the order written."""
    out: list[tuple[str, str, int | None]] = [("model.embed_tokens.weight", "token_embd.weight", None)]
    for i in range(config["num_hidden_layers"]):
        for hf, gg in _LAYER_TENSORS.items():
            heads = None
            if hf.startswith("self_attn.q_proj"):
                heads = config["num_attention_heads"]
            elif hf.startswith("self_attn.k_proj"):
                heads = config.get("num_key_value_heads") or config["num_attention_heads"]
            out.append((f"model.layers.{i}.{hf}", f"blk.{i}.{gg}", heads))
    out.append(("model.norm.weight", "output_norm.weight", None))
    out.append(("lm_head.weight", "output.weight", None))
    return out


def _vocab(tok: dict[str, Any], vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """Tokens by id, their types, and merges as 'a b' strings, from a tokenizer.json."""
    model = tok["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"expected a BPE tokenizer, got {model.get('type')!r}")
    by_id: dict[int, str] = {i: t for t, i in model["vocab"].items()}
    special = set()
    for added in tok.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        if added.get("special"):
            special.add(added["id"])
    if sorted(by_id) != list(range(vocab_size)):
        raise ValueError(f"tokenizer ids are not exactly 0..{vocab_size - 1}")
    tokens = [by_id[i] for i in range(vocab_size)]
    types = [_TOKEN_CONTROL if i in special else _TOKEN_NORMAL for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    if not merges:
        raise ValueError("llama.cpp needs at least one BPE merge rule")  # it rejects an empty merge list
    return tokens, types, merges


def build_tiny_gguf(hf_folder: Path, dest: Path) -> Path:
    """Convert the Llama HF folder at `hf_folder` to `dest/model.gguf` (f32); `dest` is created."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    config = json.loads((hf_folder / "config.json").read_text())
    tok = json.loads((hf_folder / "tokenizer.json").read_text(encoding="utf-8"))
    tok_cfg = json.loads((hf_folder / "tokenizer_config.json").read_text())
    weights = load_file(str(hf_folder / "model.safetensors"))
    n_head = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    tokens, types, merges = _vocab(tok, config["vocab_size"])
    post = tok.get("post_processor") or {}
    adds_bos = any("SpecialToken" in part for part in post.get("single", []))  # HF prepends a special token

    dest.mkdir(parents=True)
    out = dest / GGUF_NAME
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(hf_folder.name)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(config.get("num_key_value_heads") or n_head)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = config.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    w.add_vocab_size(config["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # same split regex as HF's ByteLevel(use_regex=True)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    w.add_pad_token_id(config["pad_token_id"])
    w.add_add_bos_token(bool(tok_cfg.get("add_bos_token", adds_bos)))
    w.add_add_eos_token(False)
    for hf_name, gguf_name, heads in tensor_map(config):
        data = np.ascontiguousarray(weights[hf_name], dtype=np.float32)
        if heads is not None:
            data = np.ascontiguousarray(permute_qk(data, heads))
        w.add_tensor(gguf_name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out.parent


# --- reading: a minimal GGUF header parser (metadata + tensor infos, never tensor data) ---

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# general.file_type -> name (llama.cpp's llama_ftype; no gguf import needed to read a header)
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
               12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
               19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
               26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
               36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4_MOE"}
# ggml tensor type -> name, for files without general.file_type
_TENSOR_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K",
                 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16"}
_BYTE_TOKEN, _CONTROL_TOKEN = 6, 3  # gguf.TokenType values used when rendering tokens
# file and tensor types that store plain floats -> the dtype they hold; anything else (Q4_1, Q8_0, IQ...) is quantized
FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass(frozen=True)
class GGUFInfo:
    """What a backend needs from a GGUF header; `raw` keeps each value's bytes as stored."""

    metadata: dict[str, Any]  # key -> decoded value (arrays as lists)
    raw: dict[str, bytes]  # key -> type tag + value bytes exactly as in the file
    tensor_types: dict[str, int]  # tensor name -> ggml type id
    tensor_layout: dict[str, tuple[tuple[int, ...], int]] = field(default_factory=dict)  # name -> (ne, file offset of its data)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def context_length(self) -> int | None:
        v = self.metadata.get(f"{self.architecture}.context_length")
        return int(v) if v is not None else None

    @property
    def quantization(self) -> str:
        """Q4_1, F32, ...: general.file_type when present, else the commonest 2-D weight type."""
        ft = self.metadata.get("general.file_type")
        if ft is not None:
            return _FILE_TYPES.get(int(ft), f"file_type_{ft}")
        counts: dict[int, int] = {}
        for t in self.tensor_types.values():
            counts[t] = counts.get(t, 0) + 1
        if not counts:
            return "unknown"
        top = max(sorted(counts), key=lambda t: counts[t])
        return _TENSOR_TYPES.get(top, f"ggml_type_{top}")

    def tokenizer_sha256(self) -> str:
        """Identity of the tokenizer by content: every tokenizer.ggml.* key with its stored bytes."""
        h = hashlib.sha256()
        for key in sorted(k for k in self.raw if k.startswith("tokenizer.ggml.")):
            h.update(key.encode() + b"\0" + hashlib.sha256(self.raw[key]).digest())
        return h.hexdigest()

    def token_bytes(self) -> list[bytes] | None:
        """The bytes llama.cpp emits for each token id (control tokens: b""), or None for a
        vocabulary type this parser does not render (the caller then cannot check UTF-8)."""
        model = self.metadata.get("tokenizer.ggml.model")
        tokens = self.metadata.get("tokenizer.ggml.tokens") or []
        types = self.metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        out: list[bytes] = []
        if model == "gpt2":
            dec = {c: b for b, c in _byte_to_unicode().items()}
            for text, kind in zip(tokens, types):
                if kind == _CONTROL_TOKEN:
                    out.append(b"")
                elif all(c in dec for c in text):
                    out.append(bytes(dec[c] for c in text))
                else:
                    out.append(text.encode("utf-8"))  # user-defined tokens are stored as plain text
            return out
        if model == "llama":
            for text, kind in zip(tokens, types):
                if kind == _CONTROL_TOKEN:
                    out.append(b"")
                elif kind == _BYTE_TOKEN and text.startswith("<0x") and text.endswith(">"):
                    out.append(bytes([int(text[3:-1], 16)]))
                else:
                    out.append(text.replace("\u2581", " ").encode("utf-8"))
            return out
        return None


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte <-> printable character table (as in HF and llama.cpp)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str) -> Any:
        v = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        s = self.data[self.pos : self.pos + n]
        self.pos += n
        return s.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.take("<I"), self.take("<Q")
            return [self.value(itype) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")


def read_gguf(path: Path) -> GGUFInfo:
    """Parse the header of a GGUF file (v2/v3). Raises ValueError for anything else."""
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        size = 1 << 20
        while True:  # read until the header parses: it is small next to the tensor data
            f.seek(24)
            cur = _Cursor(f.read(size))
            try:
                metadata, raw = {}, {}
                for _ in range(n_kv):
                    key = cur.string()
                    start = cur.pos
                    vtype = cur.take("<I")
                    metadata[key] = cur.value(vtype)
                    raw[key] = cur.data[start : cur.pos]
                tensors, layout = {}, {}
                for _ in range(n_tensors):
                    name = cur.string()
                    n_dims = cur.take("<I")
                    ne = tuple(cur.take("<Q") for _ in range(n_dims))
                    tensors[name] = cur.take("<I")
                    layout[name] = (ne, cur.take("<Q"))  # offset from the data section's start
                align = int(metadata.get("general.alignment", 32))
                data_start = -(-(24 + cur.pos) // align) * align
                return GGUFInfo(metadata, raw, tensors, {k: (ne, data_start + off) for k, (ne, off) in layout.items()})
            except struct.error:
                if len(cur.data) < size:
                    raise ValueError(f"{path}: truncated GGUF header") from None
                size *= 4
