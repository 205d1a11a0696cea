"""Which part of a batched tensor a capture keeps: the prompt's row and, along each position axis,
its real positions (`Window`), read off a tensor of the whole batch or off a copy of the row alone
(`taken`: the one copy a tap keeps of an input serves its float64 reference and its compared bytes),
and that part as numpy (`numpy_copy`, `numpy_view`). torch is imported lazily.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Window:
    """Which part of each batched tensor a tap keeps: batch row `row` (None: all), and along each
    position axis the last `cuts[width]` entries of an axis `width` long (left padding: the real
    positions are the last ones), so batch 1 and batch N captures of one prompt align. `taken`
    (each method): `t` is the row already, kept as a batch of one (`t[row:row + 1]`, dim 0 the batch)."""

    row: int | None = None
    batch: int | None = None  # rows in the forward (None: dim 0 of a module's tensors is the batch)
    cuts: dict[int, int] = field(default_factory=dict)  # padded width -> real positions kept
    fixed: frozenset[int] = frozenset()  # feature sizes (hidden, heads...): an op's axis this long is never cut
    heads: frozenset[int] = frozenset()  # attention head counts: an op's dim 0 of batch x heads is unfolded
    in_pass_kv: bool = False  # an attention that read no cached K/V keeps those it wrote in the pass (in_pass_keys/values)

    def module(self, t: Any, taken: bool = False) -> Any:
        """A module's tensor in the Hugging Face layout [batch, position, ...]."""
        if self.row is None or t.ndim == 0:
            return t
        if taken or self.batch is None or t.shape[0] == self.batch:
            t = t[0 if taken else self.row]
            if t.ndim >= 1 and t.shape[0] in self.cuts and (t.ndim >= 2 or not t.is_floating_point()):
                t = t[t.shape[0] - self.cuts[t.shape[0]]:]
        return t

    def axis(self, t: Any, dim: int) -> Any:
        """Cut axis `dim` of a tensor whose batch row was taken already (cached K/V: [heads, position, dim])."""
        if t.ndim > dim and t.shape[dim] in self.cuts:
            return t.narrow(dim, t.shape[dim] - self.cuts[t.shape[dim]], self.cuts[t.shape[dim]])
        return t

    def everywhere(self, t: Any, taken: bool = False) -> tuple[Any, bool]:
        """An op's or a mask's tensor, layout unknown: (the row of it, every axis of a padded width cut;
        False where an axis could be a position or a feature axis and was left whole)."""
        if self.row is None or t.ndim == 0:
            return t, True
        n = self.batch or 1
        if taken or t.shape[0] == n:
            t = t[0 if taken else self.row]
        elif n > 1 and t.shape[0] % n == 0 and (t.shape[0] // n in self.cuts or t.shape[0] // n in self.heads):
            t = t.reshape(n, t.shape[0] // n, *t.shape[1:])[self.row]  # batch folded with heads or positions
        else:
            return t, False
        clean = True
        for dim in range(t.ndim):
            width = t.shape[dim]
            if width in self.cuts and width in self.fixed:
                clean = False
            elif width in self.cuts:
                t = t.narrow(dim, width - self.cuts[width], self.cuts[width])
        return t, clean


def numpy_copy(t: Any) -> tuple[Any, str]:
    """A copy of `t` as numpy (bfloat16 widened to float32, exactly) and the engine's dtype name."""
    import torch

    dtype = str(t.dtype).replace("torch.", "")
    src = t.detach()
    t = (src.float() if src.dtype == torch.bfloat16 else src).cpu()  # numpy has no bfloat16: float32 holds each value exactly
    # one copy: the float() or cpu() above made one already, else copy the engine's memory once (never both)
    return (t.numpy().copy() if t.data_ptr() == src.data_ptr() else t.numpy()), dtype


def numpy_view(t: Any) -> Any:
    """Part of a tap's own copy (`taps._Tapper._own`) as numpy, sharing its memory: no second copy
    (bfloat16 or off the CPU: `numpy_copy`'s one)."""
    import torch

    if not t.is_cpu or t.dtype == torch.bfloat16:
        return numpy_copy(t)[0]
    return t.detach().numpy() if t.requires_grad else t.numpy()
