"""vLLM's module tree under Hugging Face names: which vLLM module yields which HF-named tensor.

vLLM fuses what transformers keeps apart (`qkv_proj`, `gate_up_proj`, SiluAndMul, the residual add
inside the next layer's norm), returns `(out, bias)` from linears and `(hidden, residual)` from
decoder layers. This table turns each hooked module's output into the HF-named pieces, so locate
compares hf with vLLM without a user-written map. Pure rules: no hooks, no vLLM import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# vLLM-only computations get an op name under their HF parent ("module/op"), never an HF module name
ATTENTION_OP = "attention"  # vLLM's attention kernel (q, k, v after rotary -> the heads' output)
ACT_MUL_OP = "silu_and_mul"  # SiluAndMul: silu(gate) * up in one op; HF's act_fn is silu(gate) alone

_LAYER = re.compile(r"^(?P<stem>.*\.layers\.\d+)$")


@dataclass(frozen=True)
class Piece:
    """One HF-named tensor a hooked vLLM module yields."""

    name: str  # HF module path, or "parent/op" for a vLLM-only op
    kind: str  # capture.CAPTURE_KINDS
    part: str  # how to read it from the module's call: see `Rule.split` and capture.py
    lo: int = 0  # column range of a fused output (last dim); hi 0: the whole tensor
    hi: int = 0


@dataclass(frozen=True)
class Rule:
    """How one vLLM module maps to HF: its pieces, in execution order."""

    module: str  # the vLLM module path
    pieces: tuple[Piece, ...]
    hf_only_note: str = ""  # what HF has here that vLLM does not compute separately


def _sizes(module: Any) -> list[int]:
    sizes = getattr(module, "output_sizes", None)
    if not sizes:
        raise ValueError(f"fused linear {type(module).__name__} has no output_sizes")
    return [int(s) for s in sizes]


def _cuts(sizes: list[int]) -> list[tuple[int, int]]:
    out, lo = [], 0
    for s in sizes:
        out.append((lo, lo + s))
        lo += s
    return out


def rule_for(name: str, module: Any) -> Rule | None:
    """The HF pieces `module` (at vLLM path `name`) yields; None: not hooked (containers, the
    lm_head whose forward vLLM never calls, the rotary module shared by all layers)."""
    cls = type(module).__name__
    if name == "logits_processor":
        return Rule(name, (Piece("lm_head", "logits", "logits"),))
    if cls in ("ModuleList", "RotaryEmbedding", "ApplyRotaryEmb") or name in ("", "lm_head"):
        return None
    if name.endswith(".qkv_proj"):
        stem = name[: -len("qkv_proj")]
        (q, k, v) = _cuts(_sizes(module))
        return Rule(name, (Piece(stem + "q_proj", "gemm", "linear", *q), Piece(stem + "k_proj", "gemm", "linear", *k),
                           Piece(stem + "v_proj", "gemm", "linear", *v)))
    if name.endswith(".gate_up_proj"):
        stem = name[: -len("gate_up_proj")]
        gate, up = _cuts(_sizes(module))
        return Rule(name, (Piece(stem + "gate_proj", "gemm", "linear", *gate), Piece(stem + "up_proj", "gemm", "linear", *up)))
    if cls == "SiluAndMul":
        return Rule(name, (Piece(name.rsplit(".", 1)[0] + "/" + ACT_MUL_OP, "activation", "plain"),),
                    hf_only_note=f"{name} (HF's act_fn: silu(gate) alone) is fused with the multiply by up in vLLM")
    if name.endswith(".attn") and hasattr(module, "attn_backend"):
        return Rule(name, (Piece(name.rsplit(".", 1)[0] + "/" + ATTENTION_OP, "attention", "plain"),))
    if _LAYER.match(name):
        return Rule(name, (Piece(name, "layer", "layer"),))
    if cls == "RMSNorm" or cls.endswith("Norm"):
        return Rule(name, (Piece(name, "norm", "norm"),))
    if "Embedding" in cls:
        return Rule(name, (Piece(name, "embedding", "plain"),))
    if cls.endswith("Linear"):
        return Rule(name, (Piece(name, "gemm", "linear"),))
    if cls.endswith("Attention"):
        return Rule(name, (Piece(name, "attention", "plain"),))
    if cls.endswith("MLP"):
        return Rule(name, (Piece(name, "other", "plain"),))
    return None


def rules(model: Any) -> list[Rule]:
    """Every hooked module of a vLLM model, in module-tree order."""
    out = []
    for name, module in model.named_modules():
        rule = rule_for(name, module)
        if rule is not None:
            out.append(rule)
    return out


def find_piece(model_rules: list[Rule], hf_name: str) -> tuple[Rule, Piece] | None:
    """The vLLM module and piece that compute the HF module `hf_name` (a perturbation target)."""
    for rule in model_rules:
        for piece in rule.pieces:
            if piece.name == hf_name:
                return rule, piece
    return None


__all__ = ["ACT_MUL_OP", "ATTENTION_OP", "Piece", "Rule", "find_piece", "rule_for", "rules"]
