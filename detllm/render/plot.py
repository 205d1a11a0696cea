"""A PNG of logprob drift by generated-token position (`--plot FILE`), one line per
comparison, with the first divergence marked. Needs matplotlib (detllm[plot]); its
absence is one UsageError, raised before anything runs.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from ..core.errors import UsageError


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib, which is not installed", hint="pip install 'detllm[plot]'")


def write_plot(report: dict[str, Any], path: Path) -> Path:
    """Largest |dlogprob| over prompts at each position (symlog: exact zeros stay visible)."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    drawn = 0
    for comp in report["comparisons"]:
        series = comp["drift"].get("max_abs_logprob_diff_by_position") or []
        if series:
            ax.plot(range(len(series)), series, label=comp["name"], linewidth=1)
            drawn += 1
        d = comp["first_divergence"]
        if d is not None:
            ax.axvline(d["token_index"], linestyle="--", linewidth=1, color="red")
    d = report["first_divergence"]
    title = f"detllm {report['command']}: {report['status']}"
    if d is not None:
        title += f" (prompt {d['prompt_index']} diverges at token {d['token_index']})"
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("generated-token position")
    ax.set_ylabel("max |Δ logprob| of the chosen token")
    ax.set_yscale("symlog", linthresh=1e-9)
    ax.set_ylim(bottom=0)
    if drawn:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no logprobs recorded: nothing to plot", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)  # atomic, like every other file detllm writes
    finally:
        tmp.unlink(missing_ok=True)
    return path
