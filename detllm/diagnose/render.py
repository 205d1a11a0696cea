"""diagnosis.json as text (terminal, diagnosis.txt), Markdown (diagnosis.md, CI summaries) and
HTML (diagnosis.html, in the style and under the Content-Security-Policy of the report's page,
render/html.py).

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


def baseline_words(doc: dict[str, Any]) -> str:
    """What the baseline showed here, in words: a FAIL it was asked about that did not diverge here
    did not reproduce; it is never called "no divergence"."""
    base = doc["baseline"]
    if base["diverged"]:
        return "diverges (" + ", ".join(base["kinds"]) + ")"
    if (doc.get("source") or {}).get("status") == "FAIL":
        return "the FAIL did not reproduce here"
    return "no divergence"


def render_text(doc: dict[str, Any]) -> str:
    lines = [f"DIAGNOSIS {doc['backend']} {doc['model']} at tier {doc['tier_requested']}: " + baseline_words(doc),
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
    ly = doc.get("layers")
    if ly:
        lines.append(f"layers (detllm locate): {ly.get('line') or ly.get('reason', ly['status'])}")
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
           f"**{'Diverges: ' + ', '.join(base['kinds']) if base['diverged'] else baseline_words(doc)[0].upper() + baseline_words(doc)[1:]}.** {doc['conclusion']}", ""]
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
    ly = doc.get("layers")
    if ly:
        out += [f"Layers (`detllm locate --layers-only`): {ly.get('line') or ly.get('reason', ly['status'])}", ""]
    if doc["skipped_knobs"] or doc["not_run"]:
        out += [f"- not probed: {s['knob']} ({s['reason']})" for s in doc["skipped_knobs"]]
        out += [f"- not run: {s['name']} ({s['reason']})" for s in doc["not_run"]]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------ HTML (diagnosis.html)

_STYLE = ".knobs td:nth-child(-n+3),.probes td:nth-child(n+2){white-space:nowrap}.probes td:nth-child(2){white-space:normal}"
_VERDICT_CELL = {"follows": "cell-FAIL", "vanishes": "cell-PASS", "moves": "cell-INFO", "not_followed": "cell-base"}


def render_html(doc: dict[str, Any]) -> str:
    """diagnosis.html: one self-contained page in the report page's style (render/html.py: its CSS
    and Content-Security-Policy, so no script, font, image or link out), every string escaped."""
    from ..render.html import esc, page

    base = doc["baseline"]
    title = f"detllm diagnosis: {doc['backend']} / {doc['model']}"
    verdict = f"<span class='verdict {'FAIL' if base['diverged'] else 'PASS'}'>{esc(baseline_words(doc))}</span>"
    src = doc.get("source") or {}
    body = [f"<h1>{esc(title)}: {verdict}</h1>",
            f"<p>tier {esc(doc['tier_requested'])} (requested) · {esc(src.get('kind'))} {esc(src.get('path') or '')}"
            + (f" · recorded causes {esc(', '.join(src.get('recorded_causes') or []))}" if src.get("recorded_causes") else "") + "</p>",
            f"<p class='conclusion'><b>{esc(doc['conclusion'])}</b></p>"]
    ps = doc.get("passing_settings")
    if ps and ps["summary"] not in doc["conclusion"]:
        body.append(f"<p>Passing setting: <b class='passing'>{esc(ps['summary'])}</b></p>")
    if doc["knobs"]:
        body += ["<h2>Knobs, ranked</h2>", "<table class='knobs'><tr><th>rank</th><th>knob</th><th>verdict</th><th>evidence</th></tr>"]
        body += [f"<tr><td>{esc(k['rank'])}</td><td><code>{esc(k['knob'])}</code></td>"
                 f"<td class='{_VERDICT_CELL.get(k['verdict'], '')}'>{esc(k['verdict'])}</td><td>{esc(k['summary'])}</td></tr>"
                 for k in doc["knobs"]]
        body.append("</table>")
    if doc["probes"]:
        body += ["<h2>Probes</h2>", "<table class='probes'><tr><th>probe</th><th>outcome</th><th>first divergence</th>"
                 "<th>max |Δlogprob|</th><th>flips</th><th>seconds</th><th>folder</th></tr>"]
        for p in doc["probes"]:
            name, result, where, lp, flips = _probe_line(p)
            cell = "cell-PASS" if p["outcome"] in ("vanish", "equal") else ("cell-FAIL" if p["outcome"] else "cell-base")
            body.append(f"<tr><td>{esc(name)}<div class='muted'>{esc(p.get('proves', ''))}</div></td><td class='{cell}'>{esc(result)}</td>"
                        f"<td>{esc(where)}</td><td class='mono'>{esc(lp)}</td><td>{esc(flips)}</td>"
                        f"<td>{esc(_num(p.get('seconds')))}</td><td><code>{esc(p.get('folder') or '-')}</code></td></tr>")
        body.append("</table>")
    pv = doc.get("prefill_vs_decode")
    if pv and pv.get("available"):
        body.append(f"<p>Prefill vs decode: max |Δ| {esc(_num(pv['max_abs_logprob_diff']))} over {esc(pv['positions'])} positions, "
                    f"first differing position {esc(_num(pv['first_differing_position']))} ({esc(pv['method'])}).</p>")
    ly = doc.get("layers")
    if ly:
        body.append(f"<p>Layers (detllm locate --layers-only): {esc(ly.get('line') or ly.get('reason', ly['status']))}</p>")
    comps = base.get("comparisons") or []
    if comps:
        body += ["<h2>The failing check</h2>", "<table class='baseline'><tr><th>comparison</th><th>diverged</th><th>prompts</th>"
                 "<th>first divergence</th><th>max |Δlogprob|</th><th>flips</th></tr>"]
        for c in comps:
            f = c.get("first")
            where = f"prompt {f['prompt_index']} token {f['token_index']} ({f['kind']})" if f else "-"
            body.append(f"<tr><td>{esc(c['name'])}</td><td class='{'cell-FAIL' if c['diverged'] else 'cell-PASS'}'>"
                        f"{'yes' if c['diverged'] else 'no'}</td><td>{esc(c['prompts_diverged'])}/{esc(c['prompts_compared'])}</td>"
                        f"<td>{esc(where)}</td>"
                        f"<td class='mono'>{esc(_num(c.get('max_abs_logprob_diff')))}</td><td>{esc(c.get('argmax_flips'))}</td></tr>")
        body.append("</table>")
    if doc["skipped_knobs"] or doc["not_run"]:
        body += ["<h2>Not probed, not run</h2>", "<ul>"]
        body += [f"<li>not probed: <code>{esc(s['knob'])}</code> — {esc(s['reason'])}</li>" for s in doc["skipped_knobs"]]
        body += [f"<li>not run: {esc(s['name'])} — {esc(s['reason'])}</li>" for s in doc["not_run"]]
        body.append("</ul>")
    b = doc["budget"]
    seconds = f"{b['seconds_used']:.1f}"
    body.append(f"<p class='muted'>budget: {esc(b['probes_used'])} probes in {esc(seconds)} s · detllm "
                f"{esc(doc.get('detllm_version'))} · {esc(doc.get('created_at'))}</p>")
    return page(title, body, _STYLE)
