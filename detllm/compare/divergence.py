"""First divergence between two traces of the same prompt, and the noise floors that
say whether it was a numeric tie.

Pure functions over trace records (dicts as written to trace.jsonl): no backend, no
torch. A divergence says where (generated-token index), what (both tokens, their
text, each side's logprob of both tokens, top-k and margin) and how big it was: its
`magnitude` (tie flip, confident flip, sampled step, tokens equal but logprobs differ),
judged against the noise floor of what actually ran (docs/causes.md#magnitude).

One NaN rule for check (records in memory) and diff (records read back), steps.finite: a
non-finite logprob is what the sanitised record holds on disk, null; null equals null and
differs from any number. A pair of compare/fast.py Views is scanned on its arrays there.
"""

from __future__ import annotations

import math
from typing import Any

from ..models.gguf import FLOAT_TYPES as FLOAT_GGUF  # GGUF types that store plain floats
from .steps import abs_diff, finite, topk_diff

# magnitude labels, most severe first (docs/causes.md#magnitude)
LABELS = ("confident_flip", "tie_flip", "sampled_step", "tokens_equal_logprobs_differ", "input_ids", "length",
          "unclassified", "identical")

# Margin (top-1 minus top-2 logprob, nats) below which a flipped top token is within
# the rounding noise of the dtype (docs/causes.md#noise-floors). Low-precision floors
# are one unit in the last place of a logit in [8, 16): bfloat16 2**-4, float16 2**-7.
# float32 logits round at ~1e-6; the floor allows for error grown through the layers
# (batch 1 vs 8 on the tiny model, CPU: |dlogprob| up to 6.4e-5).
NOISE_FLOORS = {"float32": 1e-4, "float16": 2.0**-7, "bfloat16": 2.0**-4, "quantized": 2.0**-4}


def noise_floor(dtype: str | None, quantization: str | None = None) -> float | None:
    """The noise floor for a run's compute dtype and weight quantization; None when the
    dtype is unknown ("auto" never resolved), so no flip is called a near tie."""
    floor = NOISE_FLOORS.get(dtype or "")
    if quantization:
        q = NOISE_FLOORS.get(FLOAT_GGUF.get(quantization.upper(), "quantized"))
        floor = q if floor is None else max(floor, q)  # the noisier of the two
    return floor


def run_noise_floor(asked_dtype: str, applied_settings: list[dict[str, Any]], quantization: str | None) -> float | None:
    """The one rule `check` and `diff` share: the dtype in effect (determinism_applied's `dtype`
    value where the backend recorded one, e.g. a GGUF's Q4_1; else the dtype asked for), the
    weights' quantization, and what else rounds activations on the way: llama.cpp's KV cache
    type (f16 by default, q8_0...) and flash attention switched on (half-precision accumulation
    on GPUs). The noisiest of them decides."""
    applied = applied_dtype(applied_settings)
    dtype = applied if applied in NOISE_FLOORS else asked_dtype
    floor = noise_floor(dtype, quantization)
    values = {s["name"]: s.get("value") for s in applied_settings}
    extra = []
    kv = values.get("kv_type")
    if isinstance(kv, str) and kv:
        extra.append(NOISE_FLOORS[FLOAT_GGUF.get(kv.upper(), "quantized")])
    if values.get("flash_attn") in ("on", True):
        extra.append(NOISE_FLOORS["float16"])
    if floor is None or not extra:
        return floor
    return max([floor, *extra])


def applied_dtype(applied_settings: list[dict[str, Any]]) -> str | None:
    """The `dtype` value a backend recorded in determinism_applied.json, if any."""
    value = next((s["value"] for s in applied_settings if s["name"] == "dtype"), None)
    return value if isinstance(value, str) and value else None


def _top(rec: dict[str, Any], i: int) -> list[list[Any]] | None:
    tops = rec.get("top_logprobs")
    return tops[i] if tops is not None and i < len(tops) else None


def _margin(top: list[list[Any]] | None) -> float | None:
    if not top or len(top) < 2 or finite(top[0][1]) is None or finite(top[1][1]) is None:
        return None
    return float(top[0][1]) - float(top[1][1])


def _lookup(top: list[list[Any]] | None, token_id: int | None) -> float | None:
    if top is None or token_id is None:
        return None
    return finite(next((lp for tid, lp in top if tid == token_id), None))


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


def _logprob_step(left: dict[str, Any], right: dict[str, Any], stop: int, atol: float) -> tuple[int, float] | None:
    """First step < stop whose chosen-token logprob or top-k differs by more than atol
    (bitwise when atol is 0), with that difference; None when all agree."""
    if hasattr(left, "payload") and hasattr(right, "payload"):  # compare/fast.py Views: the same on arrays
        from .fast import logprob_step

        got = logprob_step(left, right, stop, atol)  # type: ignore[arg-type]
        if got is not NotImplemented:
            return got
    la, lb = left.get("logprobs"), right.get("logprobs")
    if la is None or lb is None:
        return None
    ta, tb = left.get("top_logprobs") or [], right.get("top_logprobs") or []
    for i in range(min(stop, len(la), len(lb))):
        d = abs_diff(la[i], lb[i])
        top_a, top_b = (ta[i] if i < len(ta) else None), (tb[i] if i < len(tb) else None)
        if top_a != top_b:
            d = max(d, topk_diff(top_a, top_b, atol))
        if d > atol:
            return i, d
    return None


def _gap(s: dict[str, Any]) -> tuple[float | None, bool]:
    """(this side's logprob of its own token minus its logprob of the other side's token,
    whether that is a lower bound: the other token was below its top-k)."""
    own = finite(s["logprob"])
    if own is None:
        own = _lookup(s["top_logprobs"], s["token_id"])
    if own is None:
        return None, False
    if s["other_logprob"] is not None:
        return own - s["other_logprob"], False
    vals = [v for v in (finite(t[1]) for t in s["top_logprobs"] or []) if v is not None]
    return (own - min(vals), True) if vals else (None, False)


def magnitude(ls: dict[str, Any], rs: dict[str, Any], *, floor: float | None, sampled: bool) -> dict[str, Any]:
    """How big a token divergence at one step is. Greedy: each side's gap between the two
    competing tokens (its own minus the other side's token); a tie flip when both gaps are
    below the noise floor (any reordering of a sum can flip it), a confident flip when
    one is not. Sampled: the argmax margin means nothing; the two sampled tokens'
    probabilities on each side, and whether their log-ratio moved by more than the floor."""
    (gl, bl), (gr, br) = _gap(ls), _gap(rs)
    out: dict[str, Any] = {"gap": {"left": gl, "right": gr}, "gap_is_lower_bound": {"left": bl, "right": br},
                           "noise_floor": floor}
    known = gl is not None and gr is not None and not bl and not br
    if known:
        out["shift"] = gl + gr  # how far the log-ratio of the two tokens moved between the sides
    if sampled:
        probs = {}
        for name, s in (("left", ls), ("right", rs)):
            own = finite(s["logprob"])
            probs[name] = {"own": None if own is None else math.exp(own),
                           "other": None if s["other_logprob"] is None else math.exp(s["other_logprob"])}
        out.update(label="sampled_step", sampled=True, probabilities=probs)
        if known and floor is not None:
            out["distribution_moved"] = abs(gl + gr) > floor
        return out
    if gl is None or gr is None:
        return {**out, "label": "unclassified", "why": "no logprobs for the two tokens"}
    if floor is None:
        return {**out, "label": "unclassified", "why": "noise floor unknown (dtype in effect not recorded)"}
    if gl >= floor or gr >= floor:  # a lower bound at or above the floor is enough
        return {**out, "label": "confident_flip"}
    if bl or br:
        return {**out, "label": "unclassified", "why": "the other side's token is below a top-k: its gap is only bounded"}
    return {**out, "label": "tie_flip"}


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
    sampled: bool = False,
) -> dict[str, Any] | None:
    """The earliest point where two records of the same prompt differ, or None.
    `sampled`: the tokens were sampled (temperature > 0), so a flip is judged from the
    two sampled tokens' probabilities, not an argmax margin."""
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
            "magnitude": {"label": "input_ids", "noise_floor": noise_floor},
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
    mag = _classify(left, right, kind, i, tok_i, ls, rs, diff, noise_floor, sampled, left_label, right_label)
    return {
        **base,
        "kind": kind,
        "token_index": i,
        "common_prefix_text": "".join(left["token_texts"][:i]),
        "left": ls,
        "right": rs,
        "near_tie": mag["label"] == "tie_flip",
        "logprob_abs_diff": None if diff is None or diff == float("inf") else diff,
        "magnitude": mag,
    }


def _classify(left, right, kind, i, tok_i, ls, rs, diff, floor, sampled, left_label, right_label) -> dict[str, Any]:
    """The divergence's magnitude. A logprob divergence followed by a token flip in the same
    prompt is classified by that flip (its step in `token_index`), one followed by one side
    stopping earlier as that length divergence; only without either are the tokens equal."""
    a, b = left["token_ids"], right["token_ids"]
    if kind == "length":
        return {"label": "length", "token_index": i, "noise_floor": floor}
    if kind == "logprob" and tok_i is not None and tok_i >= min(len(a), len(b)):  # one side generated more
        return {"label": "length", "token_index": tok_i, "noise_floor": floor}
    if kind == "logprob" and tok_i is None:
        return {"label": "tokens_equal_logprobs_differ", "token_index": i, "noise_floor": floor,
                "abs_diff": None if diff is None or diff == float("inf") else diff,
                "within_noise": diff is not None and floor is not None and diff <= floor}
    if kind == "logprob":
        ls = side(left, tok_i, left_label, b[tok_i])
        rs = side(right, tok_i, right_label, a[tok_i])
    return {**magnitude(ls, rs, floor=floor, sampled=sampled), "token_index": tok_i if kind == "logprob" else i}
