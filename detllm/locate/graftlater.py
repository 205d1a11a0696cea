"""The graft judged at a later step: where the difference entered through cached K/V (locate went back
to the step that wrote them), the logits at the grafted step already agree, so the grafted re-run
runs on to the step where the recorded traces first differ, and its token and logprob there are
compared with both sides' recorded ones: confirmed (the other side's, bitwise), not the cause (still
this side's, bitwise) or partial (moved: by how much). graft.py makes the re-run; this judges it.
"""

from __future__ import annotations

from typing import Any


def later_step(doc: dict[str, Any], step: int) -> int | None:
    """The step the grafted re-run must reach to be judged (None: the grafted step itself)."""
    s = (doc.get("step") or {}).get("step")
    return s if isinstance(s, int) and s > step and "prefill" not in doc else None


def judge_later(sides: list[Any], cap: Any, dst: int, at: int, name: str, step: int) -> dict[str, Any]:
    """The outcome from the grafted re-run's generation at step `at` against both recorded traces."""
    r, other = sides[dst], sides[1 - dst]
    mine, theirs = r.recorded.get(r.row), other.recorded.get(other.row)
    gen = cap.generations[r.row] if r.row < len(cap.generations) else None
    if mine is None or theirs is None or gen is None or len(gen.token_ids) <= at:
        return {"outcome": "not_grafted", "why": f"the grafted re-run did not reach step {at}, where the traces differ"}
    now = (int(gen.token_ids[at]), _at(gen.logprobs, at))
    was, want = (_rec(mine, at), _rec(theirs, at))
    base = {"judged_at_step": at, "logprob_before": was[1], "logprob_after": now[1], "logprob_other_side": want[1]}
    base = {k: v for k, v in base.items() if v is not None or k == "judged_at_step"}
    where = (f"grafted at step {step}, where the logits already agreed; the difference reached the logits at step {at} "
             "through the K/V written there")
    if now == want:
        return {"outcome": "confirmed", "confirmed_by": "later_step", **base,
                "why": f"{where}: with {name} grafted, step {at}'s token and logprob are the other side's, bitwise"}
    if now == was:
        return {"outcome": "not_the_cause", **base, "why": f"{where}: with {name} grafted, step {at}'s token and logprob did not change"}
    shrink = None
    if None not in (was[1], now[1], want[1]) and now[1] != want[1]:
        shrink = abs(was[1] - want[1]) / abs(now[1] - want[1])
    return {"outcome": "partial", **base, "shrink": shrink, "next_op": None,
            "why": f"{where}: with {name} grafted, step {at}'s " + (f"logprob moved from {was[1]!r} to {now[1]!r} (the other side's "
                                                                   f"{want[1]!r})" if now[0] == want[0] else
                                                                   f"token is {now[0]} (this side's {was[0]}, the other's {want[0]})")
                   + ": something else differs too"}


def _rec(record: dict[str, Any], at: int) -> tuple[int | None, float | None]:
    ids = record.get("token_ids") or []
    return (int(ids[at]) if at < len(ids) else None, _at(record.get("logprobs"), at))


def _at(values: Any, at: int) -> float | None:
    return float(values[at]) if values is not None and at < len(values) and values[at] is not None else None
