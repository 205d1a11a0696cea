"""Benign or bug: the category of the first difference locate found, from what it measured, with the
reason in one line a maintainer can act on (locate.json `category`, the head of `line`). Categories:
reduction order, numerical defect, different computation, cache, not judged. Reads the verdict, the
captures and each side's recorded config; finding the op is rule.py's, the causal test graft.py's.
"""

from __future__ import annotations

from typing import Any

from . import sharded
from .align import Pair
from .rule import beyond, tolerance

LABELS = {"reduction_order": "reduction order", "numerical_defect": "numerical defect",
          "different_computation": "different computation", "cache": "cache", "not_judged": "not judged"}
REDUCTIONS = ("gemm", "attention", "norm", "softmax", "logits", "layer", "other")  # an "other" module holds its ops
JUMP = 10.0  # the difference grows by this factor or more inside one-sided computation: the first op is not judged


def categorize(doc: dict[str, Any], found: Any, sides: list[Any]) -> dict[str, Any] | None:
    """The category of the located op (None: nothing located), and the line's head set from it."""
    b = found.verdict.first_bitwise
    if b is None:
        return None
    cat = _category(doc, found, sides, b)
    doc["category"] = cat
    doc["line"] = f"{LABELS[cat['name']]}: {cat['why']}. {doc['line']}"
    return cat


def _category(doc, found, sides, b: Pair) -> dict[str, Any]:
    searched = doc["steps_searched"]
    if len(searched) > 1 or found.verdict.back_to is not None:
        wrote = searched[-1] if len(searched) > 1 else found.verdict.back_to
        inner = _category({**doc, "steps_searched": searched[:1]}, _Plain(found), sides, b)
        return {"name": "cache", "why": f"the difference entered through cached K/V written at step {wrote} and read at step "
                                        f"{searched[0]}; where they were written: {LABELS[inner['name']]} ({inner['why']})",
                "written_at_step": wrote, "read_at_step": searched[0], "where_written": inner}
    what = _what_differs(doc, sides, b)
    if what:
        return {"name": "different_computation", "why": "; ".join(what) + ": not a determinism problem, the two sides "
                                                                       "compute different things", "differs": what}
    tol, d = tolerance(b), b.metrics.get("max_abs_diff")
    values = f"{b.metrics.get('left_value')} vs {b.metrics.get('right_value')}"
    shapes = (f"in {[list(s) for s in b.left.input_shapes]} vs {[list(s) for s in b.right.input_shapes]}, "
              f"{b.left.dtype or 'dtype not recorded'}")
    if not isinstance(d, float):  # a NaN or Inf on one side
        return {"name": "numerical_defect", "why": f"{b.left.name} gives a non-finite difference ({values}) on equal inputs "
                                                  f"({shapes}): a kernel bug or a wrong setting"}
    hidden = _one_sided_jump(found, b)
    if hidden is not None and beyond(b) is not True:
        return {"name": "not_judged", "why": hidden}
    if tol is None:
        how = "--no-reference" if not doc["captured"].get("reference", True) else f"none evaluated for a {b.left.kind} module"
        return {"name": "not_judged", "why": f"no float64 reference ({how}): benign or bug is not judged"}
    if beyond(b):
        return {"name": "numerical_defect", "why": f"{b.left.name} ({b.left.kind}) differs by {d:.3g} on equal inputs, beyond "
                                                  f"tolerance {tol:.3g} ({shapes}; values {values}): a kernel bug or a "
                                                  "wrong setting" + _perturbed(doc, b)}
    same = [list(s) for s in b.left.input_shapes] == [list(s) for s in b.right.input_shapes]
    if b.left.kind not in REDUCTIONS:
        return {"name": "not_judged", "why": f"{b.left.name} is elementwise ({b.left.kind}) and differs within tolerance on "
                                            "equal inputs: another kernel or vector width, not a reduction order"}
    how = ("with equal operand shapes (threads, split sizes or kernel choice)" if same else
           f"whose operand shapes differ ({[list(s) for s in b.left.input_shapes]} vs {[list(s) for s in b.right.input_shapes]})")
    split = sharded.row_parallel(found, b.left.name)  # tensor parallelism: the capture's own record of the split
    if split is not None:
        how = sharded.how(split, b.left.name)
    nxt = ("the same tensor_parallel_size on both sides, or tier 1" if split is not None else
           "a batch-invariant kernel (--opt batch_invariant=true where the backend has it) or tier 1")
    cat = {"name": "reduction_order", "why": f"{b.left.name} ({b.left.kind}) is a reduction {how}, |Δ| {d:.3g} within "
                                            f"both sides' float64 error (tolerance {tol:.3g}): expected floating-point "
                                            f"behaviour; next: {nxt}"}
    return {**cat, "row_parallel": split} if split is not None else cat


class _Plain:
    """A verdict view without the way back through the cache (the category where the K/V were written)."""

    def __init__(self, found: Any) -> None:
        self.caps, self.pairs = found.caps, found.pairs
        self.verdict = type(found.verdict)(found.verdict.first_bitwise, found.verdict.first_beyond,
                                           found.verdict.first_differing)


def _what_differs(doc: dict[str, Any], sides: list[Any], b: Pair) -> list[str]:
    """The model identities, the recorded weight perturbation and the located module's parameters."""
    out = []
    ids = [s.side.run_config.get("model", {}) for s in sides]
    if len(ids) == 2 and ids[0].get("format") == ids[1].get("format"):  # the same format: its digests compare
        for key, what in (("weights_sha256", "weights"), ("config_sha256", "config")):
            a, c = ids[0].get(key), ids[1].get(key)
            if a and c and a != c:
                out.append(f"the model {what} differ ({key} {a[:12]} vs {c[:12]})")
    opts = [doc["left"].get("options", {}), doc["right"].get("options", {})]
    for key, o, other in (("left", opts[0], opts[1]), ("right", opts[1], opts[0])):
        p = o.get("perturb")
        if p and p != other.get("perturb") and ":weight:" in str(p):
            out.append(f"the {key} side's recorded options edit a weight (test-only perturb={p})")
    hashes = [param_hash(s, b.left.name.partition("/")[0]) for s in sides]
    if len(sides) == 2 and None not in hashes and hashes[0] != hashes[1]:
        out.append(f"the parameters of {b.left.name.partition('/')[0]} differ (sha256 {hashes[0][:12]} vs {hashes[1][:12]})")
    return out


def param_hash(rerun: Any, module: str) -> str | None:
    """sha256 of a torch module's parameters as loaded on this side (None: the engine holds no torch
    module of that name here, e.g. llama.cpp, or vLLM's fused ones)."""
    import hashlib

    import torch

    model = getattr(rerun.backend, "model", None)
    get = getattr(model, "get_submodule", None)
    if get is None:
        return None
    try:
        mod = get(module)
    except AttributeError:
        return None
    h = hashlib.sha256()
    for name, p in sorted(mod.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _perturbed(doc: dict[str, Any], b: Pair) -> str:
    for key in ("left", "right"):
        p = doc[key].get("options", {}).get("perturb")
        if p and str(p).startswith(b.left.name.partition("/")[0] + ":output"):
            return f" (here the {key} side's recorded test-only perturb={p}: the simulated defect)"
    return ""


def _one_sided_jump(found: Any, b: Pair) -> str | None:
    """Where the difference jumps, after `b`, inside computation that was not compared: an output whose
    input already differs JUMP times more than every compared output before it, while something was
    captured on one side only (another engine's attention core, say). `b`'s tolerance says nothing of it."""
    import numpy as np

    from .align import trailing

    names = {p.left.name for p in found.pairs}
    lone = [(key, t) for side, key in ((0, "left"), (1, "right")) for t in found.caps[side].tensors if t.name not in names]
    if not lone:
        return None
    seen = 0.0
    prev = b
    for p in (p for p in found.pairs if p.left.order > b.left.order):
        if p.inputs_equal is False and p.left.inputs and p.right.inputs:
            t = trailing(p.left.inputs[0], p.right.inputs[0])
            if t is not None and t[0].shape == t[1].shape and np.issubdtype(np.asarray(t[0]).dtype, np.floating):
                d_in = float(np.max(np.abs(np.asarray(t[0], np.float64) - np.asarray(t[1], np.float64)), initial=0.0))
                if np.isfinite(d_in) and d_in > JUMP * max(seen, b.metrics.get("max_abs_diff") or 0.0, 1e-30):
                    where = next((f"{t.name}, captured on the {k} side only" for k, t in lone if _between(k, prev, t, p)),
                                 None) or next((f"{t.name}, captured on the {k} side only" for k, t in lone
                                                if p.left.name.startswith(t.name + ".")),
                                               f"computation captured on one side only or on neither (e.g. {lone[0][1].name})")
                    return (f"the difference grows from {max(seen, b.metrics.get('max_abs_diff') or 0.0):.3g} (the largest compared "
                            f"output so far) to {d_in:.3g} at {p.left.name}'s input, inside {where}: not compared, never "
                            "read as benign")
        d = p.metrics.get("max_abs_diff")
        if isinstance(d, float) and p.output_equal is False:
            seen, prev = max(seen, d), p
    return None


def _between(key: str, prev: Pair, t: Any, p: Pair) -> bool:
    a, z = (prev.left, p.left) if key == "left" else (prev.right, p.right)
    return a.order < t.order < z.order
