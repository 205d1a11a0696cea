"""The figures every renderer prints beside each other, each named by its quantity: the chosen
token's |dlogprob| (what a comparison's drift maximum measures) or a top-k entry's (what a first
divergence's difference may be), so a maximum is never shown below a difference beside it; and a
share that never rounds up to 100% (or down to 0%) when it is not. Reads report dicts only.
"""

from __future__ import annotations

from typing import Any

from ..compare.steps import abs_diff


def _g(x: Any) -> str:
    return "?" if x is None else f"{x:.3g}"


def share(x: float) -> str:
    """A share as a percentage with one decimal, floored near the ends: 99.992% is "99.9%", never
    "100.0%", and 0.004% is "<0.1%", never "0.0%" (5 argmax flips never sit beside "100.0%")."""
    text = f"{x:.1%}"
    if x < 1.0 and text == "100.0%":
        return f"{int(x * 1000) / 10:.1f}%"  # floored at the precision shown: 99.9%
    if x > 0.0 and text == "0.0%":
        return "<0.1%"
    return text


def difference_parts(d: dict[str, Any]) -> tuple[float, Any] | None:
    """At a logprob divergence (the same token on both sides, its logprob or a top-k entry's moved):
    (the chosen token's |dlogprob|, the id of the top-k entry whose |dlogprob| is the divergence's
    difference, or None when the chosen token's is; "boundary" when the entry sits in one side's
    top-k only). None when the divergence records no finite difference."""
    diff = d.get("logprob_abs_diff")
    if diff is None or d.get("kind") != "logprob":
        return None
    chosen = abs_diff(d["left"].get("logprob"), d["right"].get("logprob"))
    if chosen >= diff:
        return chosen, None
    other = {t[0]: t[1] for t in d["right"].get("top_logprobs") or []}
    at = next((t[0] for t in d["left"].get("top_logprobs") or [] if t[0] in other and abs_diff(t[1], other[t[0]]) == diff),
              "boundary")
    return chosen, at


def difference_text(d: dict[str, Any], digits: str = ".3g") -> str:
    """The first divergence's |logprob difference|, with the quantity it is of ("" without one)."""
    parts = difference_parts(d)
    if parts is None:
        return ""
    chosen, at = parts
    figure = f"|logprob difference| {d['logprob_abs_diff']:{digits}}"
    if at is None:
        return f"{figure}, of the chosen token's logprob"
    entry = f"top-k entry id {at}'s logprob" if at != "boundary" else "a top-k entry's logprob (in one side's top-k only, against the other's k-th)"
    moved = "is equal" if chosen == 0.0 else f"differs by {chosen:.3g}"
    return f"{figure}, of a {entry}; the chosen token's logprob {moved}"


def topk_bound(comparison: dict[str, Any]) -> float | None:
    """The largest top-k entry |dlogprob| a comparison's divergences show, where it exceeds the
    chosen token's maximum over the comparison (None otherwise): what a maximum printed beside them
    must also name, so it is never below a difference shown. A lower bound of the top-k maximum
    (the drift measures the chosen token's only)."""
    found = [d["logprob_abs_diff"] for d in comparison.get("divergences") or []
             if (parts := difference_parts(d)) is not None and parts[1] is not None]
    top = max(found, default=None)
    chosen = (comparison.get("drift") or {}).get("max_abs_logprob_diff") or 0.0
    return top if top is not None and top > chosen else None


def maxima_text(comparison: dict[str, Any]) -> str:
    """`max |dlogprob| of chosen tokens X` of a comparison's drift, and `, of top-k entries >=Y` when
    a divergence shows a larger top-k entry difference ("" when nothing moved)."""
    dr = comparison.get("drift") or {}
    if not dr.get("available"):
        return ""
    chosen = dr.get("max_abs_logprob_diff")
    bound = topk_bound(comparison)
    parts = [f"max |dlogprob| of chosen tokens {_g(chosen)}"] if chosen else []
    if bound is not None:
        parts.append(f"of top-k entries >={_g(bound)}" if parts else f"max |dlogprob| of top-k entries >={_g(bound)}")
    return ", ".join(parts)


__all__ = ["difference_parts", "difference_text", "maxima_text", "share", "topk_bound"]
