"""The names and kinds of what a tap captures on a torch module tree: a module's kind by its type, a
torch function's plain name and kind, and the functions that only view, reshape or allocate (no
computation of their own to capture). Naming only; the hooks are `detllm.taps`', which re-exports
these. torch is imported lazily.
"""

from __future__ import annotations

from typing import Any

# torch functions that only view, reshape, allocate or ask: no computation of their own to capture
_SKIP_OPS = {"get", "getitem", "setitem", "bool", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "len", "index", "int",
             "float_", "_set_grad_enabled", "contiguous", "view", "view_as", "reshape", "reshape_as", "transpose",
             "permute", "unsqueeze", "squeeze", "expand", "expand_as", "flatten", "unflatten", "narrow", "select", "t",
             "numel", "size", "dim", "tensor", "as_tensor", "arange", "new_ones", "new_zeros", "new_empty", "new_full",
             "zeros", "ones", "empty", "full", "zeros_like", "ones_like", "empty_like", "full_like", "clone", "detach",
             "dropout", "chunk", "split", "unbind", "repeat_interleave", "stride", "data_ptr", "is_floating_point"}
_OP_KINDS = {"mm": "gemm", "addmm": "gemm", "bmm": "gemm", "baddbmm": "gemm", "matmul": "gemm", "linear": "gemm",
             "einsum": "gemm", "softmax": "softmax", "_softmax": "softmax", "log_softmax": "softmax", "silu": "activation",
             "gelu": "activation", "relu": "activation", "tanh": "activation", "sigmoid": "activation",
             "embedding": "embedding", "rsqrt": "norm", "layer_norm": "norm", "rms_norm": "norm", "cos": "rotary",
             "sin": "rotary", "scaled_dot_product_attention": "attention", "all_reduce": "all_reduce"}
_ARITH = {"add", "sub", "mul", "matmul", "truediv", "floordiv", "pow", "mod", "and", "or", "neg"}


def module_kind(name: str, module: Any, output_name: str = "lm_head") -> str:
    """Kind of a module by its type (backends.capture.CAPTURE_KINDS)."""
    import torch

    cls = type(module).__name__
    low = cls.lower()
    if isinstance(module, torch.nn.Embedding):
        return "embedding"
    if low.endswith("rmsnorm") or low.endswith("layernorm") or isinstance(module, torch.nn.LayerNorm):
        return "norm"
    if isinstance(module, torch.nn.Linear) or cls.endswith("Linear") or cls == "Conv1D":  # BlockLinear, vLLM's *Linear
        return "logits" if name.split(".")[-1] == output_name else "gemm"
    if "rotary" in low:
        return "rotary"
    if "attention" in low:
        return "attention"
    if isinstance(module, torch.nn.Softmax):
        return "softmax"
    if low.endswith("activation") or type(module).__module__ == "torch.nn.modules.activation" or low.endswith("act"):
        return "activation"
    if low.endswith("decoderlayer") or low.endswith("block") or low.endswith("layer") and _is_stack_member(name):
        return "layer"
    return "other"


def _is_stack_member(name: str) -> bool:
    return name.split(".")[-1].isdigit()


def op_name(func: Any) -> str:
    """A torch function's plain name: Tensor.__add__ and torch.add are "add", __iadd__ is "add_"."""
    name = getattr(func, "__name__", None) or str(func)
    if name.startswith("__") and name.endswith("__"):
        core = name[2:-2]
        if core[:1] in ("i", "r") and core[1:] in _ARITH:
            core = core[1:] + ("_" if core[0] == "i" else "")
        return {"truediv": "div", "float": "float_"}.get(core, core)
    return name


def op_kind(op: str, module_kind_: str) -> str:
    """Kind of an op: its own where it has one; an add straight inside a decoder layer is the residual."""
    if op in _OP_KINDS:
        return _OP_KINDS[op]
    if op in ("add", "add_") and module_kind_ == "layer":
        return "residual"
    return "other"
