"""Putting a tensor-parallel capture back together: each rank's records (tpcapture.py) into one record
per Hugging Face name, as a TP=1 engine would have captured it: column-parallel outputs and row-parallel
inputs concatenated per part in rank order (replicated K/V heads once), row-parallel outputs (after the
all-reduce) and replicated tensors checked equal on every rank, and the float64 reference evaluated on
the full tensors with the weights from the model's files. No vLLM import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ..capture import CapturedTensor
from .weights import HFWeights

KV_INPUTS = ("key", "value", "past_keys", "past_values")


def _concat(parts: list[Any], axis: int = -1) -> Any:
    return np.concatenate(parts, axis=axis)


def _kv(parts: list[Any], replicas: int) -> list[Any]:
    """The ranks' K/V shards, each head once: with kv_heads < TP, ranks r*replicas .. hold the same head."""
    return parts[::replicas] if replicas > 1 else parts


def _same(parts: list[Any]) -> float | None:
    """None when every rank holds the same array bitwise, else the largest |Δ| from rank 0's."""
    first, worst = parts[0], None
    for p in parts[1:]:
        if p.shape != first.shape:
            return float("inf")
        if p.tobytes() != first.tobytes():
            gap = float(np.nanmax(np.abs(p.astype(np.float64) - first.astype(np.float64)))) if p.size else 0.0
            worst = max(worst or 0.0, gap)
    return worst


def _act(parts: list[Any]) -> Any:
    """SiluAndMul's input: each rank holds [its gate columns | its up columns]."""
    gates = [p[..., : p.shape[-1] // 2] for p in parts]
    ups = [p[..., p.shape[-1] // 2:] for p in parts]
    return _concat([_concat(gates), _concat(ups)])


class _Joined:
    """What unsharding found: the replicated tensors compared across ranks and where they differ."""

    def __init__(self) -> None:
        self.checked = 0
        self.differ: list[str] = []

    def one(self, name: str, parts: list[Any]) -> Any:
        self.checked += 1
        gap = _same(parts)
        if gap is not None:
            self.differ.append(f"{name} (max |Δ| {gap:.3g} from rank 0's)")
        return parts[0]


def _record(recs: list[CapturedTensor], lay: dict[str, Any], kv_replicas: int, joined: _Joined) -> CapturedTensor:
    """One HF-named record from the ranks' records of it."""
    first = recs[0]
    split = lay.get("split", "replicated")
    piece = lay["pieces"].index(first.name) if first.name in lay.get("pieces", []) else 0
    outs = [r.output for r in recs]
    ins = [[r.inputs[i] for r in recs] for i in range(len(first.inputs))]
    names = first.input_names or [f"arg{i}" for i in range(len(first.inputs))]
    axes: dict[int, int] = {}  # input index -> the axis it was concatenated on
    if split == "column":
        kv = lay.get("kv_replicas", 1) if piece in (1, 2) and len(lay["pieces"]) == 3 else 1
        output = _concat(_kv(outs, kv))
        inputs = [joined.one(f"{first.name} input {i}", p) for i, p in enumerate(ins)]
    elif split == "row":
        output = joined.one(first.name, outs)
        inputs = [_concat(p) for p in ins]
        axes = {i: -1 for i in range(len(ins))}
    elif split == "act":
        output = _concat(outs)
        inputs = [_act(p) for p in ins]
        axes = {i: -1 for i in range(len(ins))}
    elif split == "heads":
        output = _concat(outs)
        inputs = [_concat(_kv(p, kv_replicas) if n in KV_INPUTS else p) for n, p in zip(names, ins)]
        axes = {i: -1 for i in range(len(ins))}
    elif split == "block":  # hidden in and o_proj's reduced output out; past K/V in transformers' [kv_heads, positions, head_dim]
        output = joined.one(first.name, outs)
        inputs = [_concat(_kv(p, kv_replicas), 0) if n in KV_INPUTS else joined.one(f"{first.name} {n}", p)
                  for n, p in zip(names, ins)]
        axes = {i: 0 for i, n in enumerate(names) if n in KV_INPUTS}
    else:
        output = joined.one(first.name, outs)
        inputs = [joined.one(f"{first.name} input {i}", p) for i, p in enumerate(ins)]
    shapes = _shapes(first, inputs, axes)
    out_shape = tuple(first.output_shape[:-1]) + (output.shape[-1],) if first.output_shape else first.output_shape
    return CapturedTensor(name=first.name, kind=first.kind, order=first.order, output=output, inputs=inputs,
                          input_shapes=shapes, output_shape=out_shape, ref_error=None, cached_from_step=first.cached_from_step,
                          input_names=first.input_names, dtype=first.dtype, phase=first.phase, cached_steps=first.cached_steps,
                          positions=first.positions, whole=first.whole)


def _shapes(first: CapturedTensor, inputs: list[Any], axes: dict[int, int]) -> list[tuple[int, ...]]:
    """Rank 0's input shapes (the whole batch) with each concatenated input's axis at its full size."""
    shapes = [list(s) for s in first.input_shapes]
    used: set[int] = set()
    for i, axis in axes.items():
        shard = first.inputs[i].shape
        for j, s in enumerate(shapes):
            if j not in used and len(s) == len(shard) and tuple(s[1:]) == tuple(shard[1:]):
                s[axis] = inputs[i].shape[axis]
                used.add(j)
                break
    return [tuple(s) for s in shapes]


def unshard(ranks: list[dict[str, Any]], folder: str | None) -> tuple[list[CapturedTensor], list[str], dict[str, Any]]:
    """(the full records in rank 0's execution order, notes, facts for Capture.engine) from each
    rank's collect_in_worker answer, in rank order. `folder`: the model's files for the float64
    reference (None: not evaluated)."""
    tp = len(ranks)
    by_name = [{t.name: t for t in r["tensors"]} for r in ranks]
    names = [t.name for t in ranks[0]["tensors"]]
    missing = sorted({n for n in names for b in by_name[1:] if n not in b})
    layout = {p: lay for lay in ranks[0]["layout"].values() for p in lay["pieces"]}
    kv_replicas = max([lay.get("kv_replicas", 1) for lay in layout.values()] or [1])
    joined = _Joined()
    out = [_record([b[n] for b in by_name], layout.get(n, {"split": "replicated", "pieces": [n]}), kv_replicas, joined)
           for n in names if n not in missing]
    ref = _Reference(folder) if folder else None
    for t in out:
        t.ref_error = ref.error(t) if ref else None
    partials = _partials(ranks, {t.name: t for t in out})
    splits: dict[str, list[str]] = {}
    for n in names:
        splits.setdefault(layout.get(n, {}).get("split", "replicated"), []).append(n)
    notes = [f"tensor_parallel_size={tp}: captured on each of the {tp} ranks (worker processes) and put back together "
             "under HF names: column-parallel outputs (q/k/v, gate/up, silu_and_mul, the attention heads) and row-parallel "
             "inputs (o_proj, down_proj) concatenated per part in rank order" + (f", K/V heads replicated on {kv_replicas} "
             "ranks taken once" if kv_replicas > 1 else "") + f"; row-parallel outputs (after the all-reduce) and the "
             f"replicated tensors ({joined.checked}) compared across ranks: " +
             ("all equal bitwise" if not joined.differ else "differ on " + "; ".join(joined.differ[:5]))]
    if missing:
        notes.append(f"not captured on every rank, left out: {', '.join(missing[:5])}")
    if partials:
        equal = [n for n, p in partials.items() if p["sum_equals_output"]]
        notes.append(f"row-parallel modules ({', '.join(sorted(partials)[:2])}{', ...' if len(partials) > 2 else ''}): each rank's "
                     f"partial product (its input columns times its weight rows) was computed again by the module's kernel; "
                     f"the partials summed in rank order equal the all-reduced output bitwise at {len(equal)} of {len(partials)}")
    facts = {"ranks": tp, "kv_head_replicas": kv_replicas, "replicated_checked": joined.checked,
             "replicated_differ": joined.differ, "row_parallel": partials,
             "split": {k: len(v) for k, v in sorted(splits.items())}}
    return out, notes, facts


def _partials(ranks: list[dict[str, Any]], full: dict[str, CapturedTensor]) -> dict[str, dict[str, Any]]:
    """Per row-parallel module: its partials summed in rank order against its captured output."""
    found: dict[str, dict[str, Any]] = {}
    for name in ranks[0]["partials"]:
        parts = [r["partials"].get(name) for r in ranks]
        t = full.get(name)
        if t is None or any(p is None or p.shape != t.output.shape for p in parts):
            continue
        total = parts[0].copy()
        for p in parts[1:]:
            total = total + p  # the engine's dtype, as the all-reduce adds
        gap = np.abs(total.astype(np.float64) - t.output.astype(np.float64))
        found[name] = {"input_columns_per_rank": int(t.inputs[0].shape[-1]) // len(ranks) if t.inputs else None,
                       "sum_equals_output": total.tobytes() == t.output.tobytes(),
                       "max_abs_sum_vs_output": float(gap.max()) if gap.size else 0.0}
    return found


class _Reference:
    """max |output - float64 of the same computation on the full captured inputs|, with the HF weights."""

    def __init__(self, folder: str) -> None:
        self.weights = HFWeights(folder)
        try:
            config = json.loads((Path(folder) / "config.json").read_text())
        except (OSError, ValueError):
            config = {}
        self.eps = config.get("rms_norm_eps")

    def error(self, t: CapturedTensor) -> float | None:
        import torch

        if not t.inputs or "/" in t.name and not t.name.endswith("/silu_and_mul"):
            return None
        x = torch.from_numpy(np.ascontiguousarray(t.inputs[0]))
        dtype = getattr(torch, t.dtype, None) if t.dtype else None
        w = self.weights.get(t.name + ".weight")
        if w is not None and dtype is not None:
            w = w.to(dtype)
        if t.kind == "gemm" and w is not None and x.is_floating_point():
            b = self.weights.get(t.name + ".bias")
            ref = x.double() @ w.double().T + (b.to(dtype).double() if b is not None and dtype is not None else 0)
        elif t.kind == "embedding" and w is not None and not x.is_floating_point():
            ref = w.double()[x.long()]
        elif t.kind == "norm" and w is not None and self.eps is not None and x.is_floating_point():
            xd = x.double()
            ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + float(self.eps)) * w.double()
        elif t.name.endswith("/silu_and_mul"):
            g, u = x.double().chunk(2, dim=-1)
            ref = torch.nn.functional.silu(g) * u
        else:
            return None
        out = torch.from_numpy(np.ascontiguousarray(t.output)).double()
        if tuple(ref.shape) != tuple(out.shape):
            return None
        return float((out - ref).abs().max()) if out.numel() else 0.0


__all__ = ["unshard"]
