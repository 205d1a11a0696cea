"""Naming llama.cpp graph nodes in Hugging Face naming (the `llamacpp` capture): layer boundaries by a
shipped rule (`l_out-N` -> `model.layers.N`), other nodes through the weight they read and the `gguf`
package's tensor name map (weights only), and GGUF's q/k row permutation undone. Pure functions.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from ...core.errors import BackendUnavailableError

LAYER_OUT = re.compile(r"^l_out-(\d+)$")  # llama.cpp's residual stream after decoder layer N
UNPERMUTED_ARCHS = ("llama",)  # convert_hf_to_gguf permutes q/k rows for these (llama.cpp's "normal" rope)


class NameMap:
    """GGUF weight base names (`blk.0.attn_q`) -> Hugging Face module paths, from the `gguf`
    package's TensorNameMap for the file's architecture (weights only). Where several Hugging Face
    names map to one GGUF name, one in `known` wins (the other side's modules), else the first
    `model.`-rooted one (`lm_head` for the output)."""

    def __init__(self, arch: str, n_layer: int, known: Sequence[str] = ()) -> None:
        try:
            import gguf
        except ImportError as exc:
            raise BackendUnavailableError("naming llama.cpp nodes needs the gguf package",
                                          hint="pip install 'detllm[hf]' (or gguf)") from exc
        enum = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), None)
        self.hf: dict[str, str] = {}
        if enum is None:
            return
        candidates: dict[str, list[str]] = {}
        for hf, (_tensor, base) in gguf.TensorNameMap(enum, n_layer).mapping.items():
            candidates.setdefault(base, []).append(hf)
        known_set = set(known)
        for base, names in candidates.items():
            pick = next((n for n in names if n in known_set), None)
            if pick is None:
                pick = next((n for n in names if n == "lm_head" or n.startswith("model.layers." if base.startswith("blk.") else "model.")), None)
            if pick is not None:
                self.hf[base] = pick

    def module(self, weight: str) -> str | None:
        return self.hf.get(weight.removesuffix(".weight")) if weight.endswith(".weight") else None


def _kind(base: str, op: str) -> str:
    if base == "token_embd":
        return "embedding"
    if base == "output":
        return "logits"
    return "norm" if op == "MUL" and base.endswith("norm") else "gemm"


def node_name(rec: dict[str, Any], names: NameMap) -> tuple[str, str, str | None] | None:
    """(Hugging Face name, kind, GGUF weight base) of a dumped node, or None for a node no rule names:
    l_out-N is the layer boundary; GET_ROWS/MUL_MAT/MUL name the module whose weight they read."""
    m = LAYER_OUT.match(rec["name"])
    if m:
        return f"model.layers.{m.group(1)}", "layer", None
    if rec["op"] not in ("GET_ROWS", "MUL_MAT", "MUL"):
        return None
    for src in rec["src"]:
        module = names.module(src["name"])
        if module is not None:
            base = src["name"].removesuffix(".weight")
            if rec["op"] == "MUL_MAT" and (base == "token_embd" or rec["name"] == "result_output"):
                # tied embeddings (smollm2): the logits are a product with token_embd's matrix, not its lookup
                return "lm_head", "logits", base
            return module, _kind(base.split(".")[-1] if base.startswith("blk.") else base, rec["op"]), base
    return None


def unpermute(a: Any, n_head: int) -> Any:
    """Undo GGUF's q/k row permutation on an output's last (feature) axis: GGUF's feature
    (head h, pair i, j) is Hugging Face's (head h, half j, i) (models.gguf.permute_qk)."""
    head_dim = a.shape[-1] // n_head
    return a.reshape(*a.shape[:-1], n_head, head_dim // 2, 2).swapaxes(-1, -2).reshape(a.shape)


def repermute(a: Any, n_head: int) -> Any:
    """The inverse of `unpermute`: Hugging Face's q/k feature order back to GGUF's (a graft into llama.cpp)."""
    head_dim = a.shape[-1] // n_head
    return a.reshape(*a.shape[:-1], n_head, 2, head_dim // 2).swapaxes(-1, -2).reshape(a.shape)


__all__ = ["LAYER_OUT", "UNPERMUTED_ARCHS", "NameMap", "node_name", "repermute", "unpermute"]
