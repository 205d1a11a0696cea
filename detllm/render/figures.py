"""The figures every renderer prints beside each other, each named by its quantity: the chosen
token's |dlogprob| (what a comparison's drift maximum measures) or a top-k entry's (what a first
divergence's difference may be), so a maximum is never shown below a difference beside it; and a
share that never rounds up to 100% (or down to 0%) when it is not. Reads report dicts only.
"""

from __future__ import annotations

from typing import Any

from ..compare.steps import abs_diff, finite


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


def apart(a: Any, b: Any, least: int = 6) -> tuple[str, str]:
    """Two logprobs printed side by side: with `least` significant digits, or as many more as it takes
    (up to the shortest exact form) for two different values never to print alike ("null" for None)."""
    if a is None or b is None or a == b:
        return ("null" if a is None else f"{a:.{least}g}"), ("null" if b is None else f"{b:.{least}g}")
    for n in range(least, 18):
        x, y = f"{a:.{n}g}", f"{b:.{n}g}"
        if x != y:  # grown past `least`: both with n digits, trailing zeros kept (-1.958450, not -1.95845)
            return (x, y) if n == least else (f"{a:#.{n}g}", f"{b:#.{n}g}")
    return repr(a), repr(b)


def differing_entry(d: dict[str, Any]) -> dict[str, Any] | None:
    """At a logprob divergence, the logprob whose difference is the divergence's, as the compare
    measured it (steps.topk_diff: the common top-min(k), an id in one side's top-k only against the
    other's k-th): {"id", "chosen" (the chosen token's own logprob, not a top-k entry), "left",
    "right" (None: below that side's top-k, or null), "only" ("left"/"right": the side whose top-k
    alone holds the id), "kth" (the other side's k-th value then), "abs"}; id None when one side
    recorded no top-k at the step ("only" the side that did). None elsewhere."""
    if d.get("kind") != "logprob":
        return None
    left, right = d["left"], d["right"]
    target = d.get("logprob_abs_diff")
    target = float("inf") if target is None else target
    found = [{"id": left["token_id"], "chosen": True, "left": left.get("logprob"), "right": right.get("logprob"),
              "only": None, "kth": None, "abs": abs_diff(left.get("logprob"), right.get("logprob"))}]
    ta, tb = left.get("top_logprobs"), right.get("top_logprobs")
    if (ta is None) != (tb is None) and target == float("inf") and found[0]["abs"] != target:
        side = "left" if ta is not None else "right"  # one side recorded no top-k at this step: every entry differs
        return {"id": None, "chosen": False, "left": None, "right": None, "only": side, "kth": None, "abs": target}
    if ta and tb:
        k = min(len(ta), len(tb))
        da, db = {t[0]: finite(t[1]) for t in ta[:k]}, {t[0]: finite(t[1]) for t in tb[:k]}
        found += [{"id": i, "chosen": False, "left": da[i], "right": db[i], "only": None, "kth": None, "abs": abs_diff(da[i], db[i])}
                  for i in da if i in db]
        for side, mine, other in (("left", da, db), ("right", db, da)):
            kth = min((v for v in other.values() if v is not None), default=None)
            for i in (i for i in mine if i not in other):
                gap = float("inf") if mine[i] is None or kth is None or target == float("inf") else mine[i] - kth
                found.append({"id": i, "chosen": False, "left": mine[i] if side == "left" else None,
                              "right": mine[i] if side == "right" else None, "only": side, "kth": kth, "abs": gap})
    exact = [e for e in found if e["abs"] == target]
    return exact[0] if exact else max(found, key=lambda e: e["abs"])


def entry_text(d: dict[str, Any]) -> str:
    """The differing entry: both sides' values, printed apart, and the signed difference right
    minus left ("" without one)."""
    e = differing_entry(d)
    if e is None:
        return ""
    if e["id"] is None:
        other = "right" if e["only"] == "left" else "left"
        return f"the top-k: recorded on the {e['only']}, none on the {other}"
    name = "the chosen token's logprob" if e["chosen"] else f"top-k entry id {e['id']}'s logprob"
    if e["only"] is not None:
        other = "right" if e["only"] == "left" else "left"
        mine = e[e["only"]]
        if e["kth"] is None or mine is None:
            return f"{name}: {apart(mine, None)[0]} on the {e['only']}, not in the {other}'s top-k"
        bound = e["kth"] - mine if e["only"] == "left" else mine - e["kth"]
        return (f"{name}: {apart(mine, e['kth'])[0]} on the {e['only']}, not in the {other}'s top-k (whose last is "
                f"{apart(mine, e['kth'])[1]}; right - left {'<=' if e['only'] == 'left' else '>='} {bound:+.3g})")
    lv, rv = apart(e["left"], e["right"])
    delta = "" if e["left"] is None or e["right"] is None else f" (right - left = {e['right'] - e['left']:+.3g})"
    return f"{name}: {lv} vs {rv}{delta}"


def chosen_logprobs(d: dict[str, Any]) -> tuple[str | None, str | None]:
    """The two sides' chosen-token logprobs as printed beside each other: apart when both sides chose
    the same token (so two different values never print alike), else each on its own."""
    lp = [d[s].get("logprob") for s in ("left", "right")]
    if d["left"]["token_id"] == d["right"]["token_id"] and None not in lp:
        return apart(*lp)
    return tuple(None if x is None else f"{x:.6g}" for x in lp)  # type: ignore[return-value]


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
    e = differing_entry(d)
    return chosen, ("boundary" if e is None or e["only"] is not None or e["chosen"] else e["id"])


def difference_text(d: dict[str, Any], digits: str = ".3g") -> str:
    """The first divergence's |logprob difference|, with the quantity it is of and the entry itself:
    both sides' values and the signed difference ("" at a divergence that is not of logprobs)."""
    entry = entry_text(d)
    if not entry:
        return ""
    parts = difference_parts(d)
    if parts is None:  # no finite difference: a null against a number, or a top-k id on one side only
        return f"logprob difference at {entry}"
    chosen, at = parts
    figure = f"|logprob difference| {d['logprob_abs_diff']:{digits}}"
    if at is None:
        return f"{figure}, of {entry}"
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


__all__ = ["apart", "chosen_logprobs", "difference_parts", "difference_text", "differing_entry", "entry_text", "maxima_text",
           "share", "topk_bound"]
