"""The float64 re-evaluation behind a tap's tolerance: a module (a float64 copy, the transformers
cache it reads stood in by its float64 K/V) or a torch op run again on the same inputs in float64,
every down-cast inside made float64 too. What is compared with what, and the hooks, are
`detllm.taps`'. torch is imported lazily.
"""

from __future__ import annotations

import copy
from typing import Any


def first_tensor(out: Any) -> Any:
    """The first tensor of a module's output (a tensor, a tuple, a transformers ModelOutput); None: none."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "keys") and hasattr(out, "values"):  # transformers ModelOutput
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                return o
    return None


def cache_of(args: tuple, kwargs: dict) -> Any:
    """The transformers cache among a module's arguments; None: it reads none."""
    for v in list(args) + list(kwargs.values()):
        if hasattr(v, "update") and (hasattr(v, "layers") or hasattr(v, "key_cache")):
            return v
    return None


def cache_snapshot(cache: Any) -> dict[int, tuple[Any, Any]]:
    """{layer index: (keys, values)} a transformers cache holds now (references: its update replaces them)."""
    snap: dict[int, tuple[Any, Any]] = {}
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for i, layer in enumerate(layers):
            if getattr(layer, "is_initialized", False) and getattr(layer, "keys", None) is not None and layer.keys.numel():
                snap[i] = (layer.keys, layer.values)
    elif hasattr(cache, "key_cache"):
        for i, (k, v) in enumerate(zip(cache.key_cache, cache.value_cache)):
            if k is not None and k.numel():
                snap[i] = (k, v)
    return snap


class _Cache64:
    """Stands in for a transformers cache in a float64 re-evaluation: the layer's cached K/V in
    float64, followed by what the module adds, and nothing written back to the real cache."""

    def __init__(self, snap: dict[int, tuple[Any, Any]]) -> None:
        self.snap = snap

    def update(self, keys, values, layer_idx, *args, **kwargs):
        import torch

        prev = self.snap.get(layer_idx)
        if prev is None:
            return keys, values
        return torch.cat([prev[0].to(keys.dtype), keys], dim=-2), torch.cat([prev[1].to(values.dtype), values], dim=-2)


def to64(v: Any, snap: dict) -> Any:
    import torch

    if isinstance(v, torch.Tensor):
        return v.to(torch.float64) if v.is_floating_point() else v.clone()
    if isinstance(v, tuple):
        return tuple(to64(x, snap) for x in v)
    if isinstance(v, list):
        return [to64(x, snap) for x in v]
    if hasattr(v, "update") and (hasattr(v, "layers") or hasattr(v, "key_cache")):
        return _Cache64({i: (k.to(torch.float64), vv.to(torch.float64)) for i, (k, vv) in snap.items()})
    return v


def one_row(v: Any, batch: int, row: int) -> Any:
    """`v` (a tensor, a tuple or list of them, a cache snapshot) with every tensor whose dim 0 is
    the batch cut to row `row` (kept as a batch of one): a row's float64 reference costs one row."""
    import torch

    if isinstance(v, torch.Tensor):
        return v[row:row + 1] if v.ndim and v.shape[0] == batch else v
    if isinstance(v, tuple):
        return tuple(one_row(x, batch, row) for x in v)
    if isinstance(v, list):
        return [one_row(x, batch, row) for x in v]
    if isinstance(v, dict):
        return {k: one_row(x, batch, row) for k, x in v.items()}
    return v


def op_row(args: tuple, kwargs: dict, out_ndim: int, batch: int, row: int, keep: set[int]) -> tuple[tuple, dict] | None:
    """An op's arguments cut to batch row `row` (kept as a batch of one) where that is safe: every
    tensor argument with the output's rank has dim 0 the batch (cut) or 1 (broadcast); a lower rank
    aligns on trailing axes and is left whole, as are the tensors in `keep` (weights). None: some
    argument's dim 0 is neither (batch folded with heads...), or none was cut (an embedding's ids
    rank below its output's): evaluate the whole batch instead."""
    import torch

    bad, cuts = False, 0

    def cut(v: Any) -> Any:
        nonlocal bad, cuts
        if isinstance(v, torch.Tensor):
            if id(v) in keep or v.ndim != out_ndim or v.shape[0] == 1:
                return v
            if v.shape[0] != batch:
                bad = True
                return v
            cuts += 1
            return v[row:row + 1]
        if isinstance(v, tuple):
            return tuple(cut(x) for x in v)
        if isinstance(v, list):
            return [cut(x) for x in v]
        return v

    args2, kwargs2 = tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}
    return None if bad or not cuts else (args2, kwargs2)


def upcast(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """An op's arguments with every floating dtype it names (a cast, softmax's dtype) made float64."""
    import torch

    def up(v):
        return torch.float64 if isinstance(v, torch.dtype) and v.is_floating_point else v

    return tuple(up(a) for a in args), {k: up(v) for k, v in kwargs.items()}


class Float64:
    """While entered, every op computes in float64 even where the module casts down on purpose
    (RMSNorm's float32, softmax's dtype): the reference is float64 throughout."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        class _Up(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                args, kwargs = upcast(tuple(args), kwargs or {})
                return func(*args, **kwargs)

        self.mode = _Up()
        return self.mode.__enter__()

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def module_output(module: Any, args: tuple, kwargs: dict, snap: dict) -> Any:
    """The first tensor `module` returns when a float64 copy of it runs on `args`/`kwargs` cast to
    float64 (`snap`: the cache's K/V as the module was entered). Raises what the module raises."""
    import torch

    with torch.inference_mode(False), torch.no_grad(), Float64():
        # each floating parameter and buffer made float64 as it is copied (the memo): no float32 copy of the weights first
        memo = {id(t): (torch.nn.Parameter(t.detach().to(torch.float64), requires_grad=False) if isinstance(t, torch.nn.Parameter)
                        else t.to(torch.float64))
                for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()}
        copy64 = copy.deepcopy(module, memo).to(torch.float64)
        return first_tensor(copy64(*to64(args, snap), **{k: to64(v, snap) for k, v in kwargs.items()}))


def op_output(func: Any, args: tuple, kwargs: dict) -> Any:
    """The first tensor the torch function `func` returns on its inputs in float64 (dtype arguments too)."""
    args64, kwargs64 = upcast(to64(tuple(args), {}), {k: to64(v, {}) for k, v in kwargs.items()})
    return first_tensor(func(*args64, **kwargs64))
