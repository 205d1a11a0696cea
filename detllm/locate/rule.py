"""The root-cause rule of `locate`: the first op, in execution order, whose inputs agree bitwise
(cached K/V included) but whose output differs. A difference that entered from upstream is not
that op's; one that entered through cached K/V sends the search back to the step that wrote them.

Tolerance is relative to what ran: each side's error against the same op evaluated in float64 on
the same inputs (`ref_error`). With equal inputs |Δ| <= e_left + e_right always, so the test is
whether one side is further from float64 than FACTOR times the other is (the idea of
torch._dynamo.utils.same), plus one unit in the last place of the output's magnitude.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .align import Pair

FACTOR = 4.0  # |Δ| > FACTOR * min(e_left, e_right) + 1 ulp: one side is >= 3x further from float64 than the other
BOUNDARY_KINDS = ("embedding", "layer", "logits")  # the growth table's rows after the located op


@dataclass
class Verdict:
    """What the rule found at one captured step."""

    first_bitwise: Pair | None
    first_beyond: Pair | None
    first_differing: Pair | None  # the first output that differs at all, whatever its inputs
    back_to: int | None = None  # the step whose K/V carried the difference in (search there next)


def evaluated(t: Any) -> float | None:
    """t's float64 reference error, evaluated now where the capture left it for later (hf: `reeval`)."""
    if t.ref_error is None and getattr(t, "reeval", None) is not None:
        t.reeval()
    return t.ref_error


def tolerance(p: Pair, *, evaluate: bool = True) -> float | None:
    """FACTOR * the smaller float64-reference error of the two sides, plus 1 ulp at the output's
    magnitude; None when either side's reference error was not evaluated (`evaluate=False`: one
    left for later is not evaluated now)."""
    import numpy as np

    el, er = (evaluated(p.left), evaluated(p.right)) if evaluate else (p.left.ref_error, p.right.ref_error)
    if el is None or er is None:
        return None
    out = np.asarray(p.left.output)
    dtype = out.dtype if np.issubdtype(out.dtype, np.floating) else np.dtype(np.float32)
    mags = [abs(v) for v in (p.metrics.get("left_value"), p.metrics.get("right_value")) if isinstance(v, float)]
    finite = np.abs(out.astype(np.float64))
    finite = finite[np.isfinite(finite)]
    scale = min(max([float(finite.max()) if finite.size else 0.0] + mags), float(np.finfo(dtype).max))
    with np.errstate(over="ignore"):  # the spacing at float32's largest value is infinite: use the one below it
        ulp = float(np.spacing(dtype.type(scale)))
    if not np.isfinite(ulp):
        ulp = float(np.spacing(np.nextafter(dtype.type(scale), dtype.type(0))))
    return FACTOR * min(el, er) + ulp


def beyond(p: Pair) -> bool | None:
    tol = tolerance(p)
    d = p.metrics.get("max_abs_diff")
    if tol is None or d is None:
        return None
    return not isinstance(d, float) or d > tol  # a non-finite difference (written as a string) is beyond any tolerance


def judge(pairs: list[Pair], *, evaluate: bool = True) -> Verdict:
    """Apply the rule to one step's aligned pairs (execution order). `evaluate=False`: no float64
    reference is evaluated and first_beyond is left None (a verdict only asked where to search next)."""
    differing = [p for p in pairs if p.output_equal is False]
    first = differing[0] if differing else None
    own = [p for p in differing if p.inputs_equal is True]
    verdict = Verdict(own[0] if own else None, next((p for p in own if beyond(p)), None) if evaluate else None, first)
    first = _through_cache(differing) or first
    if first is not None and first.inputs_equal is False and first.kv_equal is False and not _other_inputs_differ(first):
        steps = [first.kv_step] if first.kv_step is not None else \
            [s for s in (first.left.cached_from_step, first.right.cached_from_step) if s is not None]
        if steps and (verdict.first_bitwise is None or verdict.first_bitwise.left.order > first.left.order):
            verdict.back_to = min(steps)
    return verdict


def _through_cache(differing: list[Pair]) -> Pair | None:
    """The first differing attention whose cached K/V differ, where every output that differs before
    it is its own child's (modules complete before their parent: hf's o_proj before its self_attn)."""
    for p in differing:
        if p.kv_equal is False:
            return p
        if not any(p.left.name.startswith(q.left.name + ".") for q in differing if q.kv_equal is False):
            return None
    return None


def _other_inputs_differ(p: Pair) -> bool:
    """Whether an input other than the cached K/V (the first input: the op's fresh activations) differs."""
    from .align import bitwise_equal, trailing

    from .align import is_kv

    if not p.left.inputs or not p.right.inputs or len(p.left.inputs) != len(p.right.inputs):
        return True
    for n, (x, y) in enumerate(zip(p.left.inputs, p.right.inputs)):
        if is_kv(p.left, n) or is_kv(p.right, n):
            continue
        t = trailing(x, y)
        if t is None or not bitwise_equal(t[0], t[1]):
            return True
    return False


def op_json(p: Pair | None, *, prompt: int, step: int) -> dict[str, Any] | None:
    """A located op for locate.json: its module path, kind, where, shapes on each side, max |Δ|."""
    if p is None:
        return None
    return {
        "module": p.left.name, "kind": p.left.kind, "prompt": prompt, "step": step,
        "input_shapes": {"left": [list(s) for s in p.left.input_shapes], "right": [list(s) for s in p.right.input_shapes]},
        "output_shape": {"left": list(p.left.output_shape), "right": list(p.right.output_shape)},
        "max_abs_diff": p.metrics.get("max_abs_diff"), "at": p.metrics.get("at"),
        "left_value": p.metrics.get("left_value"), "right_value": p.metrics.get("right_value"),
        "ref_error": {"left": evaluated(p.left), "right": evaluated(p.right)}, "tolerance": tolerance(p),
    }


def row_json(p: Pair) -> dict[str, Any]:
    """One row of the per-layer table."""
    row = {"module": p.left.name, "kind": p.left.kind, "order": p.left.order, "output_equal": p.output_equal,
           "inputs_equal": p.inputs_equal, "shapes_match": p.shapes_match, "padding_trimmed": p.trimmed,
           "inputs_inferred": p.inputs_inferred,
           "output_shape": {"left": list(p.left.output_shape), "right": list(p.right.output_shape)}}
    if p.kv_equal is not None:
        row["cached_kv_equal"] = p.kv_equal
        row["cached_from_step"] = {"left": p.left.cached_from_step, "right": p.right.cached_from_step}
    row.update(p.metrics)
    row["tolerance"] = tolerance(p, evaluate=False)  # the rows the rule judged (the rest: float64 not evaluated, null)
    row["beyond_tolerance"] = (beyond(p) if row["tolerance"] is not None else None) if p.output_equal is False else False
    return row


def growth(pairs: list[Pair], start: Pair | None) -> list[dict[str, Any]]:
    """From the located op to the logits: that op, then each layer boundary and the logits after it."""
    if start is None:
        return []
    rows = [start] + [p for p in pairs if p.left.order > start.left.order and p.left.kind in BOUNDARY_KINDS]
    return [{"module": p.left.name, "kind": p.left.kind, "max_abs_diff": p.metrics.get("max_abs_diff"),
             "mean_abs_diff": p.metrics.get("mean_abs_diff"), "rel_diff": p.metrics.get("rel_diff"),
             "rel_l2": p.metrics.get("rel_l2")} for p in rows]
