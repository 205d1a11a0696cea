"""BATCH_VARIANCE, CACHE_VARIANCE and PROCESS_VARIANCE, and the evidence of run variance: batch
sizes and composition, the settings that follow them, what each record says about how it was
computed (the server's batch and prefix cache, a fresh process), and where the outputs diverged.
Does not decide when variance is the cause (classifier.py).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .sides import Routed, Side, cut, lr


def _batch_mates(records: list[dict[str, Any]]) -> dict[tuple[str, int], tuple[int, frozenset[str]]]:
    """(prompt_id, occurrence) -> (batch position, ids of the prompts sharing its batch),
    with the runner's batching: consecutive prompt indexes, batch_size at a time."""
    groups: dict[int, set[str]] = defaultdict(set)
    for r in records:
        groups[r["prompt_index"] // r["batch_size"]].add(r["prompt_id"])
    seen: dict[str, int] = defaultdict(int)
    out = {}
    for r in sorted(records, key=lambda r: r["prompt_index"]):
        out[(r["prompt_id"], seen[r["prompt_id"]])] = (r["batch_position"], frozenset(groups[r["prompt_index"] // r["batch_size"]]))
        seen[r["prompt_id"]] += 1
    return out


def _served(left: Side, right: Side) -> dict[str, Any] | None:
    """Each side's batching as the server reported it (backend openai), None when neither side has it."""
    served = {side: server_batching(s.records) for side, s in (("left", left), ("right", right))}
    return served if any(served.values()) else None


def batch_variance(left: Side, right: Side, routed: Routed | None = None) -> dict[str, Any] | None:
    """The batch size, the batch composition, a setting that follows them, or the batch the server
    reported computing (the same batch size run in another shape by the server) differs."""
    changed = None
    if left.records is not None and right.records is not None:
        lm, rm = _batch_mates(left.records), _batch_mates(right.records)
        changed = sum(1 for k in lm if k in rm and lm[k] != rm[k])
    derived = routed.batch if routed is not None else []
    served = _served(left, right)
    server_differs = served_batch_differs(served)
    if left.batch_size == right.batch_size and not changed and not derived and not server_differs:
        return None
    ev: dict[str, Any] = {"batch_size": lr(left.batch_size, right.batch_size),
                          "batch_sizes": sorted({left.batch_size, right.batch_size})}
    if changed is not None:
        ev["composition_changed"] = changed  # aligned prompts whose batch position or batch mates differ
    if derived:
        ev["derived"] = cut(derived)  # settings that follow the batch sizes (slots, max_num_seqs)
    if served:
        ev["server_batching"] = served  # backend openai: what the server itself reported while the requests were in flight
    return ev


def co_batched(served: dict[str, Any] | None) -> int | None:
    """Requests the server was seen computing beyond our own in flight (a lower bound: /slots is
    sampled); None when not sampled. Our own requests explain up to `in_flight` busy slots."""
    busy = (served or {}).get("server_busy_max")
    if not isinstance(busy, int) or isinstance(busy, bool):
        return None
    return max(0, busy - int((served or {}).get("in_flight") or 0))


def served_batch_differs(served: dict[str, Any] | None) -> bool:
    """The server computed our requests beside another number of other requests on the two sides.
    Busy counts our own in-flight requests explain (0 vs 1 busy with 1 in flight: the sampler
    missed or caught our own request) are no difference; an unsampled side is unknown, never different."""
    if not served:
        return False
    extra = [co_batched(s) for s in served.values()]
    return len(extra) == 2 and None not in extra and extra[0] != extra[1]


def served_busy_rule_changed(served: dict[str, Any] | None) -> bool:
    """True where detllm's earlier rule (any difference in sampled busy counts) called the served batch
    different and served_batch_differs does not: verify accepts a verdict sealed under that rule."""
    if not served:
        return False
    busy = [(s or {}).get("server_busy_max") for s in served.values()]
    return len(busy) == 2 and None not in busy and busy[0] != busy[1] and not served_batch_differs(served)


def _cached(rec: dict[str, Any]) -> int | None:
    """Prompt tokens the server said it served from its prefix cache for this record; None: not reported."""
    ev = rec.get("evidence")
    n = ev.get("cached_prompt_tokens") if isinstance(ev, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def cache_variance(left: Side, right: Side, pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any] | None:
    """CACHE_VARIANCE: the server reused a different number of cached prompt tokens for the same prompt
    on the two sides (a reused prefix is computed in other batch shapes than a fresh one). A count one
    side did not report is unknown, never a difference."""
    known = [(a, b) for a, b in pairs if _cached(a) is not None and _cached(b) is not None]
    differ = [(a, b) for a, b in known if _cached(a) != _cached(b)]
    if not differ:
        return None
    sides: dict[str, Any] = {}
    for i, (name, side) in enumerate((("left", left), ("right", right))):
        n = sum(_cached(p[i]) or 0 for p in known)
        key = side.label if left.label != right.label else f"{side.label} ({name})"
        sides[key] = {"side": "cold" if n == 0 else "warm", "cached_prompt_tokens": n, "prompts": len(known)}
    return {"sides": sides, "prompts_with_different_cache": len(differ),
            "examples": [{"prompt_index": a["prompt_index"], "cached_prompt_tokens": lr(_cached(a), _cached(b))}
                         for a, b in differ[:3]]}


def process_variance(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any] | None:
    """PROCESS_VARIANCE: one side's records were generated in a fresh process (check --fresh-process),
    the other's in the check's own: what is fixed per process (the loaded engine, kernel choices,
    allocator and thread-pool state) differs."""
    def kind(r: dict[str, Any]) -> str:
        return "fresh-process" if r.get("fresh_process") else "in-process"

    differ = [(a, b) for a, b in pairs if kind(a) != kind(b)]
    if not differ:
        return None
    return {"process": lr(kind(differ[0][0]), kind(differ[0][1])), "prompts_differing": len(differ)}


def server_batching(records: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """A served backend's batching evidence over a selection (trace evidence.server_batch): requests
    in flight and the most the server reported computing at once. None when nothing was recorded."""
    groups = {(r["run_index"], r["batch_size"], r["prompt_index"] // r["batch_size"]): r["evidence"]["server_batch"]
              for r in records or () if isinstance(r.get("evidence"), dict) and isinstance(r["evidence"].get("server_batch"), dict)}
    batches = list(groups.values())  # one per group of requests sent together (its records share it)
    if not batches:
        return None
    busy = [b["server_busy_max"] for b in batches if isinstance(b.get("server_busy_max"), int)]  # not sampled: unknown
    return {"in_flight": max(b["in_flight"] for b in batches), "source": batches[0].get("source"),
            "samples": sum(b.get("samples", 0) for b in batches), "server_busy_max": max(busy) if busy else None}


def divergence_summary(comp: dict[str, Any]) -> dict[str, Any]:
    d = comp["first_divergence"]
    return {
        "prompts_diverged": comp["prompts_diverged"],
        "first": None if d is None else {"prompt_index": d["prompt_index"], "token_index": d["token_index"],
                                         "kind": d["kind"], "near_tie": d["near_tie"],
                                         "magnitude": (d.get("magnitude") or {}).get("label", "unclassified")},
    }
