"""The graft: the causal test of a located op. The right side's recorded batch is re-run through the
same capture with the left side's captured output of that op substituted (its row, its positions, at
the captured step; `both`: the reverse too), and the grafted re-run is compared with the other side:
confirmed (the logits agree bitwise, or the first divergent token no longer diverges: `confirmed_by`),
partial (another op downstream differs: named), one of many (the next op differs from the same cause,
reduction order: counted) or not the cause (nothing changes). Through cached K/V it is judged at the
step where the traces differ (graftlater.py).
"""

from __future__ import annotations

import time
from typing import Any

from ..backends.base import CaptureSpec, Graft
from ..core.errors import UsageError
from .align import pair_up
from .category import REDUCTIONS
from .graftlater import judge_later, later_step
from .rule import beyond, judge

MODES = ("right", "both", "off")
OUTCOMES = ("confirmed", "partial", "one_of_many", "not_the_cause", "not_grafted")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise UsageError(f"--graft is one of {', '.join(MODES)}, got {mode!r}")
    return mode


def graft(doc: dict[str, Any], sides: list[Any], found: Any, *, mode: str, reference: bool, bound: int) -> None:
    """Graft the left side's output of the located op (found.verdict.first_bitwise) into the right
    side's re-run (`both`: and the right's into the left's) and record `graft` in `doc`."""
    b = found.verdict.first_bitwise if found is not None else None
    if mode == "off" or b is None:
        return
    step = doc["captured_step"]
    t0 = time.perf_counter()
    rec: dict[str, Any] = {"op": b.left.name, "step": step, "requested": mode, "reruns": 0,
                           "positions": _positions(doc, step)}
    for into in (("right", "left") if mode == "both" else ("right",)):
        rec[f"into_{into}"] = _one(sides, found, b.left.name, into=into, step=step, reference=reference, bound=bound, rec=rec,
                                 doc=doc)
    rec["seconds"] = round(time.perf_counter() - t0, 3)
    doc["graft"] = rec


def _positions(doc: dict[str, Any], step: int) -> str:
    if "prefill" in doc:  # --prefill: the decode's one position at step s against the prefill's last
        return (f"the position compared: the decode's step {step} and the prefill's last position (which predicts token {step}); "
                "the prefill's other positions and the K/V the decode cached at earlier steps are not grafted")
    return ("every position of the prompt (prefill)" if step == 0 else
            "the step's one new position; the K/V cached at earlier steps are not grafted")


def _one(sides, found, name: str, *, into: str, step: int, reference: bool, bound: int, rec: dict, doc: dict) -> dict[str, Any]:
    dst, src = (1, 0) if into == "right" else (0, 1)
    r = sides[dst]
    if r.backend is None or not getattr(r.backend, "grafts", False):
        return {"outcome": "not_grafted", "why": getattr(r.backend, "no_graft_why", None)
                or f"backend {r.config.backend!r} does not graft yet (hf, vLLM and llama.cpp do); the located op "
                   "is where the bits part, not proven to be the cause"}
    value = next((t.output for t in found.caps[src].tensors if t.name == name), None)
    if value is None:
        return {"outcome": "not_grafted", "why": f"{name} was not captured on the {('left', 'right')[src]} side"}
    cfg, applied = r.config, r.side.applied
    level = found.caps[dst].level
    if level == "ops" and "/" not in name:  # a module grafted: its consumers compared at module level (no float64 per op)
        level = "modules"
    spec = CaptureSpec(step=step if r.fixed_step is None else r.fixed_step, row=r.row, level=level,
                       max_bytes=bound // 2, reference=reference, warm_up=tuple(tuple(w) for w in r.warm),
                       in_pass_kv=r.in_pass_kv, graft=Graft(name, value), run_to=later_step(doc, step),
                       ops_through=doc["captured"].get("ops_through") if level == "ops" else None)  # as the search's capture
    with r.backend.determinism(tier=applied["tier_effective"], seed=cfg.seed, threads=cfg.threads):
        cap = r.backend.capture(r.requests, cfg.decoding, seed=cfg.seed, n_logprobs=cfg.logprobs, spec=spec)
    rec["reruns"] += 1
    note = next((n for n in cap.notes if n.startswith(f"grafted {name}:")), "")
    if "written 0 time" in note or not note:
        return {"outcome": "not_grafted", "why": note or "the backend did not say it grafted"}
    if spec.run_to is not None:  # through cached K/V: judged where the traces differ (graftlater.py)
        return {**judge_later(sides, cap, dst, spec.run_to, name, step), "written": note}
    caps = [found.caps[0], cap] if into == "right" else [cap, found.caps[1]]
    rows = (len(sides[0].requests), len(sides[1].requests))
    after, _, _ = pair_up(caps[0].tensors, caps[1].tensors, rows, kv="prefill" not in doc)  # as the search paired them
    return {**_outcome(found, after, name, cap, dst, _token(doc, cap, r.row, spec.step, into)), "written": note}


def _token(doc: dict[str, Any], cap: Any, row: int, at: int, into: str) -> dict[str, Any] | None:
    """The first divergent token before and after the graft, where the step's difference is a token
    (a prefill's: the token the prefill chose) at the captured step; None otherwise."""
    s = doc.get("step") or {}
    if s.get("what") == "token":
        left, right = s["left"], s["right"]
    elif s.get("what") == "prefill" and s.get("token") != s.get("prefill_token"):
        left, right = s.get("token"), s.get("prefill_token")
    else:
        return None
    ids = list(cap.generations[row].token_ids) if row < len(cap.generations) else []
    if doc.get("captured_step") != s.get("step") or len(ids) <= at or not isinstance(left, int) or not isinstance(right, int):
        return None
    other, before = (left, right) if into == "right" else (right, left)
    return {"step": s["step"], "other_side": other, "before": before, "after": int(ids[at])}


def _logits(pairs) -> Any:
    return next((p for p in reversed(pairs) if p.left.kind == "logits"), None)


def _outcome(found, after, name: str, cap, dst: int, token: dict[str, Any] | None = None) -> dict[str, Any]:
    """The four outcomes, from the logits pair before and after the graft, the first divergent token
    (`token`, where the step's difference is one) and the ops that still differ."""
    import numpy as np

    before_l, after_l = _logits(found.pairs), _logits(after)
    if before_l is None or after_l is None:
        return {"outcome": "not_grafted", "why": "the logits were not captured on both sides: the graft cannot be judged"}
    d0 = _diff(before_l)
    d1 = _diff(after_l)
    own = [p for p in after if p.output_equal is False and p.inputs_equal is True and p.left.name != name]
    base = {"logits_max_abs_diff_before": d0, "logits_max_abs_diff_after": d1,
            "ops_differing_before": sum(1 for p in found.pairs if p.output_equal is False and p.inputs_equal is True),
            "ops_differing_after": len(own)}
    base = {k: v for k, v in base.items() if v is not None}
    if token is not None:
        base["token"] = token
    if after_l.output_equal:
        return {"outcome": "confirmed", "confirmed_by": "logits", **base,
                "why": f"with {name} grafted the logits agree bitwise: this op's difference is the whole divergence at this step"}
    if token is not None and token["after"] == token["other_side"]:
        still = own[0].left.name if own else None
        return {"outcome": "confirmed", "confirmed_by": "token", **base,
                "why": f"with {name} grafted the first divergent token no longer diverges (step {token['step']}: "
                       f"{token['before']} -> {token['after']}, the other side's); the logits still differ by {_g(d1)}"
                       + (f" ({len(own)} other captured output(s) differ on equal inputs, first {still})" if still else "")}
    old = (found.caps[dst].tensors, cap.tensors)
    lg = [next((t.output for t in ts if t.name == after_l.left.name), None) for ts in old]
    if lg[0] is not None and lg[1] is not None and np.asarray(lg[0]).tobytes() == np.asarray(lg[1]).tobytes():
        nxt = own[0] if own else None
        if nxt is not None:
            base["next_op"] = _next(nxt)
        return {"outcome": "not_the_cause", **base, "why": f"with {name} grafted the logits did not change at all"
                + (f": its difference never reaches them; the next op that differs on equal inputs is {nxt.left.name}" if nxt else "")}
    shrink = (d0 / d1) if isinstance(d0, float) and isinstance(d1, float) and d1 > 0 else None
    base["shrink"] = shrink
    nxt = own[0] if own else judge(after).first_differing
    if nxt is None:
        return {"outcome": "partial", **base, "next_op": None,
                "why": "the logits still differ, but no captured op does: the rest entered through what was not grafted "
                       "or captured (cached K/V of earlier steps)"}
    base["next_op"] = _next(nxt)
    if _same_cause(found.verdict.first_bitwise, nxt, own):
        return {"outcome": "one_of_many", **base,
                "why": f"after the graft {nxt.left.name} differs too on equal inputs ({len(own)} captured output(s) in all), from the "
                       "same cause: " + ("reductions over operands of other shapes (batch rows, padding)" if _shapes_differ(nxt)
                                         else "reductions within tolerance on equal shapes")}
    return {"outcome": "partial", **base,
            "why": f"the divergence {_x(shrink)} but remains: {nxt.left.name} differs on its own downstream"}


def _next(nxt) -> dict[str, Any]:
    return {"module": nxt.left.name, "kind": nxt.left.kind, "max_abs_diff": nxt.metrics.get("max_abs_diff"),
            "beyond_tolerance": beyond(nxt), "inputs_equal": nxt.inputs_equal}


def _same_cause(b, nxt, own) -> bool:
    """Reduction order in every reduction: the next op with equal inputs is a reduction whose operand
    shapes differ as the located op's do (batch rows, padding), or both are within tolerance on
    equal shapes (threads). An op beyond tolerance on equal shapes is a cause of its own."""
    if not own or nxt.left.kind not in REDUCTIONS:
        return False
    if _shapes_differ(b) and _shapes_differ(nxt):
        return True
    return not _shapes_differ(b) and not _shapes_differ(nxt) and beyond(b) is False and beyond(nxt) is False


def _diff(p) -> Any:
    return 0.0 if p.output_equal else p.metrics.get("max_abs_diff")


def _shapes_differ(p) -> bool:
    return [list(s) for s in p.left.input_shapes] != [list(s) for s in p.right.input_shapes]


def _g(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _x(v: Any) -> str:
    if not isinstance(v, float):
        return "changes by an unmeasured factor"
    return f"shrinks by {v:.3g}x" if v >= 1 else f"grows by {1 / v:.3g}x"
