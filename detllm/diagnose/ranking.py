"""Ranking a diagnosis: one entry per knob with its verdict (follows, vanishes, moves,
not_followed), a one-line summary of its evidence, and the plain-words conclusion.

Owns wording and order only; the probes' outcomes come from evidence.py.
"""

from __future__ import annotations

from typing import Any


def rank_knobs(results: list[dict[str, Any]], baseline: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per knob: follows (the divergence comes with it), vanishes (setting it removes
    the divergence), moves (it changes the divergence), not_followed; in that order, and within a
    verdict a knob that takes back the user's own setting (evidence.undoes) before a new setting."""
    knobs: dict[str, dict[str, Any]] = {}
    undone: set[str] = set()
    order = {"follows": 0, "vanishes": 1, "moves": 2, "not_followed": 3}
    base_lp = baseline.get("max_abs_logprob_diff") or 0.0
    for r in results:
        if r["status"] != "ran" or r["kind"] == "prefill":
            continue
        verdict = {"follows": "follows", "vanish": "vanishes" if r["kind"] == "check" else "not_followed",
                   "move": "moves", "persist": "not_followed"}[r["outcome"]]
        if verdict == "vanishes" and (r["evidence"].get("confirmation") or {}).get("status") == "failed":
            verdict = "moves"  # it vanished once, then diverged in a fresh-process confirmation
        k = knobs.setdefault(r["knob"], {"knob": r["knob"], "verdict": verdict, "probes": [], "summary": ""})
        k["probes"].append(r["name"])
        if order[verdict] < order[k["verdict"]]:
            k["verdict"] = verdict
        undoes = r["evidence"].get("undoes")
        if undoes and verdict == k["verdict"]:
            undone.add(r["knob"])
        text = _knob_summary(r, base_lp)
        if undoes:
            text = f"takes back your own {', '.join(f'--opt {a}={b}' for a, b in undoes.items())}: {text}"
        k["summary"] = "; ".join(x for x in (k["summary"], text) if x)
    ranked = sorted(knobs.values(), key=lambda k: (order[k["verdict"]], k["knob"] not in undone))
    for i, k in enumerate(ranked, 1):
        k["rank"] = i
    return ranked


def _knob_summary(r: dict[str, Any], base_lp: float) -> str:
    ev = r["evidence"]
    if r["kind"] == "ladder":
        bad = ev.get("diverged_batch_sizes", [])
        return (f"batch sizes {', '.join(map(str, bad))} differ from batch 1" if bad else "no batch size differs from batch 1") + _lp(ev)
    if r["kind"] == "needle":
        return f"{ev['diverged']}/{ev['total']} random batch placements changed prompt {ev['target']}'s output"
    if r["kind"] == "fresh_process":
        return (f"{'outputs differ' if ev['diverged'] else 'outputs equal'} across {ev['processes']} fresh processes") + _lp(ev)
    word = {"vanish": "divergence vanishes", "move": "divergence moves", "persist": "divergence persists"}[r["outcome"]]
    conf = ev.get("confirmation")
    if conf:
        word += (f" in the probe ({conf['status']}: {conf['fresh_process_passes']} of {conf['fresh_process_runs']} fresh-process "
                 f"checks passed, --fresh-repeats {conf['fresh_repeats']})")
    if r["outcome"] == "vanish":  # no divergence left: a drift the tier accepts is said to be that, never the divergence's size
        lp = ev.get("passing_max_abs_logprob_diff")
        return f"{r['name']}: {word}" + (f"; no divergence left (the drift left, max |dlogprob| {lp:.3g}, is within what the tier "
                                         "accepts)" if lp else "")
    return f"{r['name']}: {word}" + _lp(ev) + (f" (was {base_lp:.3g})" if base_lp else "")


def _lp(ev: dict[str, Any]) -> str:
    lp = ev.get("max_abs_logprob_diff")
    first = ev.get("first")
    where = f", first at prompt {first['prompt_index']} token {first['token_index']}" if first else ""
    return (f"; max |dlogprob| {lp:.3g}" if lp else "") + where


def conclusion(knobs: list[dict[str, Any]], passing: dict[str, Any] | None, kinds: list[str],
               confirmation: dict[str, Any] | None = None) -> str:
    """Plain words: what the divergence follows, then the minimal passing setting only when it
    passed every fresh-process confirmation; a setting that vanished once but failed (or ran out
    of budget before) its confirmation is said to be exactly that."""
    follows = [k for k in knobs if k["verdict"] == "follows"]
    vanish = [k for k in knobs if k["verdict"] == "vanishes"]
    parts = []
    if follows:
        parts.append("The divergence follows " + " and ".join(f"{k['knob']} ({k['summary']})" for k in follows) + ".")
    if passing:
        parts.append(f"Minimal passing setting: {passing['summary']}.")
    elif confirmation is not None and confirmation["status"] == "unconfirmed":
        parts.append(f"Not a confirmed passing setting: {confirmation['summary']}.")
    elif vanish:
        parts.append("It vanishes with " + ", ".join(k["probes"][0] for k in vanish) + " (not confirmed in fresh processes).")
    if not passing and not (confirmation is not None and confirmation["status"] == "unconfirmed"):
        if confirmation is not None and confirmation["status"] == "failed":
            parts.append(f"No passing setting: {confirmation['summary']}.")
        tried = [k["probes"][0] for k in knobs if k["verdict"] in ("moves", "not_followed") and k["knob"] not in ("batch composition", "process")]
        parts.append("Nothing isolates it: no setting tried" + (f" ({', '.join(tried)})" if tried else "") + " makes it vanish"
                     + (" in every fresh-process check" if confirmation is not None else "") + ".")
        if "batch" in kinds:
            parts.append("The only workaround left is to serve one request at a time (batch size 1).")
    return " ".join(parts)
