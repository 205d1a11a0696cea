"""The per-tensor pass of a captured step: P of each named tensor and its two figures (L2 norm, max |x|).
Each tensor is hashed and measured in turn, so the figures read it while it is still in cache; the
tensors are shared among as many worker threads as torch computes with, and each worker computes on
one thread (an OpenMP team inside each worker would put 4 threads on 2 cores). The figures are bit for
bit those of the grouped pass written before (one CPU `_foreach_norm` per tensor is the same kernel).
Does not own the digests' bytes (digest.py) or the step's record (steps.py).
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .digest import tensor_bytes, tensor_digest_bytes, dtype_name, none_digest

Figures = tuple[float | None, float | None]  # (L2 norm, max |x|) widened from float32; None: none, empty or not finite

_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def tensor_figures(t: Any) -> tuple[Any, Any] | None:
    """(L2 norm, max |x|) of one tensor as float32 0-dim tensors; None for a None or empty tensor.
    The L2 norm is `_foreach_norm` on the tensor alone, with the arguments the grouped pass gave it
    (float32 without a dtype argument; float64 rounded to float32 first, since a float32 norm of a
    float64 tensor is refused as narrowing); max |x| is max(|min|, |max|) of one aminmax pass, exact."""
    import torch

    if t is None or t.numel() == 0:
        return None
    t = t.detach()
    if t.dtype == torch.float32:
        l2 = torch._foreach_norm([t], 2)[0]  # no dtype argument on float32: a 4x slower path
    else:
        l2 = torch._foreach_norm([t.float() if t.dtype == torch.float64 else t], 2, dtype=torch.float32)[0]
    lo, hi = torch.aminmax(t)  # one pass; an inf-norm is ~10x slower on CPU
    return l2.float(), torch.maximum(lo.abs(), hi.abs()).float()


def _measure(name: str, t: Any, chain: str) -> tuple[bytes, tuple[Any, Any] | None]:
    """P(name, t) then t's figures, while t's bytes are in cache."""
    if t is None:
        return none_digest(name, chain=chain), None
    p = tensor_digest_bytes(name, dtype_name(t), tuple(t.shape), tensor_bytes(t), chain=chain)
    return p, tensor_figures(t)


def _shares(named: list[tuple[str, Any]], k: int) -> list[list[int]]:
    """Indexes of `named` in k shares of about equal bytes (largest tensor first, to the lightest share)."""
    size = [0 if t is None else t.numel() * t.element_size() for _, t in named]
    shares: list[list[int]] = [[] for _ in range(k)]
    load = [0] * k
    for i in sorted(range(len(named)), key=lambda i: -size[i]):
        j = load.index(min(load))
        shares[j].append(i)
        load[j] += size[i]
    return [s for s in shares if s]


def _one_thread() -> None:
    """A worker's initializer: torch computes on one thread in it (its own OpenMP setting)."""
    import torch

    torch.get_num_threads()  # torch sets a new thread's count from the process's on first use: do it now
    torch.set_num_threads(1)


def _pool(n: int) -> ThreadPoolExecutor:
    """n started workers, each computing on one thread. torch.set_num_threads(1) in a worker also
    sets the count that threads started later take: it is put back to n here, once, after every
    worker has started (this thread's own count is n throughout)."""
    import torch

    with _POOLS_LOCK:
        pool = _POOLS.get(n)
        if pool is None:
            pool = ThreadPoolExecutor(n, thread_name_prefix="detllm-capture", initializer=_one_thread)
            started = threading.Barrier(n)
            for f in [pool.submit(started.wait) for _ in range(n)]:
                f.result()
            torch.set_num_threads(n)
            _POOLS[n] = pool
    return pool


def digests_with_figures(named: list[tuple[str, Any]], chain: str) -> tuple[dict[str, bytes], list[Figures]]:
    """P of each named tensor (None: P(name, none)) and its figures, in `named`'s order. On one
    torch thread the pass runs here; on n, in n workers over shares of about equal bytes. Neither
    the digests nor the figures depend on it."""
    import torch

    n = torch.get_num_threads()
    if n < 2 or len(named) < 2:
        out = [_measure(name, t, chain) for name, t in named]
    else:
        def share(idx: list[int]) -> list[tuple[int, Any]]:
            return [(i, _measure(*named[i], chain)) for i in idx]

        out = [None] * len(named)
        for f in [_pool(n).submit(share, s) for s in _shares(named, n)]:
            for i, r in f.result():
                out[i] = r
    per = {name: r[0] for (name, _), r in zip(named, out)}
    figs = [r[1] for r in out]
    present = [f for f in figs if f is not None]
    if not present:
        return per, [(None, None)] * len(named)
    # one conversion to Python floats for all the tensors (float32 widened exactly), not one per tensor
    l2s, mxs = iter(torch.stack([f[0] for f in present]).tolist()), iter(torch.stack([f[1] for f in present]).tolist())
    return per, [(None, None) if f is None else (_finite(next(l2s)), _finite(next(mxs))) for f in figs]


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


__all__ = ["Figures", "digests_with_figures", "tensor_figures"]
