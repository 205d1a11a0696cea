"""report.html: one self-contained page a maintainer opens from a bug report.

Rendered from report.json plus, where they can be read, the two divergent records of
the trace (for the texts as token chips). Inline CSS and SVG only: no script, no font,
no image, no link out; a Content-Security-Policy meta tag forbids all of them, because
packs come from strangers. Every string from a pack goes through `esc`.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from ..compare.causes import ADVICE, TITLES
from .figures import apart, chosen_logprobs, difference_text, differing_entry, entry_text, topk_bound
from .paths import mask_paths
from .svgplot import log_plot
from .text import diagnose_command, reproduction_line
from . import engaged

CSP = ("default-src 'none'; style-src 'unsafe-inline'; img-src data:; script-src 'none'; connect-src 'none'; "
       "font-src 'none'; object-src 'none'; media-src 'none'; frame-src 'none'; form-action 'none'; base-uri 'none'")
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:0;color:#1f2328;background:#fff}
main{max-width:1180px;margin:0 auto;padding:18px 24px 40px}
h1{font-size:22px;margin:0 0 6px} h2{font-size:17px;margin:26px 0 8px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
.verdict{display:inline-block;padding:2px 10px;border-radius:6px;color:#fff;font-weight:700}
.PASS{background:#1a7f37}.FAIL{background:#cf222e}.INFO,.RECORDED,.UNVERIFIED{background:#9a6700}.base{background:#57606a}
table{border-collapse:collapse;margin:6px 0} td,th{border:1px solid #d0d7de;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa} td{overflow-wrap:anywhere} code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12.5px}
.sides{display:grid;grid-template-columns:1fr 1fr;gap:14px}
.side{border:1px solid #d0d7de;border-radius:6px;padding:8px 10px;background:#f6f8fa}
.side h3{font-size:13px;margin:0 0 6px;color:#57606a}
.chips{font-family:ui-monospace,Menlo,monospace;font-size:13px;line-height:2;white-space:pre-wrap;word-break:break-word}
.tok{position:relative;border:1px solid #afb8c1;border-radius:3px;padding:0 1px;margin:0 1px;background:#fff}
.tok.after{opacity:.55}.tok.div{background:#ffebe9;border:2px solid #cf222e;font-weight:700}
.tok .tip{display:none;position:absolute;left:0;top:1.9em;z-index:5;background:#1f2328;color:#fff;padding:2px 6px;
 border-radius:4px;white-space:nowrap;font-size:11px;font-weight:400}
.tok:hover .tip{display:block}
.prompt{color:#57606a;border-right:2px solid #0969da;padding-right:3px;margin-right:3px}.lp{color:#57606a;font-size:11px}
.cell-PASS{background:#dafbe1}.cell-FAIL{background:#ffebe9}.cell-INFO{background:#fff8c5}.cell-base{background:#eaeef2}
.muted{color:#57606a}.diff-l{background:#ffebe9}.diff-r{background:#dafbe1}
tr.hl td,p.hl{background:#fff8c5;font-weight:700} tr.hl td{border:2px solid #9a6700}
svg text{font:11px system-ui,sans-serif;fill:#57606a}
"""


def esc(value: Any) -> str:
    """Text from a pack, safe as HTML text or a quoted attribute value, its paths shown as
    render/paths.py shows them (nothing under a home or temporary folder)."""
    if not isinstance(value, str):
        value = json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, list)) else str(value)
    return html.escape(mask_paths(value), quote=True)


def _num(x: Any, fmt: str = ".6g") -> str:
    return "n/a" if x is None else format(x, fmt)


def _visible(text: str) -> str:
    """A token as shown in a chip: whitespace made visible, so a space token is not empty."""
    return text.replace("\n", "\u21b5\n").replace(" ", "\u00b7") if text.strip() == "" or text != text.strip() else text


# ------------------------------------------------------------------ sections


def _header(report: dict[str, Any], sides: dict[str, dict[str, Any]]) -> list[str]:
    tier = report["tier"]
    tier_note = "" if tier["requested"] == tier["effective"] else f" (requested {tier['requested']}, downgraded)"
    cat = "" if report["category"] in (report["status"], "PASS") else f" · {esc(report['category'])}"
    out = [f"<h1>detllm {esc(report['command'])}: <span class='verdict {esc(report['status'])}'>{esc(report['status'])}</span>{cat}</h1>",
           f"<p>tier {esc(tier['effective'])}{esc(tier_note)}"]
    if line := reproduction_line(report):  # a replay's verdict in the reporter's terms, under the verdict
        out.insert(1, f"<p><strong>{esc(line)}</strong></p>")
    s = report.get("summary", {})
    if "prompts" in s:
        out[-1] += f" · prompts {esc(s['prompts'])}"
    if "runs" in s:
        out[-1] += f" · runs {esc(s['runs'])} · batch sizes {esc(s.get('batch_sizes'))}"
    out[-1] += "</p>"
    out += [f"<p>{esc(line)}</p>" for line in engaged.lines(report)]
    if sides:
        out += ["<table><tr><th></th><th>engine</th><th>model</th><th>dtype</th><th>device</th><th>selection</th></tr>"]
        for name, x in sides.items():
            out.append(f"<tr><th>{esc(name)}</th><td>{esc(x.get('backend'))}</td><td>{esc(x.get('model'))}</td>"
                       f"<td>{esc(x.get('dtype'))}</td><td>{esc(x.get('device'))}</td><td class='mono'>{esc(x.get('label'))}</td></tr>")
        out.append("</table>")
    return out


def _chips(record: dict[str, Any] | None, d: dict[str, Any], side: str) -> str:
    """A record's generated tokens as chips: the common prefix plain, the divergent token marked."""
    at = d["token_index"]
    if record is None:  # the trace is not at hand: what report.json keeps
        tok = d[side]
        chosen = "(end of generation)" if tok["token_id"] is None else tok["token_text"]
        return (f"<div class='chips'>{esc(d['common_prefix_text'][-400:])}<span class='tok div' title='{esc(_tip(tok))}'>"
                f"{esc(_visible(chosen))}<span class='tip'>{esc(_tip(tok))}</span></span></div>")
    texts, ids, lps = record["token_texts"], record["token_ids"], record.get("logprobs")
    prompt = record.get("prompt_text")
    parts = [f"<span class='prompt'>{esc(prompt)}</span>"] if prompt else []
    parts.append(esc("".join(texts[:at])))  # the common prefix, plain
    for i in range(at, len(ids)):
        lp = lps[i] if lps is not None and i < len(lps) else None
        tip = f"token {i} · id {ids[i]}" + (f" · logprob {lp:.6g}" if lp is not None else "")
        cls = "tok div" if i == at else "tok after"
        parts.append(f"<span class='{cls}' title='{esc(tip)}'>{esc(_visible(texts[i]))}<span class='tip'>{esc(tip)}</span></span>")
    if at >= len(ids):
        parts.append("<span class='tok div' title='generation ended here'>(end)<span class='tip'>generation ended here</span></span>")
    return f"<div class='chips'>{''.join(parts)}</div>"


def _tip(tok: dict[str, Any], logprob: str | None = None) -> str:
    """`logprob`: the value as printed beside the other side's (figures.chosen_logprobs)."""
    if tok["token_id"] is None:
        return "generation ended"
    if logprob is None and tok.get("logprob") is not None:
        logprob = f"{tok['logprob']:.6g}"
    return f"id {tok['token_id']}" + (f" · logprob {logprob}" if logprob is not None else "")


def _topk(d: dict[str, Any]) -> str:
    """Both sides' top-k at the divergence; the entry whose difference is the divergence's is
    highlighted (class `hl`) on each side that holds it, its value printed apart from the other's."""
    texts = {s["token_id"]: s["token_text"] for s in (d["left"], d["right"]) if s["token_id"] is not None}
    e = differing_entry(d)
    shown = dict(zip(("left", "right"), apart(e["left"], e["right"]))) if e is not None else {}
    cols = []
    for side in ("left", "right"):
        rows = "".join((f"<tr class='hl' title='{esc(entry_text(d))}'>" if e is not None and tid == e["id"] else "<tr>")
                       + f"<td class='mono'>{esc(tid)}</td><td class='mono'>{esc(repr(texts[tid])) if tid in texts else ''}</td>"
                       f"<td class='mono'>{esc(shown[side]) if e is not None and tid == e['id'] else _num(lp, '.6g')}</td></tr>"
                       for tid, lp in d[side].get("top_logprobs") or [])
        cols.append(f"<table><tr><th>id</th><th>token</th><th>logprob</th></tr>{rows or '<tr><td colspan=3>not recorded</td></tr>'}</table>")
    return f"<div class='sides'><div>{cols[0]}</div><div>{cols[1]}</div></div>"


def _divergence(d: dict[str, Any], records: tuple[dict | None, dict | None]) -> list[str]:
    tie = "yes: a margin is below the noise floor, so a numeric tie flipped" if d["near_tie"] else "no"
    out = ["<h2>First divergence</h2>",
           f"<p>prompt {esc(d['prompt_index'])} (<code>{esc(d['prompt_id'][:12])}</code>), generated token "
           f"<b>{esc(d['token_index'])}</b>, kind <code>{esc(d['kind'])}</code>, in <i>{esc(d['comparison'])}</i>; "
           f"near tie: {esc(tie)}; noise floor {esc(_num(d.get('noise_floor'), 'g'))}</p>",
           "<div class='sides'>"]
    for side, rec, lp in zip(("left", "right"), records, chosen_logprobs(d)):
        tok = d[side]
        chosen = "(end of generation)" if tok["token_id"] is None else repr(tok["token_text"])
        out.append(f"<div class='side'><h3>{esc(side)}: {esc(tok['label'])}</h3>{_chips(rec, d, side)}"
                   f"<p class='mono'>divergent token: {esc(chosen)} · {esc(_tip(tok, lp))} · margin {esc(_num(tok.get('margin'), '.4g'))}</p></div>")
    out.append("</div>")
    if difference := difference_text(d, ".6g"):
        out.append(f"<p class='hl'>at this step: {esc(difference)}</p>")
    out += ["<h3>top-k at the divergence</h3>", _topk(d)]
    return out


def drift_svg(series: list[float | None], mark: int | None, *, width: int = 560, height: int = 150) -> str:
    """Largest |dlogprob| by position on a log scale (zeros drawn at the floor), the divergence marked."""
    pts = [(i, v) for i, v in enumerate(series) if v is not None]
    if not pts:
        return "<p class='muted'>no logprobs recorded: nothing to plot</p>"
    return log_plot(pts, len(series), aria="drift by position", mark=mark, mark_label=f"divergence @ {mark}",
                    caption=f"position 0..{len(series) - 1}; max |Δ logprob| of the chosen token, log scale, 0 at the floor",
                    width=width, height=height)


def _drift(report: dict[str, Any]) -> list[str]:
    out = ["<h2>Drift by position</h2>"]
    for c in report["comparisons"]:
        dr = c["drift"]
        series = dr.get("max_abs_logprob_diff_by_position") or []
        d = c["first_divergence"]
        bound = topk_bound(c)
        topk = "" if bound is None else f", of top-k entries >={bound:.3g}"
        stats = (f"max |dlogprob| of chosen tokens {_num(dr.get('max_abs_logprob_diff'), '.3g')}{topk} · argmax flips {esc(dr.get('argmax_flips', 'n/a'))}"
                 if dr.get("available") else "logprobs not compared")
        out.append(f"<h3>{esc(c['name'])} <span class='verdict {_cell_status(c)}'>{esc(_cell_status(c))}</span></h3>"
                   f"<p class='muted'>{esc(c['prompts_diverged'])}/{esc(c['prompts_compared'])} prompts diverged{esc(engaged.comparison_note(c))} · {esc(stats)}</p>")
        out.append(drift_svg(series, d["token_index"] if d else None) if dr.get("available") else "")
    return out


def _field_rows(items: list[dict[str, Any]]) -> str:
    return ("<table><tr><th>field</th><th>left</th><th>right</th></tr>" +
            "".join(f"<tr><td class='mono'>{esc(x['field'])}</td><td class='mono{'' if x['left'] == x['right'] else ' diff-l'}'>"
                    f"{esc(x['left'])}</td><td class='mono{'' if x['left'] == x['right'] else ' diff-r'}'>{esc(x['right'])}</td></tr>"
                    for x in items) + "</table>")


def _evidence(ev: dict[str, Any]) -> str:
    rows = []
    for key, value in ev.items():
        if value in ([], {}, None):
            continue
        if isinstance(value, list) and all(isinstance(x, dict) and "field" in x for x in value):
            rows.append(f"<tr><th>{esc(key)}</th><td>{_field_rows(value)}</td></tr>")
        elif isinstance(value, dict) and set(value) == {"left", "right"}:
            rows.append(f"<tr><th>{esc(key)}</th><td>{_field_rows([{'field': key, **value}])}</td></tr>")
        else:
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            rows.append(f"<tr><th>{esc(key)}</th><td class='mono'>{esc(text[:600])}</td></tr>")
    return "<table>" + "".join(rows) + "</table>"


def _causes(report: dict[str, Any]) -> list[str]:
    out = []
    if report["causes"]:
        out.append("<h2>Causes, most likely first</h2>")
        command = diagnose_command(report)
        if command is not None:
            out.append(f"<p>next: <code>{esc(command)}</code> finds the setting that makes it stop</p>")
        for n, c in enumerate(report["causes"], 1):
            out.append(f"<h3>{n}. <code>{esc(c['code'])}</code>: {esc(TITLES.get(c['code'], ''))}</h3>"
                       f"<p>next: {esc(ADVICE.get(c['code'], ''))}</p>{_evidence(c['evidence'])}")
    if report.get("info"):
        out.append("<h2>Recorded differences that did not fail the verdict</h2>")
        for c in report["info"]:
            out.append(f"<h3><code>{esc(c['code'])}</code>: {esc(TITLES.get(c['code'], ''))}</h3>{_evidence(c['evidence'])}")
    return out


def _cell_status(c: dict[str, Any]) -> str:
    if c["status"] == "FAIL" and c["required"]:
        return "FAIL"
    if c["status"] != "PASS" or (not c["required"] and c["prompts_diverged"]):
        return "INFO"
    return "PASS"


def _matrix(report: dict[str, Any]) -> list[str]:
    """runs × batch sizes: each cell the worst status of the comparisons whose right side it is."""
    from ..compare.engine import parse_label

    cells: dict[tuple[int, int], str] = {}
    base = None
    order = {"PASS": 0, "INFO": 1, "FAIL": 2}
    for c in report["comparisons"]:
        try:
            base = parse_label(c["left"])
            key = parse_label(c["right"])
        except ValueError:
            return []
        st = _cell_status(c)
        if order[st] >= order[cells.get(key, "PASS")]:
            cells[key] = st
    if base is None:
        return []
    cells.setdefault(base, "base")
    runs = sorted({r for r, _ in cells})
    batches = sorted({b for _, b in cells})
    out = ["<h2>Comparison matrix</h2><p class='muted'>each cell is compared with the base "
           f"(run {base[0]} at batch {base[1]}); INFO: differs where the tier does not require agreement</p><table>",
           "<tr><th>run \\ batch</th>" + "".join(f"<th>{esc(b)}</th>" for b in batches) + "</tr>"]
    for r in runs:
        row = "".join(f"<td class='cell-{cells[(r, b)]}'>{esc(cells[(r, b)])}</td>" if (r, b) in cells else "<td></td>" for b in batches)
        out.append(f"<tr><th>run {esc(r)}</th>{row}</tr>")
    return out + ["</table>"]


# ------------------------------------------------------------------ the page


def render_html(report: dict[str, Any], *, records: tuple[dict | None, dict | None] = (None, None),
                sides: dict[str, dict[str, Any]] | None = None, located: dict[str, Any] | None = None) -> str:
    """The page. `records`: the left and right trace records of the first divergence's prompt,
    when at hand; `sides`: engine, model, dtype, device and label of each side for the header;
    `located`: the folder's locate.json (the located op, its shapes and the per-layer plot)."""
    title = f"detllm {report['command']}: {report['status']}"
    body = _header(report, sides or {})
    if report["command"] == "check":
        body += _matrix(report)
    if report["first_divergence"] is not None:
        body += _divergence(report["first_divergence"], records)
    if any(c["drift"].get("available") for c in report["comparisons"]):
        body += _drift(report)
    if located is not None:
        from .locate import html_section

        body += html_section(located)
    body += _causes(report)
    return page(title, body)


def page(title: str, body: list[str], style: str = "") -> str:
    """One self-contained page: the Content-Security-Policy (no script, font, image or link out),
    this module's CSS plus `style`, and `body`'s lines (already escaped) in <main>."""
    return ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<meta http-equiv='Content-Security-Policy' content=\"{CSP}\">"
            "<meta name='referrer' content='no-referrer'>"
            f"<meta name='viewport' content='width=device-width,initial-scale=1'><title>{esc(title)}</title>"
            f"<style>{_CSS}{style}</style></head><body><main>\n" + "\n".join(body) + "\n</main></body></html>\n")


# ------------------------------------------------------------------ from a folder


def _records_at(trace: Path, run: int, batch: int, prompt_index: int) -> dict[str, Any] | None:
    from ..compare.trace import load_records

    if not trace.is_file():
        return None
    try:
        recs, _ = load_records(trace, keep=lambda h: h["run_index"] == run and h["batch_size"] == batch
                               and h["prompt_index"] == prompt_index)
        return dict(recs[0].load()) if recs else None
    except Exception:  # noqa: BLE001 - the chips are a convenience: report.json alone still renders
        return None


def _trace_of(folder: str | Path | None) -> Path | None:
    if folder is None:
        return None
    p = Path(folder)
    return p if p.is_file() else p / "trace.jsonl"


def render_outcome(report: dict[str, Any], folder: Path | None) -> str:
    """The page for a report read from `folder` (a run or diff folder; None: a diff written nowhere).
    A check reads its own trace; a diff reads the two folders it names, when they are still there."""
    from ..compare.engine import parse_label

    d = report["first_divergence"]
    s = report.get("summary", {})
    sides: dict[str, dict[str, Any]] = {}
    records: tuple[dict | None, dict | None] = (None, None)
    if report["command"] == "diff" and "left" in s:
        sides = {"left": s["left"], "right": s["right"]}
        if d is not None:
            records = tuple(_records_at(_trace_of(s[k]["folder"]), s[k]["run_index"], s[k]["batch_size"], d["prompt_index"])
                            for k in ("left", "right"))  # type: ignore[assignment]
    elif folder is not None:
        cfg = _read(Path(folder) / "run_config.json")
        c = (cfg or {}).get("config", {})
        if d is not None:
            (lr, lb), (rr, rb) = parse_label(d["left"]["label"]), parse_label(d["right"]["label"])
            trace = Path(folder) / "trace.jsonl"
            records = (_records_at(trace, lr, lb, d["prompt_index"]), _records_at(trace, rr, rb, d["prompt_index"]))
            sides = {side: {"backend": c.get("backend"), "model": c.get("model"), "dtype": c.get("dtype"), "device": c.get("device"),
                            "label": d[side]["label"]} for side in ("left", "right")}
        elif c:
            sides = {"run": {"backend": c.get("backend"), "model": c.get("model"), "dtype": c.get("dtype"),
                             "device": c.get("device"), "label": str(Path(folder).name)}}
    from .locate import load_located

    located = load_located(folder)  # detllm locate's finding, sealed with the folder
    return render_html(report, records=records, sides=sides, located=located)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
