"""diagnosis.json as text (terminal, diagnosis.txt) and Markdown (diagnosis.md, CI summaries).

Owns presentation only; every figure comes from the diagnosis document.
"""

from __future__ import annotations

from typing import Any


def _num(x: Any) -> str:
    return "-" if x is None else (f"{x:.3g}" if isinstance(x, float) else str(x))


def _probe_line(p: dict[str, Any]) -> tuple[str, str, str, str, str]:
    ev = p.get("evidence") or {}
    first = ev.get("first")
    where = f"p{first['prompt_index']} t{first['token_index']}" if first else "-"
    if p["kind"] == "needle" and p["status"] == "ran":
        where = f"{ev['diverged']}/{ev['total']} trials differ"
    if p["kind"] == "prefill" and p["status"] == "ran":
        where = f"first pos {_num(ev.get('first_differing_position'))}"
    result = p["outcome"] or p["status"]
    if p["status"] != "ran":
        result = f"{p['status']}: {p.get('reason', '')}"
    return p["name"], result, where, _num(ev.get("max_abs_logprob_diff")), _num(ev.get("argmax_flips"))


def render_text(doc: dict[str, Any]) -> str:
    base = doc["baseline"]
    lines = [f"DIAGNOSIS {doc['backend']} {doc['model']} at tier {doc['tier_requested']}: "
             + ("diverges (" + ", ".join(base["kinds"]) + ")" if base["diverged"] else "no divergence"),
             doc["conclusion"], ""]
    if doc["knobs"]:
        lines.append("knobs, ranked:")
        lines += [f"  {k['rank']}. {k['knob']}: {k['verdict']} - {k['summary']}" for k in doc["knobs"]]
    if doc["passing_settings"]:
        lines.append(f"passing: {doc['passing_settings']['summary']}")
    if doc["probes"]:
        lines.append("probes (outcome, first divergence, max |dlogprob|, flips):")
        lines += ["  {:<34} {:<10} {:<18} {:<9} {}".format(*_probe_line(p)) for p in doc["probes"]]
    pv = doc.get("prefill_vs_decode")
    if pv and pv.get("available"):
        lines.append(f"prefill vs decode: max |d| {_num(pv['max_abs_logprob_diff'])} over {pv['positions']} positions, "
                     f"first differing position {_num(pv['first_differing_position'])} ({pv['method']})")
    for s in doc["skipped_knobs"]:
        lines.append(f"not probed: {s['knob']} - {s['reason']}")
    for s in doc["not_run"]:
        lines.append(f"not run: {s['name']} - {s['reason']}")
    b = doc["budget"]
    lines.append(f"budget: {b['probes_used']} probes in {b['seconds_used']:.1f} s")
    return "\n".join(lines) + "\n"


def render_markdown(doc: dict[str, Any]) -> str:
    base = doc["baseline"]
    out = [f"# detllm diagnosis: {doc['backend']} / {doc['model']} at tier {doc['tier_requested']}", "",
           f"**{'Diverges: ' + ', '.join(base['kinds']) if base['diverged'] else 'No divergence'}.** {doc['conclusion']}", ""]
    if doc["knobs"]:
        out += ["| rank | knob | verdict | evidence |", "|---|---|---|---|"]
        out += [f"| {k['rank']} | {k['knob']} | {k['verdict']} | {k['summary']} |" for k in doc["knobs"]]
        out.append("")
    if doc["passing_settings"]:
        out += [f"Passing setting: **{doc['passing_settings']['summary']}**", ""]
    if doc["probes"]:
        out += ["| probe | outcome | first divergence | max \\|Δlogprob\\| | flips |", "|---|---|---|---|---|"]
        out += ["| " + " | ".join(_probe_line(p)) + " |" for p in doc["probes"]]
        out.append("")
    pv = doc.get("prefill_vs_decode")
    if pv and pv.get("available"):
        out += [f"Prefill vs decode: max |Δ| {_num(pv['max_abs_logprob_diff'])} over {pv['positions']} positions, first "
                f"differing position {_num(pv['first_differing_position'])} ({pv['method']}).", ""]
    if doc["skipped_knobs"] or doc["not_run"]:
        out += [f"- not probed: {s['knob']} ({s['reason']})" for s in doc["skipped_knobs"]]
        out += [f"- not run: {s['name']} ({s['reason']})" for s in doc["not_run"]]
    return "\n".join(out) + "\n"
