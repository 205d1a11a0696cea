"""sweep.json as a table (txt, md) and a heatmap PNG (matplotlib, the plot extra).

Owns presentation only. The heatmap's rows are the combinations of every axis but the last,
its columns the last axis' values; colour is log10 of the max |dlogprob| against the reference
cell, and each square names its label and token divergence rate.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _cell(c: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in c["cell"].items())


def _row(c: dict[str, Any]) -> list[str]:
    if c["status"] != "ran":
        return [_cell(c), "error", "-", "-", "-", "-", "-", c.get("error", "")[:60]]
    lo, hi = c["prompt_wilson_95"]
    vs_ref = f"{c['vs_reference_max_abs_logprob_diff']:.3g}" + (f" (+{c['null_logprob_steps']} null)" if c.get("null_logprob_steps") else "")
    return [_cell(c), c["label"], str(c["max_unique_outputs"]), f"{c['diverged']}/{c['observations']}",
            f"{c['prompts_diverged']}/{c['prompts_compared']}", f"[{lo:.2f}, {hi:.2f}]", vs_ref, f"{c['within_cell_max_abs_logprob_diff']:.3g}"]


HEAD = ["cell", "label", "unique/prompt", "outputs diverged", "prompts diverged", "Wilson 95% (prompts)", "max |dlp| vs ref",
        "max |dlp| in cell"]


def reference_text(doc: dict[str, Any]) -> str:
    """The reference cell, and why it is not the first cell when that one errored."""
    ref = doc["reference_cell"]
    first = doc["cells"][0]["cell"] if doc["cells"] else None
    if ref is None:
        return "reference: none, every cell errored"
    text = "reference: " + ", ".join(f"{k}={v}" for k, v in ref.items())
    if first is not None and first != ref:
        text += " (the first cell, " + ", ".join(f"{k}={v}" for k, v in first.items()) + ", errored)"
    return text


def render_text(doc: dict[str, Any]) -> str:
    rows = [HEAD] + [_row(c) for c in doc["cells"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEAD))]
    lines = [f"SWEEP {doc['backend']} {doc['model']}: {len(doc['cells'])} cells x {doc['repeats']} repeats x {doc['prompts']} prompts "
             f"in {doc['seconds']:.1f} s ({reference_text(doc)})"]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    if doc.get("heatmap"):
        lines.append(f"heatmap: {doc['heatmap']}")
    return "\n".join(lines) + "\n"


def render_markdown(doc: dict[str, Any]) -> str:
    out = [f"# detllm sweep: {doc['backend']} / {doc['model']}", "",
           f"{len(doc['cells'])} cells x {doc['repeats']} repeats x {doc['prompts']} prompts in {doc['seconds']:.1f} s; "
           "labels: stable (repeats identical), fragile (tokens repeat, logprobs drift), unstable (tokens differ between repeats). "
           "Outputs diverged: outputs (prompts x repeats) whose tokens differ from the reference cell's; prompts diverged: prompts "
           "with any such repeat, with the Wilson 95% interval over prompts (repeats of one prompt are correlated, so the prompt "
           f"is the independent unit). {reference_text(doc).capitalize()}.", "",
           "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    out += ["| " + " | ".join(_row(c)) + " |" for c in doc["cells"]]
    if doc.get("heatmap"):
        out += ["", f"![heatmap]({doc['heatmap']})"]
    return "\n".join(out) + "\n"


def heatmap(doc: dict[str, Any], path: Path) -> str | None:
    """Write the heatmap; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    axes = doc["axes"]
    cols = [str(v) for v in axes[-1]["values"]]
    row_keys: list[tuple] = []
    for c in doc["cells"]:
        key = tuple(c["cell"][a["name"]] for a in axes[:-1])
        if key not in row_keys:
            row_keys.append(key)
    grid = [[math.nan] * len(cols) for _ in row_keys]
    notes = [[""] * len(cols) for _ in row_keys]
    for c in doc["cells"]:
        r = row_keys.index(tuple(c["cell"][a["name"]] for a in axes[:-1]))
        k = cols.index(str(c["cell"][axes[-1]["name"]]))
        if c["status"] != "ran":
            notes[r][k] = "error"
            continue
        grid[r][k] = math.log10(max(c["vs_reference_max_abs_logprob_diff"], 1e-12))
        notes[r][k] = f"{c['label']}\n{c['diverged']}/{c['observations']}"
    ylabels = [", ".join(f"{a['name']}={v}" for a, v in zip(axes[:-1], key)) or "-" for key in row_keys]
    width = 2.8 + 1.5 * len(cols) + 0.075 * max(len(t) for t in ylabels)  # inches: room for the row labels and the colour bar
    fig, ax = plt.subplots(figsize=(width, 1.3 + 0.6 * len(row_keys)))
    im = ax.imshow(grid, cmap="viridis", vmin=-12, vmax=0, aspect="auto")
    ax.set_xticks(range(len(cols)), [f"{axes[-1]['name']}={v}" for v in cols])
    ax.set_yticks(range(len(row_keys)), ylabels)
    for r in range(len(row_keys)):
        for k in range(len(cols)):
            dark = math.isnan(grid[r][k]) or grid[r][k] < -5  # viridis is dark below about -5 on this scale
            ax.text(k, r, notes[r][k], ha="center", va="center", fontsize=7, color="white" if dark else "black")
    fig.colorbar(im, ax=ax, label="log10 max |dlogprob| vs reference cell")
    ax.set_title(f"{doc['backend']} {doc['model']}: drift against the reference cell", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name
