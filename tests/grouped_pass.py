"""The figures of a captured step as the grouped pass computed them before training/capture.py (commit
31a8502): one _foreach_norm per dtype group, aminmax per tensor, one stack. Kept as the reference the
per-tensor pass must match bit for bit (tests/test_training_capture.py) and as the old pass that
benchmarks/bench_training_capture.py --grouped times beside the new one."""

from __future__ import annotations

import math

import torch


def grouped_figures(tensors):
    """The figures as steps.figures computed them before the per-tensor pass (commit 31a8502),
    kept here as the reference: one _foreach_norm per dtype group, aminmax per tensor, one stack."""
    present = [t.detach() for t in tensors if t is not None and t.numel() > 0]
    if not present:
        return [(None, None)] * len(tensors)
    l2 = [None] * len(present)
    f32 = [i for i, t in enumerate(present) if t.dtype == torch.float32]
    other = [i for i, t in enumerate(present) if t.dtype != torch.float32]
    for idx, kw in ((f32, {}), (other, {"dtype": torch.float32})):
        if idx:
            for i, n in zip(idx, torch._foreach_norm([present[i].float() if present[i].dtype == torch.float64 else present[i]
                                                      for i in idx], 2, **kw)):
                l2[i] = n
    mx = [torch.maximum(lo.abs(), hi.abs()).float() for lo, hi in (torch.aminmax(t) for t in present)]
    pairs = iter(zip(torch.stack([n.float() for n in l2]).tolist(), torch.stack(mx).tolist()))
    fin = (lambda x: x if math.isfinite(x) else None)
    return [(None, None) if t is None or t.numel() == 0 else tuple(fin(v) for v in next(pairs)) for t in tensors]
