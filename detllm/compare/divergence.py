"""First divergence between two traces of the same prompt.

Pure functions over trace records (dicts as written to trace.jsonl): no backend,
no torch. A divergence says where (generated-token index), what (both tokens,
their text and logprobs, each side's margin) and how close the decision was.
"""

from __future__ import annotations

from typing import Any

# Below this top-1/top-2 logprob margin a flip is within the dtype's rounding noise
# (see docs/causes.md): "a numeric tie flipped" rather than "the distribution moved".
NOISE_FLOORS = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2, "auto": 1e-4, "gguf": 5e-2}


def noise_floor(dtype: str | None) -> float | None:
    return NOISE_FLOORS.get(dtype or "", None)


def _top(rec: dict[str, Any], i: int) -> list[list[Any]] | None:
    tops = rec.get("top_logprobs")
    return tops[i] if tops is not None and i < len(tops) else None


def _margin(top: list[list[Any]] | None) -> float | None:
    if not top or len(top) < 2 or top[0][1] is None or top[1][1] is None:
        return None
    return float(top[0][1]) - float(top[1][1])


def _lookup(top: list[list[Any]] | None, token_id: int | None) -> float | None:
    if top is None or token_id is None:
        return None
    for tid, lp in top:
        if tid == token_id:
            return lp
    return None


def side(rec: dict[str, Any], i: int, label: str, other_token: int | None) -> dict[str, Any]:
    ids, texts, lps = rec["token_ids"], rec["token_texts"], rec.get("logprobs")
    tok = ids[i] if i < len(ids) else None
    top = _top(rec, i)
    return {
        "label": label,
        "token_id": tok,
        "token_text": texts[i] if i < len(texts) else None,
        "logprob": lps[i] if lps is not None and i < len(lps) else None,
        "other_logprob": _lookup(top, other_token),
        "margin": _margin(top),
        "top_logprobs": top,
    }


def _logprob_step(a: list[Any] | None, b: list[Any] | None, n: int, atol: float) -> tuple[int, float] | None:
    """First step < n whose chosen-token logprobs differ by more than atol (bitwise when 0)."""
    if a is None or b is None:
        return None
    for i in range(min(n, len(a), len(b))):
        x, y = a[i], b[i]
        if x == y:
            continue
        if x is None or y is None:
            return i, float("inf")
        d = abs(float(x) - float(y))
        if d > atol:
            return i, d
    return None


def first_divergence(
    left: dict[str, Any],
    right: dict[str, Any],
    *,
    comparison: str,
    left_label: str,
    right_label: str,
    check_logprobs: bool,
    atol: float = 0.0,
    dtype: str | None = None,
) -> dict[str, Any] | None:
    """The earliest point where two records of the same prompt differ, or None."""
    floor = noise_floor(dtype)
    base = {
        "comparison": comparison,
        "prompt_index": left["prompt_index"],
        "prompt_id": left["prompt_id"],
        "noise_floor": floor,
    }
    if left["input_ids_sha256"] != right["input_ids_sha256"]:
        return {
            **base,
            "kind": "input_ids",
            "token_index": 0,
            "common_prefix_text": "",
            "left": side(left, len(left["token_ids"]), left_label, None),
            "right": side(right, len(right["token_ids"]), right_label, None),
            "near_tie": False,
            "logprob_abs_diff": None,
            "input_ids": {"left": left.get("input_ids"), "right": right.get("input_ids")},
        }
    a, b = left["token_ids"], right["token_ids"]
    n = min(len(a), len(b))
    tok_i = next((i for i in range(n) if a[i] != b[i]), None)
    if tok_i is None and len(a) != len(b):
        tok_i, kind = n, "length"
    else:
        kind = "token"
    lp = _logprob_step(left.get("logprobs"), right.get("logprobs"), n if tok_i is None else tok_i, atol) if check_logprobs else None
    if lp is not None:
        i, kind, diff = lp[0], "logprob", lp[1]
    elif tok_i is not None:
        i, diff = tok_i, None
    else:
        return None
    ls = side(left, i, left_label, b[i] if i < len(b) else None)
    rs = side(right, i, right_label, a[i] if i < len(a) else None)
    if diff is None and ls["logprob"] is not None and rs["logprob"] is not None:
        diff = abs(float(ls["logprob"]) - float(rs["logprob"]))
    margins = [m for m in (ls["margin"], rs["margin"]) if m is not None]
    near_tie = kind == "token" and floor is not None and bool(margins) and min(margins) < floor
    return {
        **base,
        "kind": kind,
        "token_index": i,
        "common_prefix_text": "".join(left["token_texts"][:i]),
        "left": ls,
        "right": rs,
        "near_tie": near_tie,
        "logprob_abs_diff": None if diff == float("inf") else diff,
    }
