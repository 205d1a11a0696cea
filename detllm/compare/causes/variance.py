"""BATCH_VARIANCE and the evidence of run variance: batch sizes and composition, the settings
that follow them, a served backend's own account of its batching and prefix cache, and where
the outputs diverged. Does not decide when variance is the cause (classifier.py).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from ..engine import parse_label, select
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


def batch_variance(left: Side, right: Side, routed: Routed | None = None) -> dict[str, Any] | None:
    changed = None
    if left.records is not None and right.records is not None:
        lm, rm = _batch_mates(left.records), _batch_mates(right.records)
        changed = sum(1 for k in lm if k in rm and lm[k] != rm[k])
    derived = routed.batch if routed is not None else []
    if left.batch_size == right.batch_size and not changed and not derived:
        return None
    ev: dict[str, Any] = {"batch_size": lr(left.batch_size, right.batch_size),
                          "batch_sizes": sorted({left.batch_size, right.batch_size})}
    if changed is not None:
        ev["composition_changed"] = changed  # aligned prompts whose batch position or batch mates differ
    if derived:
        ev["derived"] = cut(derived)  # settings that follow the batch sizes (slots, max_num_seqs)
    served = {side: server_batching(s.records) for side, s in (("left", left), ("right", right))}
    if any(served.values()):
        ev["server_batching"] = served  # backend openai: what the server itself reported while the requests were in flight
    return ev


def add_server_evidence(report: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """A check of a served backend (openai): a check's sides carry no records, so the server's own
    account is added here from the trace's evidence: BATCH_VARIANCE gets what the server said about
    its batch (server_batching), RUN_VARIANCE the prompt tokens it served from its prefix cache on
    each side (server_cache: different counts point at CACHE_VARIANCE, see check --cache-probe)."""
    if not records or not isinstance(records[0].get("evidence"), dict):
        return
    by_name = {c["name"]: c for c in report.get("comparisons", [])}
    for cause in report.get("causes", []) + report.get("info", []):
        comps = [by_name[n] for n in cause["evidence"].get("comparisons", []) if n in by_name]
        if not comps or cause["code"] not in ("BATCH_VARIANCE", "RUN_VARIANCE"):
            continue
        sides = {}
        for side in ("left", "right"):  # a cause merged over several levels sums up all of their sides
            labels = {parse_label(c[side]) for c in comps}
            sides[side] = [r for run, batch in sorted(labels) for r in select(records, run=run, batch=batch)]
        if cause["code"] == "BATCH_VARIANCE":
            served = {side: server_batching(recs) for side, recs in sides.items()}
            if any(served.values()):
                cause["evidence"]["server_batching"] = served
            continue
        cached = {side: sum((r.get("evidence") or {}).get("cached_prompt_tokens") or 0 for r in recs) for side, recs in sides.items()}
        if cached["left"] != cached["right"]:
            cause["evidence"]["server_cache"] = {"cached_prompt_tokens": cached,
                                                 "note": "the server reused cached prompt tokens on one side: likely CACHE_VARIANCE "
                                                         "(detllm check --cache-probe tells)"}


def server_batching(records: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """A served backend's batching evidence over a selection (trace evidence.server_batch): requests
    in flight and the most the server reported computing at once. None when nothing was recorded."""
    groups = {(r["run_index"], r["batch_size"], r["prompt_index"] // r["batch_size"]): r["evidence"]["server_batch"]
              for r in records or () if isinstance(r.get("evidence"), dict) and isinstance(r["evidence"].get("server_batch"), dict)}
    batches = list(groups.values())  # one per group of requests sent together (its records share it)
    if not batches:
        return None
    busy = [b["server_busy_max"] for b in batches if "server_busy_max" in b]
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
