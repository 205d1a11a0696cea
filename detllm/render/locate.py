"""locate.json as text, Markdown and an HTML section (the located op, its shapes, the growth to the
logits and a per-layer plot of max |Δ| as inline SVG: no script). Reads the document, computes
nothing; report.html and `report --format issue` include the section when a folder holds one.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from ..core.errors import ArtifactError
from ..runfolder.schema_io import check_header, validate
from .svgplot import log_plot

TABLE_ROWS = 40  # text/markdown tables: every boundary and differing row up to this many


def load_located(folder: str | Path | None) -> dict[str, Any] | None:
    """The folder's locate.json when it holds a valid one (a report renders without it otherwise)."""
    if folder is None:
        return None
    try:
        doc = json.loads((Path(folder) / "locate.json").read_text(encoding="utf-8"))
        check_header(doc, "locate", "locate.json")
        validate(doc, "locate", where="locate.json")
    except (OSError, ValueError, ArtifactError):
        return None
    return doc


def _g(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return {True: "yes", False: "no", None: "-"}[v]
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _shapes(op: dict[str, Any]) -> str:
    ins = op["input_shapes"]
    return (f"in {ins['left']} -> out {op['output_shape']['left']} (left); in {ins['right']} -> out {op['output_shape']['right']} "
            f"(right)")


def op_line(op: dict[str, Any] | None) -> str:
    if op is None:
        return "none"
    return (f"{op['module']} ({op['kind']}) prompt {op['prompt']} step {op['step']}: max |Δ| {_g(op['max_abs_diff'])} at "
            f"{op['at']} ({_g(op['left_value'])} vs {_g(op['right_value'])}), tolerance {_g(op['tolerance'])}; {_shapes(op)}")


def graft_lines(doc: dict[str, Any]) -> list[str]:
    """The graft (the causal test of the located op), one line per grafted side; none without one."""
    g = doc.get("graft")
    if not g:
        return []
    out = []
    for key, what in (("into_right", "left's output grafted into the right side"), ("into_left", "right's into the left side")):
        if key in g:
            r = g[key]
            fig = (f"; logits max |Δ| {_g(r['logits_max_abs_diff_before'])} -> {_g(r['logits_max_abs_diff_after'])}"
                   if "logits_max_abs_diff_after" in r else
                   f"; step {r['judged_at_step']} logprob {r.get('logprob_before')!r} -> {r.get('logprob_after')!r} (the other side's "
                   f"{r.get('logprob_other_side')!r})" if "judged_at_step" in r else "")
            out.append(f"graft ({what}): {r['outcome'].replace('_', ' ').upper()}: {r['why']}{fig}")
    out.append(f"graft: {g['op']} at step {g['step']}, {g['positions']}; {g['reruns']} extra re-run(s), {g['seconds']} s")
    return out


def _rows(doc: dict[str, Any], limit: int | None = TABLE_ROWS, module: str | None = None) -> tuple[list[dict[str, Any]], int]:
    """The rows worth printing and how many of them are hidden: layer boundaries, logits and every
    differing output, in order, at most `limit` (None: all); `module`: every row whose module matches
    that glob instead (equal or not)."""
    from fnmatch import fnmatchcase

    if module is not None:
        rows = [r for r in doc["layers"] if fnmatchcase(r["module"], module)]
    else:
        rows = [r for r in doc["layers"] if r["kind"] in ("embedding", "layer", "logits") or r["output_equal"] is False]
    shown = rows if limit is None else rows[:limit]
    return shown, len(rows) - len(shown)


def _rel(r: dict[str, Any]) -> Any:
    """The relative L2 difference (older documents: None; their squared rel_diff is not shown as one)."""
    return r.get("rel_l2")


def _apart(what: str, left: Any, right: Any) -> str:
    """Where two recorded step values differ: a top-k list's first differing entry with its Δ (diff's
    rule), a logprob with its Δ; both excerpts otherwise."""
    if what == "top_logprobs" and isinstance(left, list) and isinstance(right, list):
        for i in range(max(len(left), len(right))):
            a, b = (left[i] if i < len(left) else None), (right[i] if i < len(right) else None)
            if a != b:
                delta = (f", Δ {b[1] - a[1]:.3g}" if isinstance(a, list) and isinstance(b, list) and a[0] == b[0]
                         and all(isinstance(x[1], (int, float)) for x in (a, b)) else "")
                return f"top-k entry {i} differs: left {a!r}, right {b!r}{delta}"
    if what == "logprob" and isinstance(left, (int, float)) and isinstance(right, (int, float)):
        return f"logprob differs: left {left!r}, right {right!r}, Δ {right - left:.3g}"
    return f"{what} differs (left {_short(left)}, right {_short(right)})"


def _warm(w: dict[str, Any] | None) -> str:
    if not w:
        return ""
    hit = f", {w['cached_prefix']} prompt positions read from the prefix cache" if w.get("cached_prefix") else ", no prefix-cache hit"
    return (f"; warmed first by replaying {w['batches']} earlier batch(es){hit}" if w.get("batches") else f"; started cold{hit}")


def _sides(doc: dict[str, Any]) -> list[str]:
    out = []
    for key in ("left", "right"):
        s = doc[key]
        opts = ", ".join(f"{k}={v}" for k, v in sorted(s.get("options", {}).items()))
        rep = {True: "reproduced its trace", False: "did NOT reproduce its trace", None: "not re-run"}[s.get("reproduced")]
        n = doc.get("prefill", {}).get("prefill_length")
        phase = {"decode": " decode", "prefill": f" prefill of {n} tokens" if n else " prefill"}.get(s.get("phase"), "")
        if s.get("phase") == "prefill":
            rep = {True: "computed the same prefill again", False: "did NOT compute the same prefill again", None: "not re-run"}[s.get("reproduced")]
        out.append(f"{key}: {s['label']}{phase} ({s['backend']} {s['model']} {s['dtype']}{', ' + opts if opts else ''}): {rep}"
                   + (f"; re-runs {s['reruns']}, captured {s.get('level')}" if s.get("reruns") else "")
                   + _warm(s.get("warmed_by")))
    return out


def render_text(doc: dict[str, Any], *, rows: int | None = TABLE_ROWS, module: str | None = None) -> str:
    """locate.txt; `rows`: the most table rows (None: all), `module`: the rows of the modules matching a glob."""
    head = {"located": "LOCATED", "not_located": "NOT LOCATED", "no_difference": "NO DIFFERENCE",
            "not_reproduced": "NOT REPRODUCED"}[doc["status"]]
    lines = [f"{head}  {doc['line']}"] + ([f"chose: {doc['chose']}"] if doc.get("chose") else []) + _sides(doc)
    st = doc["step"]
    if st is not None:
        what = "asked with --step, whatever was recorded" if st["what"] == "asked" else _apart(st["what"], st["left"], st["right"])
        lines.append(f"step: prompt {st['prompt']}, step {st['step']}: {what}; captured at step {_g(doc['captured_step'])}")
    lines.append(f"first_bitwise_op: {op_line(doc['first_bitwise_op'])}")
    lines.append(f"first_beyond_tolerance_op: {op_line(doc['first_beyond_tolerance_op'])}")
    lines += graft_lines(doc)
    if doc["growth"]:
        lines.append("growth to the logits:")
        lines += [f"  {g['module']:<44} {g['kind']:<10} max|Δ| {_g(g['max_abs_diff']):>9}  relL2 {_g(_rel(g))}"
                  for g in doc["growth"]]
    if doc["layers"]:
        shown, hidden = _rows(doc, rows, module)
        which = f"rows of modules matching {module!r}" if module is not None else "boundaries and differing rows"
        lines.append(f"per-layer table ({len(doc['layers'])} captured outputs; {which}: {len(shown)} shown"
                     + (f", {hidden} hidden: --rows all shows them, --module 'model.layers.1.*' picks modules" if hidden else "")
                     + "; relL2 = ‖left−right‖ / max(‖left‖, ‖right‖)):")
        lines.append(f"  {'#':>4} {'module':<44} {'kind':<10} {'in=':<4} {'out=':<4} {'max|Δ|':>9} {'at':<12} "
                     f"{'mean|Δ|':>9} {'relL2':>9} {'cosine':>9}")
        for r in shown:
            lines.append(f"  {r['order']:>4} {r['module']:<44} {r['kind']:<10} {_g(r['inputs_equal']):<4} {_g(r['output_equal']):<4} "
                         f"{_g(r.get('max_abs_diff')):>9} {str(r.get('at', '')):<12} {_g(r.get('mean_abs_diff')):>9} "
                         f"{_g(_rel(r)):>9} {_g(r.get('cosine')):>9}")
        if hidden:
            lines.append(f"     ... {hidden} more row(s) not shown (--rows all)")
    lines.append(f"rule: {doc['rule']}")
    lines.append(f"tolerance: {doc['tolerance']['formula']} (factor {doc['tolerance']['factor']})")
    for n in doc["not_captured"]:
        lines.append(f"not captured: {n}")
    c = doc.get("cost") or {}
    if c:
        mb = {k: v / 2**20 for k, v in c["peak_captured_bytes"].items()}
        lines.append(f"cost: re-runs left {c['reruns']['left']}, right {c['reruns']['right']}; peak captured "
                     f"{mb['left']:.2f} MB / {mb['right']:.2f} MB (bound {c['bound_bytes'] / 2**20:.0f} MB); {c['seconds']} s")
        if c.get("rerun_seconds"):
            lines.append("cost: " + rerun_cost(c["rerun_seconds"]))
    if doc.get("next"):
        lines.append(f"next: {doc['next']}")
    return "\n".join(lines) + "\n"


def rerun_cost(t: dict[str, Any]) -> str:
    """The re-runs without and with capture (both sides), and the overhead, wall and cpu."""
    w0, c0 = (t["left"]["without_capture"][i] + t["right"]["without_capture"][i] for i in (0, 1))
    w1, c1 = (t["left"]["with_capture"][i] + t["right"]["with_capture"][i] for i in (0, 1))
    o = t["overhead"]
    pct = {k: "-" if o.get(k) is None else f"{100 * o[k]:+.0f}%" for k in ("wall", "cpu")}
    return (f"re-runs without capture {w0:.2f} s wall / {c0:.2f} s cpu, with capture {w1:.2f} s / {c1:.2f} s "
            f"(capture adds {pct['wall']} wall, {pct['cpu']} cpu)")


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def render_markdown(doc: dict[str, Any]) -> str:
    out = [f"## detllm locate: {doc['status'].replace('_', ' ')}", "", doc["line"], ""]
    out += [f"- {s}" for s in _sides(doc)] + [""]
    out += ["| | module | kind | step | input shapes (left / right) | output shape (left / right) | max \\|Δ\\| | tolerance |",
            "|---|---|---|---|---|---|---|---|"]
    for key in ("first_bitwise_op", "first_beyond_tolerance_op"):
        op = doc[key]
        if op is None:
            out.append(f"| {key} | none | | | | | | |")
            continue
        out.append(f"| {key} | `{op['module']}` | {op['kind']} | {op['step']} | {op['input_shapes']['left']} / "
                   f"{op['input_shapes']['right']} | {op['output_shape']['left']} / {op['output_shape']['right']} | "
                   f"{_g(op['max_abs_diff'])} | {_g(op['tolerance'])} |")
    out += ["", *[f"- {g}" for g in graft_lines(doc)]] if doc.get("graft") else []
    if doc["layers"]:
        shown, hidden = _rows(doc)
        out += ["", "| # | module | kind | inputs equal | output equal | max \\|Δ\\| | at | mean \\|Δ\\| | rel L2 | cosine |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        out += [f"| {r['order']} | `{r['module']}` | {r['kind']} | {_g(r['inputs_equal'])} | {_g(r['output_equal'])} | "
                f"{_g(r.get('max_abs_diff'))} | {r.get('at', '')} | {_g(r.get('mean_abs_diff'))} | {_g(_rel(r))} | "
                f"{_g(r.get('cosine'))} |" for r in shown]
        if hidden:
            out += ["", f"{hidden} more row(s) not shown: `detllm locate ... --rows all`, or `--module GLOB`."]
    out += ["", f"Rule: {doc['rule']}.", "", f"Tolerance: `{doc['tolerance']['formula']}` (factor {doc['tolerance']['factor']})."]
    out += [f"- not captured: {n}" for n in doc["not_captured"]]
    if doc.get("next"):
        out += ["", f"Next: {doc['next']}"]
    return "\n".join(out) + "\n"


def growth_svg(doc: dict[str, Any], *, width: int = 560, height: int = 170) -> str:
    """max |Δ| of every captured output in execution order, log scale (equal outputs at the floor),
    the located op marked."""
    rows = doc["layers"]
    if not rows:
        return "<p class='muted'>nothing captured: nothing to plot</p>"
    vals = [r.get("max_abs_diff") if isinstance(r.get("max_abs_diff"), float) else None for r in rows]
    op = doc["first_bitwise_op"]
    mark = next((i for i, r in enumerate(rows) if op is not None and r["module"] == op["module"]), None)
    return log_plot(list(enumerate(vals)), len(rows), aria="max difference by captured op",
                    ticks=[(i, html.escape(r["module"])) for i, r in enumerate(rows) if r["kind"] == "layer"],
                    mark=mark, mark_label=html.escape(op["module"]) if mark is not None else "",
                    caption=f"captured outputs 0..{len(rows) - 1} in execution order (ticks: layer boundaries); "
                            f"max |Δ|, log scale, equal at the floor", width=width, height=height)


def html_section(doc: dict[str, Any]) -> list[str]:
    """The locate section of an HTML page, every value escaped (a pack's locate.json is a stranger's)."""
    e = lambda v: html.escape(str(v))  # noqa: E731
    out = ["<h2>Where the bits part (detllm locate)</h2>", f"<p><b>{e(doc['status'].replace('_', ' '))}</b>: {e(doc['line'])}</p>"]
    out.append("<table><tr><th></th><th>module</th><th>kind</th><th>step</th><th>inputs (left / right)</th>"
               "<th>output (left / right)</th><th>max |Δ|</th><th>tolerance</th></tr>")
    for key in ("first_bitwise_op", "first_beyond_tolerance_op"):
        op = doc[key]
        if op is None:
            out.append(f"<tr><td>{key}</td><td colspan='7'>none</td></tr>")
            continue
        out.append(f"<tr><td>{key}</td><td class='mono'>{e(op['module'])}</td><td>{e(op['kind'])}</td><td>{e(op['step'])}</td>"
                   f"<td class='mono'>{e(op['input_shapes']['left'])} / {e(op['input_shapes']['right'])}</td>"
                   f"<td class='mono'>{e(op['output_shape']['left'])} / {e(op['output_shape']['right'])}</td>"
                   f"<td>{e(_g(op['max_abs_diff']))}</td><td>{e(_g(op['tolerance']))}</td></tr>")
    out.append("</table>")
    out += [f"<p>{e(g)}</p>" for g in graft_lines(doc)]
    if doc["layers"]:
        out.append(growth_svg(doc))
    if doc["growth"]:
        out.append("<table><tr><th>from the op to the logits</th><th>kind</th><th>max |Δ|</th><th>rel</th></tr>" +
                   "".join(f"<tr><td class='mono'>{e(g['module'])}</td><td>{e(g['kind'])}</td><td>{e(_g(g['max_abs_diff']))}</td>"
                           f"<td>{e(_g(_rel(g)))}</td></tr>" for g in doc["growth"]) + "</table>")
    if doc.get("next"):
        out.append(f"<p><b>next</b>: {e(doc['next'])}</p>")
    out.append(f"<p class='muted'>rule: {e(doc['rule'])}; tolerance {e(doc['tolerance']['formula'])}</p>")
    return out


def summary_lines(doc: dict[str, Any]) -> list[str]:
    """The finding for `report FOLDER` (txt): status and line, the two ops, the next step; locate.txt has the rest."""
    head = doc["status"].replace("_", " ").upper()
    out = ["where the bits part (detllm locate, full text in locate.txt):", f"  {head}  {doc['line']}"]
    out += [f"  {key}: {op_line(doc[key])}" for key in ("first_bitwise_op", "first_beyond_tolerance_op") if doc[key] is not None]
    if doc.get("next"):
        out.append(f"  next: {doc['next']}")
    return out


def issue_lines(doc: dict[str, Any]) -> list[str]:
    """The located op for a bug report (`report --format issue`): the finding, the op with its shapes,
    and the per-layer plot as text bars (max |Δ| on a log scale, one row per layer boundary)."""
    out = ["#### Where the bits part (`detllm locate`)", "", doc["line"], ""]
    for key in ("first_bitwise_op", "first_beyond_tolerance_op"):
        out.append(f"- `{key}`: {op_line(doc[key])}")
    if doc.get("next"):
        out.append(f"- next: {doc['next']}")
    out += [f"- {g}" for g in graft_lines(doc)]
    rows = [r for r in doc["layers"] if r["kind"] in ("embedding", "layer", "logits")
            or (doc["first_bitwise_op"] is not None and r["module"] == doc["first_bitwise_op"]["module"])]
    if rows:
        vals = [r.get("max_abs_diff") for r in rows]
        pos = [v for v in vals if isinstance(v, float) and v > 0]
        lo = math.floor(math.log10(min(pos))) if pos else 0
        bars = []
        for r, v in zip(rows, vals):
            n = 0 if not isinstance(v, float) or v <= 0 else 1 + round(3 * (math.log10(v) - lo))
            bars.append(f"{r['module'][:40]:<40} {'#' * min(n, 40):<40} {_g(v)}")
        out += ["", f"max |Δ| per layer boundary, log scale (one # per 1/3 decade above 1e{lo}):", "", "```text", *bars, "```"]
    return out
