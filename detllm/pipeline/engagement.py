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
from ..core.overlap import ENGAGED, NOT_ENGAGED, NOT_OBSERVABLE, served_group


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


def _served(side: list[dict[str, Any]], b: int) -> dict[str, Any] | None:
    if not side or not any("server_batch" in _ev(r) or "timing_ms" in _ev(r) for r in side):
        return None
    answers = [(served_group([_ev(r) for r in g]), g) for g in _groups(side, b) if len(g) >= 2]
    if not answers:
        return None
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


def _mode(records: list[dict[str, Any]], comp: dict[str, Any]) -> dict[str, Any]:
    """Tier 3: proof from the process that served the check that the batch-invariant mode ran for both sides."""
    both = _side(records, comp["left"]) + _side(records, comp["right"])
    modes = [_ev(r).get("mode") for r in both]
    if not both or any(not isinstance(m, dict) for m in modes):
        return _answer(NOT_OBSERVABLE, "mode", "the engine reported nothing about its batch-invariant mode per batch")
    idle = sum(1 for m in modes if not m.get("linear_calls"))
    if idle:
        return _answer(NOT_ENGAGED, "mode", f"{idle} of {len(modes)} records were computed without the batch-invariant kernels "
                       f"running ({modes[0].get('seen_by')})", "the mode was not live: check --opt batch_invariant=true")
    calls = min(m["linear_calls"] for m in modes)
    return _answer(ENGAGED, "mode", f"the batch-invariant kernels ran for every record (at least {calls} invariant linear calls "
                   f"per batch; {modes[0].get('seen_by')})")


_ORDER = {NOT_ENGAGED: 0, NOT_OBSERVABLE: 1, ENGAGED: 2}


def judge(comp: dict[str, Any], records: list[dict[str, Any]], probe: bool = False, tier: int = 1) -> dict[str, Any] | None:
    """The engagement of one comparison; None where nothing was varied (an in-process repeat). At tier 3
    a batch comparison also needs the mode's live proof: the weaker of the two answers is kept."""
    if probe:
        return _cache(records, comp)
    if comp["kind"] == "run":
        return _fresh(records, comp) if comp.get("repeat") == "fresh-process" else None
    b = parse_label(comp["right"])[1]
    side = _side(records, comp["right"])
    got = _rows(side, b) or _served(side, b) or _answer(
        NOT_OBSERVABLE, "batch size", f"the engine reported nothing about which of the {b} requests it computed together")
    if tier < 3 or not comp.get("logprobs_compared"):
        return got
    mode = _mode(records, comp)
    if _ORDER[mode["answer"]] < _ORDER[got["answer"]]:
        return mode
    return {**got, "evidence": f"{got['evidence']}; mode: {mode['evidence']}"}


def _bound(c: dict[str, Any], config: RunConfig) -> dict[str, Any]:
    """The comparison's bound over all its prompts; under --fill-prompts also the user's and the fillers' apart."""
    n, conf = c["prompts_compared"], config.confidence
    out: dict[str, Any] = {"upper": round(bound(n, conf), 6), "confidence": conf, "prompts": n}
    if config.user_prompts is not None and "prompts" in c:
        split = {"yours": [i for i in c["prompts"] if i < config.user_prompts],
                 "fillers": [i for i in c["prompts"] if i >= config.user_prompts]}
        diverged = {d["prompt_index"] for d in c.get("divergences", ())}
        out["fillers"] = {k: {"prompts": len(v), "diverged": sum(1 for i in v if i in diverged),
                              "upper": round(bound(len(v), conf), 6)} for k, v in split.items()}
    return out


def apply(report: dict[str, Any], records: list[dict[str, Any]], config: RunConfig, probe: bool = False) -> dict[str, Any]:
    """Add each comparison's engagement and bound, the check's weakest bound, and UNVERIFIED where it follows."""
    if report["status"] == "RECORDED":
        return report
    unverified, unseen = [], []
    for c in report["comparisons"]:
        c["bound"] = _bound(c, config)
        e = judge(c, records, probe, tier=report["tier"]["effective"])
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
        if config.max_rate is not None:  # met only by the prompts the user chose, plus fillers when asked for
            report["bound"]["max_rate"] = {"rate": config.max_rate, "met": weakest["bound"]["upper"] <= config.max_rate
                                           and weakest["status"] == "PASS",
                                           "by": "your prompts plus seeded fillers (--fill-prompts)"
                                           if config.user_prompts is not None else "your prompts"}
    if report["status"] == "PASS" and unverified:
        report["status"], report["category"] = "UNVERIFIED", "UNVERIFIED"
    return report


__all__ = ["ENGAGED", "NOT_ENGAGED", "NOT_OBSERVABLE", "apply", "bound", "judge", "needed", "served_group"]
