"""What a probe showed: the divergence signature of a run folder at the tier the user asked for,
and whether a probe's divergence persists, vanishes or moves against the failing baseline.

Owns judging records only (through compare/engine.py); never runs an engine. The tier is the
*requested* one: when a backend downgraded tier 3 to 2, batch logprob drift still counts.
"""

from __future__ import annotations

from typing import Any

from ..compare.engine import compare, label, select

OUTCOMES = ("persist", "vanish", "move")


def _summary(comp: dict[str, Any], kind: str, batch: int) -> dict[str, Any]:
    first = comp["first_divergence"]
    dr = comp["drift"]
    return {
        "name": comp["name"], "kind": kind, "batch_size": batch,
        "diverged": comp["status"] != "PASS",
        "prompts_compared": comp["prompts_compared"], "prompts_diverged": comp["prompts_diverged"],
        "first": None if first is None else {"prompt_index": first["prompt_index"], "token_index": first["token_index"],
                                             "kind": first["kind"]},
        "max_abs_logprob_diff": dr.get("max_abs_logprob_diff") if dr.get("available") else None,
        "argmax_flips": dr.get("argmax_flips", 0) if dr.get("available") else 0,
    }


def comparisons(records: list[dict[str, Any]], *, tier: int, atol: float = 0.0, base_batch: int | None = None,
                runs: int | None = None) -> list[dict[str, Any]]:
    """Repeats against run 0 at the base batch size, and every other batch size against batch 1,
    each judged at `tier`: tokens from tier 1, logprobs of repeats from tier 2, logprobs across
    batch sizes from tier 3 (as check does at the tier asked for)."""
    batches = sorted({r["batch_size"] for r in records})
    base = base_batch if base_batch in batches else batches[0]
    runs = runs or 1 + max((r["run_index"] for r in records if r["batch_size"] == base), default=0)
    out = []
    ref = select(records, run=0, batch=base)
    for r in range(1, runs):
        c = compare(ref, select(records, run=r, batch=base), name=f"run_{r} vs run_0 @ batch {base}", kind="run",
                    left_label=label(0, base), right_label=label(r, base), required=True, check_logprobs=tier >= 2, atol=atol)
        out.append(_summary(c, "run", base))
    if 1 in batches:
        one = select(records, run=0, batch=1)
        for b in batches:
            if b == 1:
                continue
            c = compare(one, select(records, run=0, batch=b), name=f"batch {b} vs batch 1", kind="batch",
                        left_label=label(0, 1), right_label=label(0, b), required=True, check_logprobs=tier >= 3, atol=atol)
            out.append(_summary(c, "batch", b))
    return out


def _max_lp(comps: list[dict[str, Any]]) -> float | None:
    lps = [c["max_abs_logprob_diff"] for c in comps if c["max_abs_logprob_diff"] is not None]
    return max(lps) if lps else None


def signature(comps: list[dict[str, Any]]) -> dict[str, Any]:
    """The divergence in a few numbers: which kinds diverged, the earliest divergence, the
    largest |dlogprob| over aligned steps of the comparisons that diverged (a comparison the tier
    accepts is not the divergence: its drift is `passing_max_abs_logprob_diff`), and argmax flips."""
    bad = [c for c in comps if c["diverged"]]
    firsts = [c["first"] for c in bad if c["first"] is not None]
    first = min(firsts, key=lambda f: (f["prompt_index"], f["token_index"])) if firsts else None
    return {
        "diverged": bool(bad),
        "kinds": sorted({c["kind"] for c in bad}),
        "diverged_batch_sizes": sorted({c["batch_size"] for c in bad if c["kind"] == "batch"}),
        "first": first,
        "max_abs_logprob_diff": _max_lp(bad),
        "passing_max_abs_logprob_diff": _max_lp([c for c in comps if not c["diverged"]]),
        "argmax_flips": sum(c["argmax_flips"] for c in comps),
        "prompts_diverged": max((c["prompts_diverged"] for c in bad), default=0),
    }


def outcome(probe: dict[str, Any], baseline: dict[str, Any]) -> str:
    """vanish: the probe's check diverges nowhere (a divergence that only moved to another
    comparison, say from batch sizes to repeats, did not vanish); persist: the same kinds diverge
    at the same first position with a |dlogprob| within 2x; move: it still diverges, but differently."""
    if not probe["diverged"]:
        return "vanish"
    same_first = probe["first"] == baseline["first"]
    a, b = probe["max_abs_logprob_diff"], baseline["max_abs_logprob_diff"]
    close = (a is None) == (b is None) and (a is None or b == 0 or 0.5 <= a / b <= 2.0)
    return "persist" if same_first and close and set(probe["kinds"]) == set(baseline["kinds"]) else "move"


__all__ = ["OUTCOMES", "comparisons", "outcome", "signature"]
