"""The model's own weights under Hugging Face names, read from its safetensors files.

vLLM's CPU build moves each linear layer's weight into a packed GEMM handle (oneDNN or sgl) and
leaves `layer.weight` empty, so a float64 reference of a linear and a weight perturbation read the
weight from the files the engine loaded. Also rebuilds a layer's CPU GEMM handle from a given
weight with vLLM's own dispatch (same kernel choice). Lazy: one tensor read per name asked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class HFWeights:
    """name -> tensor for the safetensors files of one model folder (None: not there)."""

    def __init__(self, folder: str | Path) -> None:
        self.files = sorted(Path(folder).glob("*.safetensors")) if Path(folder).is_dir() else []
        self._where: dict[str, Path] | None = None

    def _index(self) -> dict[str, Path]:
        if self._where is None:
            from safetensors import safe_open

            self._where = {}
            for f in self.files:
                with safe_open(str(f), framework="pt") as st:
                    for key in st.keys():
                        self._where[key] = f
        return self._where

    def get(self, name: str) -> Any | None:
        path = self._index().get(name)
        if path is None:
            return None
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as st:
            return st.get_tensor(name)


def module_weight(module: Any, names: list[str], weights: HFWeights) -> Any | None:
    """The weight `module` computes with: its own when vLLM kept it, else the HF pieces `names`
    (q, k, v of a fused qkv_proj, ...) read from the files and stacked as vLLM fuses them."""
    import torch

    own = getattr(module, "weight", None)
    if isinstance(own, torch.Tensor) and own.numel() and own.is_floating_point():
        return own.data
    parts = [weights.get(n + ".weight") for n in names]
    if not parts or any(p is None for p in parts):
        return None
    dtype = own.dtype if isinstance(own, torch.Tensor) else parts[0].dtype
    return torch.cat(parts, dim=0).to(dtype)


def rebuild_gemm(module: Any, weight: Any) -> Any | None:
    """Give `module` a CPU GEMM handle computing with `weight` (vLLM's dispatch: same kernel
    choice); returns the handle it replaced (None: the module computes with its weight directly)."""
    old = getattr(module, "cpu_linear", None)
    if old is None:
        return None
    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    holder = torch.nn.Module()
    holder.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    bias = getattr(module, "bias", None)
    holder.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False) if isinstance(bias, torch.Tensor) else None
    dispatch_cpu_unquantized_gemm(holder, remove_weight=False)
    module.cpu_linear = holder.cpu_linear
    return old


__all__ = ["HFWeights", "module_weight", "rebuild_gemm"]
