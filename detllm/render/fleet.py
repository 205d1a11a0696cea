"""A fleet report (fleet.json) as text, Markdown, a self-contained HTML page and JUnit XML: the
verdict, the replica x prompt matrix (each cell the replica's group at that prompt: A the majority's,
"-" no record, ERR a replica that failed), the groups, identity differences and errors. JUnit has
one testcase per replica. Reads the report only; computes nothing.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Any

from .html import esc, page

MAX_COLUMNS = 40  # prompts shown in the matrix; the rest are summarised


def matrix(doc: dict[str, Any]) -> tuple[list[str], list[tuple[dict[str, Any], list[str]]]]:
    """(column heads, [(replica row, cells)]): the replica x prompt matrix."""
    prompts = doc["prompts"][:MAX_COLUMNS]
    heads = [f"p{p['prompt_index']}" if p["prompt_index"] is not None else p["prompt_id"][:8] for p in prompts]
    rows = []
    for r in doc["replicas"]:
        if r["status"] != "ok":
            rows.append((r, ["ERR"] * len(prompts)))
            continue
        cells = []
        for p in prompts:
            lab = next((g["label"] for g in p["groups"] if r["index"] in g["replicas"]), "-")
            cells.append(lab + ("*" if r["index"] in p["outliers"] else ""))
        rows.append((r, cells))
    return heads, rows


def _role(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return f"{r['error']['kind']}: {r['error']['message']}"
    parts = [f"group {r['group']}"]
    if r["identity_mismatch"]:
        parts.append("IDENTITY MISMATCH")
    if r.get("unstable"):
        parts.append("UNSTABLE (its own repeats differ)")
    if r["outlier"]:
        parts.append("OUTLIER on prompts " + ", ".join(str(p) for p in r["prompts_outside_majority"]))
    if r.get("own_check"):
        parts.append(f"own check {r['own_check']['status']} ({r['own_check']['category']})")
    return "; ".join(parts)


def _lines(doc: dict[str, Any]) -> list[str]:
    """The report's findings as plain sentences, shared by text and Markdown."""
    out = []
    groups = ", ".join(f"{g['label']} = replicas {_ids(g['replicas'])}" for g in doc["groups"])
    out.append(f"replica groups (identical traces on every prompt): {groups or 'none'}")
    if doc["majority"]:
        whose = "reference group" if (doc.get("reference") or {}).get("used") else "majority"
        out.append(f"{whose}: group {doc['majority']['label']} (replicas {_ids(doc['majority']['replicas'])})")
    if doc["outliers"]:
        out.append(f"outliers: replicas {_ids(doc['outliers'])}")
    if doc["no_majority_prompts"]:
        out.append(f"no majority at prompts {_ids(doc['no_majority_prompts'])}: no outlier named there")
    ref = doc.get("reference")
    if ref:
        out.append(f"reference: replica {ref['replica']} (--reference-url): outliers are the replicas that differ from it"
                   if ref["used"] else f"reference: replica {ref['replica']} failed: judged by the majority instead")
    for p in doc["prompts"]:
        name = f"p{p['prompt_index']}" if p["prompt_index"] is not None else p["prompt_id"][:8]
        if p["missing"]:
            out.append(f"{name}: replicas {_ids(p['missing'])} have no record of it (missing, not outliers)")
        if p.get("chained"):
            out.append(f"{name}: replicas {_ids(p['chained'])} agree in a chain within atol but not all with each "
                       "other: no group, each stands alone")
    ident = doc["identity"]
    if len(ident["groups"]) > 1:
        out.append("identity groups: " + "; ".join(f"replicas {_ids(g['replicas'])}" for g in ident["groups"]))
        for d in ident["differences"][:10]:
            out.append(f"  replicas {_ids(d['replicas'])} vs {d['against']}: {d['field']} = {d['value']!r} (reference {d['reference']!r})")
    for e in doc["explanations"]:
        causes = ", ".join(c["code"] for c in e["causes"])
        size = f"{e['magnitude'].replace('_', ' ')}" + (f", max |dlogprob| {e['max_abs_logprob_diff']:.3g}" if e.get("max_abs_logprob_diff") else "")
        out.append(f"group {e['group']} vs replica {e['against']} ({size}): "
                   + (f"pairwise diff causes {causes}" if causes else e.get("note") or "no cause named"))
    for v in doc["variance"]:
        out.append(f"replica {v['replica']}'s own check: {v['status']} ({v['category']})")
    for e in doc["errors"]:
        out.append(f"replica {e['replica']} excluded, {e['kind']}: {e['message']}")
    return out


def _ids(xs: list[Any]) -> str:
    return ", ".join(str(x) for x in xs)


def _head(doc: dict[str, Any]) -> str:
    n_ok = sum(r["status"] == "ok" for r in doc["replicas"])
    return (f"{doc['status']} {doc['category']}: {doc['verdict']} ({n_ok}/{len(doc['replicas'])} replicas compared, "
            f"{len(doc['prompts'])} prompts, tier {doc['tier']['effective']}, atol {doc['atol']:g})")


def render_text(doc: dict[str, Any]) -> str:
    heads, rows = matrix(doc)
    width = max([len(r["name"]) for r, _ in rows] + [7])
    out = [_head(doc), ""]
    out.append(" " * (width + 2) + " ".join(f"{h:>4}" for h in heads))
    for r, cells in rows:
        out.append(f"{r['name']:<{width}}  " + " ".join(f"{c:>4}" for c in cells))
    if len(doc["prompts"]) > MAX_COLUMNS:
        out.append(f"(first {MAX_COLUMNS} of {len(doc['prompts'])} prompts; fleet.json has all)")
    out.append("cells: the replica's group at that prompt (A the majority's or reference's, else the largest); * outside the prompt's majority; - no record; ERR failed")
    out.append("")
    out += [f"replica {r['index']} {r['name']} ({r['source']}): {_role(r)}" for r, _ in rows]
    out.append("")
    out += _lines(doc)
    return "\n".join(out) + "\n"


def render_markdown(doc: dict[str, Any]) -> str:
    heads, rows = matrix(doc)
    out = [f"# detllm fleet ({doc['command']}): {doc['status']} {doc['category']}", "", _head(doc), "",
           "| replica | " + " | ".join(heads) + " | role |", "|---|" + "---|" * (len(heads) + 1)]
    for r, cells in rows:
        out.append(f"| {r['index']} `{r['name']}` | " + " | ".join(cells) + f" | {_role(r).replace('|', '/')} |")
    out += ["", "Cells: the replica's group at that prompt (A the majority's or reference's, else the largest); `*` outside the prompt's majority; `-` no record; ERR failed.", ""]
    out += [f"- {line.strip()}" for line in _lines(doc)]
    return "\n".join(out) + "\n"


def _cell_class(cell: str) -> str:
    if cell == "ERR" or cell.endswith("*"):
        return "cell-FAIL"
    return "cell-PASS" if cell == "A" else "cell-INFO"  # B, C... at a prompt with no majority


def render_html(doc: dict[str, Any]) -> str:
    """One self-contained page (render/html.page): the verdict, the matrix, the findings."""
    heads, rows = matrix(doc)
    title = (f"<h1>detllm fleet ({esc(doc['command'])}) <span class='verdict {esc(doc['status'])}'>{esc(doc['status'])}</span> "
             f"{esc(doc['category'])}</h1>")
    body = [title, f"<p>{esc(_head(doc))}</p>",
            "<table><thead><tr><th>replica</th>" + "".join(f"<th>{esc(h)}</th>" for h in heads) + "<th>role</th></tr></thead><tbody>"]
    for r, cells in rows:
        tds = "".join(f"<td class='{_cell_class(c)}'>{esc(c)}</td>" for c in cells)
        body.append(f"<tr><td>{r['index']} {esc(r['name'])}<br><small class='muted'>{esc(r['source'])}</small></td>{tds}"
                    f"<td>{esc(_role(r))}</td></tr>")
    body.append("</tbody></table><p class='muted'>Cells: the replica's group at that prompt (A the majority's or reference's, else the largest); * outside the "
                "prompt's majority; - no record; ERR the replica failed.</p>")
    body.append("<h2>Findings</h2><ul>" + "".join(f"<li>{esc(line.strip())}</li>" for line in _lines(doc)) + "</ul>")
    return page(f"detllm fleet: {doc['status']} {doc['category']}", body)


def _case(r: dict[str, Any]) -> str:
    """A testcase's name: the replica and where it is (its URL, or the side as given), as a CI dashboard shows it."""
    return f"replica {r['index']} {r['name']}" + (f" {r['source']}" if r["source"] != r["name"] else "")


def render_junit(doc: dict[str, Any]) -> str:
    """One testsuite, one testcase per replica: a failure for an outlier or identity mismatch, an
    error for a replica that failed; agreement (and a split with no majority, which names no one)
    passes, with the groups in <system-out>."""
    suite = ET.Element("testsuite", {"name": f"detllm fleet {doc['command']}"})
    failures = errors = 0
    for r in doc["replicas"]:
        case = ET.SubElement(suite, "testcase", {"classname": "detllm.fleet", "name": _case(r), "time": "0"})
        if r["status"] != "ok":
            errors += 1
            ET.SubElement(case, "error", {"type": r["error"]["kind"], "message": r["error"]["message"]})
        elif r["identity_mismatch"] or r["outlier"]:
            failures += 1
            code = "IDENTITY_MISMATCH" if r["identity_mismatch"] else "OUTLIER"
            ET.SubElement(case, "failure", {"type": code, "message": f"{code}: {_role(r)}"}).text = "\n".join(_lines(doc))
        else:
            ET.SubElement(case, "system-out").text = _role(r)
    suite.set("tests", str(len(doc["replicas"])))
    suite.set("failures", str(failures))
    suite.set("errors", str(errors))
    root = ET.Element("testsuites", {"name": "detllm fleet", "tests": suite.get("tests", "0"), "failures": str(failures), "errors": str(errors)})
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


__all__ = ["matrix", "render_html", "render_junit", "render_markdown", "render_text"]
