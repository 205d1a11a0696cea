"""report.md: the verdict as Markdown to paste into a bug report or a CI summary.

Rendered from report.json alone: verdict, causes with evidence and next steps, the
divergent context side by side, drift, comparisons and environment differences.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..compare.causes import ADVICE, TITLES
from .figures import apart, chosen_logprobs, difference_text, differing_entry, topk_bound
from .text import MAGNITUDE_TITLES, cause_summary, diagnose_command, reproduction_line, drift_summary, equal_drift_line, magnitude_line, sensitivity_line
from . import engaged


def _cell(value: Any) -> str:
    """Safe inside a table cell: inline code, pipes escaped, newlines shown as \\n."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = text.replace("\n", "\\n").replace("|", "\\|").replace("`", "'")
    if len(text) > 120:
        text = text[:117] + "..."
    return f"`{text}`" if text else "` `"


def _fenced(text: str) -> list[str]:
    """A code block whose fence is longer than any backtick run in `text`."""
    fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", text)), default=0))
    return [fence + "text", text, fence]


def _num(x: float | None, fmt: str = ".6g") -> str:
    return "n/a" if x is None else format(x, fmt)


def _tok(side: dict[str, Any]) -> str:
    if side["token_id"] is None:
        return "*(generation ended)*"
    return f"{side['token_id']} {_cell(repr(side['token_text']))}"


def _top(side: dict[str, Any], texts: dict[int, str], entry: tuple[int, str] | None = None) -> str:
    """A side's top-k, one entry a line; `entry` (id, its value printed apart from the other side's):
    the differing entry, in bold."""
    top = side.get("top_logprobs") or []
    rows = []
    for tid, lp in top:
        value = f"**{entry[1]}** ◀" if entry is not None and tid == entry[0] else _num(lp, ".4g")
        rows.append(" ".join([str(tid)] + ([_cell(repr(texts[tid]))] if tid in texts else []) + [value]))
    return "<br>".join(rows) or "n/a"


def _entries(d: dict[str, Any]) -> tuple[tuple[int, str] | None, tuple[int, str] | None]:
    """The differing entry on each side, (id, value printed apart), for the top-k cells."""
    e = differing_entry(d)
    if e is None:
        return None, None
    values = apart(e["left"], e["right"]) if e["only"] is None else (apart(e[e["only"]], None)[0],) * 2
    return tuple(None if e[s] is None else (e["id"], v) for s, v in zip(("left", "right"), values))  # type: ignore[return-value]


def _divergence(d: dict[str, Any]) -> list[str]:
    left, right = d["left"], d["right"]
    texts = {s["token_id"]: s["token_text"] for s in (left, right) if s["token_id"] is not None}
    label = (d.get("magnitude") or {}).get("label")
    lps, entries = chosen_logprobs(d), _entries(d)
    if label:
        tie = f"**{MAGNITUDE_TITLES.get(label, label)}**: {magnitude_line(d).partition(': ')[2] or 'noise floor ' + _num(d['noise_floor'], 'g')}"
    else:  # a report written before magnitudes existed
        tie = (f"**yes**: a margin is below the noise floor {d['noise_floor']:g}, so a numeric tie flipped"
               if d["near_tie"] else f"no (noise floor {_num(d['noise_floor'], 'g')})")
    lines = [
        "## First divergence", "",
        f"Prompt {d['prompt_index']} (`{d['prompt_id'][:12]}`), generated token **{d['token_index']}**, kind `{d['kind']}`, "
        f"in *{d['comparison']}*. {'Magnitude' if label else 'Near tie'}: {tie}.", "",
        "Common prefix (the generated text both sides agree on):", "", *_fenced(d["common_prefix_text"][-400:] or "(empty)"), "",
        f"| | left: {_cell(left['label'])} | right: {_cell(right['label'])} |", "|---|---|---|",
        f"| token | {_tok(left)} | {_tok(right)} |",
        f"| logprob of its own token | {lps[0] or 'n/a'} | {lps[1] or 'n/a'} |",
        *([] if left["token_id"] == right["token_id"] else
          [f"| logprob of the other side's token | {_num(left['other_logprob'])} | {_num(right['other_logprob'])} |"]),
        f"| margin (top-1 minus top-2) | {_num(left['margin'], '.4g')} | {_num(right['margin'], '.4g')} |",
        f"| top-k | {_top(left, texts, entries[0])} | {_top(right, texts, entries[1])} |",
    ]
    if d["kind"] == "input_ids" and d.get("input_ids"):
        ids = d["input_ids"]
        lines += [f"| input ids | {_cell(ids['left'])} | {_cell(ids['right'])} |",
                  f"| first different input id | {ids['first_difference']} | |"]
    if difference := difference_text(d, ".6g"):
        lines += ["", "The " + difference.replace("|", "\\|") + "."]
    return lines + [""]


def _evidence(ev: dict[str, Any]) -> list[str]:
    out = []
    for key, value in ev.items():
        if key == "comparisons" or value in ([], {}, None):
            continue
        if isinstance(value, list) and value and all(isinstance(x, dict) and "field" in x for x in value):
            out.append(f"   - {key}:")  # nested under "1. ": three spaces, then five
            out += [f"     - {_cell(x['field'])}: {_cell(x['left'])} → {_cell(x['right'])}" for x in value[:12]]
            if len(value) > 12:
                out.append(f"     - … {len(value) - 12} more")
        elif isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
            out.append(f"   - {key}:")
            for x in value[:12]:
                if set(x) == {"file", "left", "right"}:
                    out.append(f"     - {_cell(x['file'])}: {_cell(x['left'])} → {_cell(x['right'])}")
                else:
                    out.append("     - " + ", ".join(f"{k} {_cell(v)}" for k, v in x.items()))
        elif isinstance(value, dict) and set(value) == {"left", "right"}:
            out.append(f"   - {key}: {_cell(value['left'])} → {_cell(value['right'])}")
        else:
            out.append(f"   - {key}: {_cell(value)}")
    return out


def _causes(title: str, causes: list[dict[str, Any]], advice: bool) -> list[str]:
    lines = [f"## {title}", ""]
    for n, c in enumerate(causes, 1):
        lines.append(f"{n}. **{c['code']}**: {TITLES[c['code']]}: {cause_summary(c)}")
        if advice:
            lines.append(f"   - *next*: {ADVICE[c['code']]}")
        lines += _evidence(c["evidence"])
    return lines + [""]


def _sides(report: dict[str, Any]) -> list[str]:
    s = report["summary"]
    if "left" not in s or "right" not in s:
        keys = [k for k in ("backend", "model", "runs", "batch_sizes", "prompts", "generated_tokens", "atol") if k in s]
        return ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys), "| " + " | ".join(_cell(s[k]) for k in keys) + " |", ""] if keys else []
    rows = [("selection", "label"), ("folder", "folder"), ("backend", "backend"), ("model", "model"), ("dtype", "dtype"),
            ("device", "device"), ("recorded at tier", "tier"), ("prompts", "records")]
    lines = ["| | left | right |", "|---|---|---|"]
    lines += [f"| {name} | {_cell(s['left'][k])} | {_cell(s['right'][k])} |" for name, k in rows]
    return lines + [""]


def _drift(comps: list[dict[str, Any]]) -> list[str]:
    rows = [c for c in comps if c["drift"].get("available")]
    if not rows:
        return []
    lines = ["## Drift before the first divergence", "",
             "| comparison | steps | max \\|Δ logprob\\| of chosen tokens | mean top-k overlap | argmax flips |", "|---|---|---|---|---|"]
    for c in rows:
        d = c["drift"]
        bound = topk_bound(c)
        topk = "" if bound is None else f" (top-k entries ≥{bound:.3g})"
        lines.append(f"| {_cell(c['name'])} | {d['steps']} | {_num(d['max_abs_logprob_diff'], '.3g')}{topk} | "
                     f"{_num(d['mean_topk_overlap'], '.4f')} | {d['argmax_flips']} |")
    lines.append("")
    for c in rows:
        d = c["drift"]
        dist = drift_summary(d)
        if dist and (d.get("max_abs_logprob_diff") or d.get("argmax_flips")):
            lines.append(f"- *{c['name']}*: {dist}")
        if d.get("tokens_equal_logprobs_differ"):
            lines.append(f"- *{c['name']}*: **{equal_drift_line(d['tokens_equal_logprobs_differ'])}**")
    return lines + [""]


def _magnitude(report: dict[str, Any]) -> list[str]:
    m = report.get("magnitude")
    if not m:
        return []
    counts = ", ".join(f"{MAGNITUDE_TITLES.get(k, k)} {n}" for k, n in sorted(m["counts"].items()))
    return [f"Magnitude: **{MAGNITUDE_TITLES.get(m['label'], m['label'])}**" + (f" ({counts})." if counts else "."), ""]


def _not_causes(report: dict[str, Any]) -> list[str]:
    lines = []
    inert = report.get("inert_differences") or []
    if inert:
        lines += ["## Differences that never change the computation", "", "| field | left | right | why not a cause |", "|---|---|---|---|"]
        lines += [f"| {_cell(d['field'])} | {_cell(d['left'])} | {_cell(d['right'])} | {_cell(d['why'])} |" for d in inert[:20]]
        lines.append("")
    skipped = report.get("not_compared") or []
    if skipped:
        lines += ["## Not compared across schema versions", "", "| field | reason |", "|---|---|"]
        lines += [f"| {_cell(d['field'])} | {_cell(d['reason'])} |" for d in skipped[:20]]
        lines.append("")
    return lines


def _environment(report: dict[str, Any]) -> list[str]:
    env = [c for c in report["causes"] + (report.get("info") or []) if c["code"] in ("ENV_MISMATCH", "BACKEND_MISMATCH")]
    fields = [x for c in env for x in c["evidence"].get("differences", []) + c["evidence"].get("engine", [])]
    if not fields:
        return []
    lines = ["## Environment differences", "", "| field | left | right |", "|---|---|---|"]
    lines += [f"| {_cell(x['field'])} | {_cell(x['left'])} | {_cell(x['right'])} |" for x in fields[:40]]
    return lines + [""]


def render_markdown(report: dict[str, Any]) -> str:
    tier = report["tier"]
    verdict = report["status"] + ("" if report["category"] in ("PASS", report["status"]) else f": {report['category']}")
    tier_note = "" if tier["requested"] == tier["effective"] else f" (requested {tier['requested']}, downgraded)"
    lines = [f"# detllm {report['command']}: {verdict}", "",
             f"Tier {tier['effective']}{tier_note}." + (f" Most likely: {TITLES[report['category']]}." if report["category"] in TITLES else ""), ""]
    if line := reproduction_line(report):
        lines += [f"**{line}**", ""]
    if report.get("scope"):
        lines += [f"Scope: {report['scope']}.", ""]
    if report.get("sensitivity"):
        lines += [line[0].upper() + line[1:] + "." for line in sensitivity_line(report["sensitivity"], report.get("negative_control"), report["comparisons"])] + [""]
    if eng := engaged.lines(report):
        lines += [f"- {line}" for line in eng] + [""]
    lines += _sides(report)
    lines += _magnitude(report)
    if report["causes"]:
        lines += _causes("Causes, most likely first", report["causes"], advice=True)
        command = diagnose_command(report)
        if command is not None:
            lines += [f"**Next:** `{command}` finds the setting that makes it stop.", ""]
    if report["first_divergence"] is not None:
        lines += _divergence(report["first_divergence"])
    lines += _drift(report["comparisons"])
    if report["comparisons"]:
        lines += ["## Comparisons", "", "| status | comparison | required | prompts diverged | unmatched |", "|---|---|---|---|---|"]
        for c in report["comparisons"]:
            unmatched = len(c["unmatched"]["left_only"]) + len(c["unmatched"]["right_only"])
            lines.append(f"| {c['status']} | {_cell(c['name'])} | {'yes' if c['required'] else 'no'} | "
                         f"{c['prompts_diverged']}/{c['prompts_compared']}{engaged.comparison_note(c).replace('|', chr(92) + '|')} | {unmatched} |")
        lines.append("")
    lines += _environment(report)
    if report.get("info"):
        lines += _causes("Recorded differences that did not fail the verdict", report["info"], advice=False)
    lines += _not_causes(report)
    return "\n".join(lines).rstrip() + "\n"
