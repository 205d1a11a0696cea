"""Whether each comparison of a check engaged the axis it varied, and how much its PASS proves.

Owns the three answers per comparison (engaged / not_engaged / not_observable, from the
per-record evidence the backends traced: the rows one forward computed together, the server's
busy slots and its own per-request times against the client's request intervals, the fresh
child's pid, the cache probe's warm side), the check status they give (UNVERIFIED: a required
comparison shown not engaged, or not observable under --require-engagement, and none FAILed),
and the one-sided binomial bound on each PASS. Reads trace records only; verify re-derives
the same through checkverdict.check_verdict.
"""

from __future__ import annotations

import math
from typing import Any

from ..compare.engine import parse_label
from ..core.config import RunConfig

ENGAGED, NOT_ENGAGED, NOT_OBSERVABLE = "engaged", "not_engaged", "not_observable"


def bound(n: int, confidence: float = 0.95) -> float:
    """The exact one-sided upper bound on the per-prompt divergence rate after 0 divergences in n
    prompts (Clopper-Pearson at k = 0): 1 - (1 - confidence)^(1/n); 1.0 with no prompt."""
    return 1.0 if n <= 0 else 1.0 - (1.0 - confidence) ** (1.0 / n)


def needed(rate: float, confidence: float = 0.95) -> int:
    """Prompts a PASS needs (no divergence) for its bound to reach below `rate`: R = 0.05 at 95% needs 59."""
    return math.ceil(math.log(1.0 - confidence) / math.log(1.0 - rate) - 1e-9)


def _side(records: list[dict[str, Any]], label: str) -> list[dict[str, Any]]:
    run, batch = parse_label(label)
    return [r for r in records if r["run_index"] == run and r["batch_size"] == batch]


def _ev(rec: dict[str, Any]) -> dict[str, Any]:
    ev = rec.get("evidence")
    return ev if isinstance(ev, dict) else {}


def _answer(answer: str, axis: str, evidence: str, fix: str | None = None) -> dict[str, Any]:
    return {"axis": axis, "answer": answer, "evidence": evidence, **({"fix": fix} if fix else {})}


def _rows(side: list[dict[str, Any]], b: int) -> dict[str, Any] | None:
    """Local engines: the rows each record was computed with (the padded batch shape per forward)."""
    rows = [(_ev(r).get("computed_with") or {}).get("rows") for r in side]
    if not side or any(not isinstance(n, int) for n in rows):
        return None
    seen = sorted({(_ev(r)["computed_with"].get("seen_by") or "the engine") for r in side})
    lo = min(rows)
    if lo >= 2:
        return _answer(ENGAGED, "batch size", f"every record of batch {b} was computed in forwards of at least {lo} rows "
                       f"({', '.join(seen)})")
    alone = sum(1 for n in rows if n < 2)
    return _answer(NOT_ENGAGED, "batch size", f"{alone} of {len(rows)} records of batch {b} were computed alone "
                   f"({', '.join(seen)})", "give the engine a batch it computes together")


def _groups(side: list[dict[str, Any]], b: int) -> list[list[dict[str, Any]]]:
    """The records of one group in flight at once (the runner sends prompts b at a time, in order)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for r in side:
        out.setdefault(r["prompt_index"] // b, []).append(r)
    return [out[k] for k in sorted(out)]


def served_group(group: list[dict[str, Any]]) -> tuple[str, str]:
    """(answer, why) for one group of concurrent requests: engaged when the client's intervals overlapped
    and the server computed more than one at once (several busy slots sampled, or its own per-request
    times adding up past the group's wall time: disjoint ones cannot); not engaged when its times add
    up to no more than the wall time, or it reports fewer slots than requests in flight; else not observable."""
    spans = [tuple(_ev(r).get("timing_ms") or ()) for r in group]
    batch = _ev(group[0]).get("server_batch") or {}
    server_ms = [_ev(r).get("server_ms") for r in group]
    if len(group) < 2 or any(len(s) != 2 for s in spans):
        return NOT_OBSERVABLE, "the client's request intervals were not recorded"
    wall = max(e for _, e in spans) - min(s for s, _ in spans)
    overlapped = max(s for s, _ in spans) < min(e for _, e in spans)
    busy = batch.get("server_busy_max")
    slots = batch.get("server_slots")
    total = sum(server_ms) if all(isinstance(x, (int, float)) for x in server_ms) else None
    told = (f"{len(group)} requests, client intervals {'overlapped' if overlapped else 'did not all overlap'}, wall "
            f"{wall:.1f} ms" + (f", server times summing to {total:.1f} ms" if total is not None else "")
            + (f", at most {busy} busy in {batch.get('samples', 0)} {batch.get('source')} samples" if busy is not None else ""))
    if isinstance(slots, int) and slots < len(group):
        return NOT_ENGAGED, f"{told}; the server reports {slots} slot(s)"
    if total is not None and total <= wall:
        return NOT_ENGAGED, f"{told}: the server computed them one after another"
    if overlapped and ((busy or 0) >= 2 or (total is not None and total > wall)):
        return ENGAGED, told
    return NOT_OBSERVABLE, told


def _served(side: list[dict[str, Any]], b: int) -> dict[str, Any] | None:
    if not side or not any("server_batch" in _ev(r) or "timing_ms" in _ev(r) for r in side):
        return None
    answers = [(served_group(g), g) for g in _groups(side, b)]
    for key in (NOT_ENGAGED, NOT_OBSERVABLE):
        hit = [(why, g) for (a, why), g in answers if a == key]
        if hit:
            fix = f"the server never computed {b} requests at once: start it with more slots (llama-server -np >= {b}, " \
                  f"vLLM --max-num-seqs >= {b})" if key == NOT_ENGAGED else None
            return _answer(key, "concurrency", f"{len(hit)} of {len(answers)} groups: {hit[0][0]}", fix)
    return _answer(ENGAGED, "concurrency", f"all {len(answers)} groups computed together; first: {answers[0][0][1]}")


def _fresh(records: list[dict[str, Any]], comp: dict[str, Any]) -> dict[str, Any]:
    left, right = _side(records, comp["left"]), _side(records, comp["right"])
    lp = {_ev(r).get("pid") for r in left} - {None}
    rp = {_ev(r).get("pid") for r in right} - {None}
    if not right or not all(r.get("fresh_process") for r in right):
        return _answer(NOT_ENGAGED, "fresh process", "the repeat's records do not say they ran in a new process")
    if not rp or not lp:
        return _answer(NOT_OBSERVABLE, "fresh process", "the repeat ran in a new process, but no pid was recorded")
    if lp & rp:
        return _answer(NOT_ENGAGED, "fresh process", f"the repeat ran in process {sorted(lp & rp)[0]}, the reference's")
    return _answer(ENGAGED, "fresh process", f"pid {sorted(rp)[0]} vs the reference's pid {sorted(lp)[0]}")


def _cache(records: list[dict[str, Any]], comp: dict[str, Any]) -> dict[str, Any]:
    right = _side(records, comp["right"])
    got = [_ev(r).get("cached_prompt_tokens") for r in right]
    known = [n for n in got if isinstance(n, int) and not isinstance(n, bool)]
    if not known:
        return _answer(NOT_OBSERVABLE, "prefix cache", "the server reported no cached prompt tokens")
    if sum(known) == 0:
        return _answer(NOT_ENGAGED, "prefix cache", f"the {comp['name'].split(' vs ')[0]} side read 0 cached prompt tokens "
                       f"over {len(known)} prompts", "serve with the prefix cache on (llama-server: cache_prompt=true)")
    return _answer(ENGAGED, "prefix cache", f"{sum(known)} cached prompt tokens read over {len(known)} prompts")


def judge(comp: dict[str, Any], records: list[dict[str, Any]], probe: bool = False) -> dict[str, Any] | None:
    """The engagement of one comparison; None where nothing was varied (an in-process repeat)."""
    if probe:
        return _cache(records, comp)
    if comp["kind"] == "run":
        return _fresh(records, comp) if comp.get("repeat") == "fresh-process" else None
    b = parse_label(comp["right"])[1]
    side = _side(records, comp["right"])
    got = _rows(side, b) or _served(side, b)
    return got or _answer(NOT_OBSERVABLE, "batch size", f"the engine reported nothing about which of the {b} requests it "
                          "computed together")


def apply(report: dict[str, Any], records: list[dict[str, Any]], config: RunConfig, probe: bool = False) -> dict[str, Any]:
    """Add each comparison's engagement and bound, the check's weakest bound, and UNVERIFIED where it follows."""
    if report["status"] == "RECORDED":
        return report
    unverified, unseen = [], []
    for c in report["comparisons"]:
        c["bound"] = {"upper": round(bound(c["prompts_compared"], config.confidence), 6), "confidence": config.confidence,
                      "prompts": c["prompts_compared"]}
        e = judge(c, records, probe)
        if e is None:
            continue
        c["engagement"] = e
        if c["required"] and c["status"] == "PASS":
            if e["answer"] == NOT_ENGAGED or (e["answer"] == NOT_OBSERVABLE and config.require_engagement):
                unverified.append(c["name"])
            elif e["answer"] == NOT_OBSERVABLE:
                unseen.append(c["name"])
    req = [c for c in report["comparisons"] if c["required"]]
    weakest = max(req, key=lambda c: c["bound"]["upper"], default=None)
    report["engagement"] = {"unverified": unverified, "not_observable": unseen,
                            "required": config.require_engagement, "strict": config.mode == "strict"}
    if weakest is not None:
        report["bound"] = {**weakest["bound"], "comparison": weakest["name"]}
    if report["status"] == "PASS" and unverified:
        report["status"], report["category"] = "UNVERIFIED", "UNVERIFIED"
    return report


__all__ = ["ENGAGED", "NOT_ENGAGED", "NOT_OBSERVABLE", "apply", "bound", "judge", "needed", "served_group"]
