"""First divergence between two traces of the same prompt, and the noise floors that
say whether it was a numeric tie.

Pure functions over trace records (dicts as written to trace.jsonl): no backend, no
torch. A divergence says where (generated-token index), what (both tokens, their
text, each side's logprob of both tokens, top-k and margin) and how close it was.
"""

from __future__ import annotations

from typing import Any

# Margin (top-1 minus top-2 logprob, nats) below which a flipped top token is within
# the rounding noise of the dtype (docs/causes.md#noise-floors). Low-precision floors
# are one unit in the last place of a logit in [8, 16): bfloat16 2**-4, float16 2**-7.
# float32 logits round at ~1e-6; the floor allows for error grown through the layers
# (batch 1 vs 8 on the tiny model, CPU: |dlogprob| up to 6.4e-5).
NOISE_FLOORS = {"float32": 1e-4, "float16": 2.0**-7, "bfloat16": 2.0**-4, "quantized": 2.0**-4}
# GGUF file types that store plain floats; anything else (Q4_1, Q8_0, IQ...) is quantized
_FLOAT_GGUF = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def noise_floor(dtype: str | None, quantization: str | None = None) -> float | None:
    """The noise floor for a run's compute dtype and weight quantization; None when the
    dtype is unknown ("auto" never resolved), so no flip is called a near tie."""
    floor = NOISE_FLOORS.get(dtype or "")
    if quantization:
        q = NOISE_FLOORS.get(_FLOAT_GGUF.get(quantization.upper(), "quantized"))
        floor = q if floor is None else max(floor, q)  # the noisier of the two
    return floor


def run_noise_floor(asked_dtype: str, applied_settings: list[dict[str, Any]], quantization: str | None) -> float | None:
    """The one rule `check` and `diff` share: the dtype in effect (determinism_applied's `dtype`
    value where the backend recorded one, e.g. a GGUF's Q4_1; else the dtype asked for) and the
    weights' quantization."""
    applied = applied_dtype(applied_settings)
    dtype = applied if applied in NOISE_FLOORS else asked_dtype
    return noise_floor(dtype, quantization)


def applied_dtype(applied_settings: list[dict[str, Any]]) -> str | None:
    """The `dtype` value a backend recorded in determinism_applied.json, if any."""
    value = next((s["value"] for s in applied_settings if s["name"] == "dtype"), None)
    return value if isinstance(value, str) and value else None


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
    return next((lp for tid, lp in top if tid == token_id), None)


def side(rec: dict[str, Any], i: int, label: str, other_token: int | None) -> dict[str, Any]:
    """One side of a divergence at generated-token index i (token None: it had ended)."""
    ids, texts, lps = rec["token_ids"], rec["token_texts"], rec.get("logprobs")
    top = _top(rec, i)
    return {
        "label": label,
        "token_id": ids[i] if i < len(ids) else None,
        "token_text": texts[i] if i < len(texts) else None,
        "logprob": lps[i] if lps is not None and i < len(lps) else None,
        "other_logprob": _lookup(top, other_token),
        "margin": _margin(top),
        "top_logprobs": top,
    }


def _abs(x: Any, y: Any) -> float:
    if x == y:
        return 0.0
    if x is None or y is None:
        return float("inf")
    return abs(float(x) - float(y))


def _topk_diff(ta: list[list[Any]] | None, tb: list[list[Any]] | None) -> float:
    """Largest |logprob difference| over the top-k ids; inf when the ids differ."""
    if ta == tb:
        return 0.0
    if ta is None or tb is None:
        return float("inf")
    da, db = dict((t[0], t[1]) for t in ta), dict((t[0], t[1]) for t in tb)
    if da.keys() != db.keys():
        return float("inf")
    return max(_abs(da[k], db[k]) for k in da)


def _logprob_step(left: dict[str, Any], right: dict[str, Any], stop: int, atol: float) -> tuple[int, float] | None:
    """First step < stop whose chosen-token logprob or top-k differs by more than atol
    (bitwise when atol is 0), with that difference; None when all agree."""
    la, lb = left.get("logprobs"), right.get("logprobs")
    if la is None or lb is None:
        return None
    ta, tb = left.get("top_logprobs") or [], right.get("top_logprobs") or []
    for i in range(min(stop, len(la), len(lb))):
        d = _abs(la[i], lb[i])
        top_a, top_b = (ta[i] if i < len(ta) else None), (tb[i] if i < len(tb) else None)
        if top_a != top_b:
            d = max(d, _topk_diff(top_a, top_b))
        if d > atol:
            return i, d
    return None


def _first_difference(a: list[Any] | None, b: list[Any] | None) -> int | None:
    if a is None or b is None:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def first_token_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing generated token (or where one side stopped), or None."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return None if len(a) == len(b) else n
    return next(i for i in range(n) if a[i] != b[i])


def first_divergence(
    left: dict[str, Any],
    right: dict[str, Any],
    *,
    comparison: str,
    left_label: str,
    right_label: str,
    check_logprobs: bool,
    atol: float = 0.0,
    noise_floor: float | None = None,
) -> dict[str, Any] | None:
    """The earliest point where two records of the same prompt differ, or None."""
    base = {"comparison": comparison, "prompt_index": left["prompt_index"], "prompt_id": left["prompt_id"],
            "noise_floor": noise_floor}
    if left["input_ids_sha256"] != right["input_ids_sha256"]:
        la, lb = left.get("input_ids"), right.get("input_ids")
        return {
            **base, "kind": "input_ids", "token_index": 0, "common_prefix_text": "",
            "left": side(left, len(left["token_ids"]), left_label, None),
            "right": side(right, len(right["token_ids"]), right_label, None),
            "near_tie": False, "logprob_abs_diff": None,
            "input_ids": {"left": la, "right": lb, "first_difference": _first_difference(la, lb)},
        }
    a, b = left["token_ids"], right["token_ids"]
    tok_i = first_token_difference(a, b)
    stop = tok_i if tok_i is not None else min(len(a), len(b))
    lp = _logprob_step(left, right, stop, atol) if check_logprobs else None
    if lp is not None:
        i, kind, diff = lp[0], "logprob", lp[1]
    elif tok_i is not None:
        i, kind, diff = tok_i, ("token" if tok_i < min(len(a), len(b)) else "length"), None
    else:
        return None
    ls = side(left, i, left_label, b[i] if i < len(b) else None)
    rs = side(right, i, right_label, a[i] if i < len(a) else None)
    margins = [m for m in (ls["margin"], rs["margin"]) if m is not None]
    return {
        **base,
        "kind": kind,
        "token_index": i,
        "common_prefix_text": "".join(left["token_texts"][:i]),
        "left": ls,
        "right": rs,
        "near_tie": kind == "token" and noise_floor is not None and bool(margins) and min(margins) < noise_floor,
        "logprob_abs_diff": None if diff is None or diff == float("inf") else diff,
    }
