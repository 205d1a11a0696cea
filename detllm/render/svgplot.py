"""The one inline-SVG chart of the HTML pages: values by position on a log scale (zeros and unknowns
drawn at the floor), optional ticks under the axis and one marked position with its label. Used by
the diff report's drift plot (render/html.py) and locate's growth plot (render/locate.py); draws only.
"""

from __future__ import annotations

import math


def log_plot(points: list[tuple[int, float | None]], positions: int, *, aria: str, caption: str,
             mark: int | None = None, mark_label: str = "", ticks: list[tuple[int, str]] | tuple = (),
             width: int = 560, height: int = 150) -> str:
    """An SVG of `points` (position, value) over `positions` positions: a log10 y axis with a grid line
    per decade, a value that is None or <= 0 at the floor; `ticks` (position, escaped title) under the
    axis; a dashed line at `mark` labelled `mark_label` (escaped by the caller); `caption` under it."""
    pos = [v for _, v in points if v is not None and v > 0]
    lo = math.floor(math.log10(min(pos))) if pos else -9
    hi = math.ceil(math.log10(max(pos))) if pos else -8
    lo, hi = min(lo, hi - 1), max(hi, lo + 1)
    pad_l, pad_b, pad_t = 46, 20, 8
    w, h = width - pad_l - 8, height - pad_b - pad_t
    n = max(positions - 1, 1)

    def xy(i: int, v: float | None) -> tuple[float, float]:
        lv = math.log10(v) if v is not None and v > 0 else lo
        return pad_l + w * i / n, pad_t + h * (1 - (lv - lo) / (hi - lo))

    parts = [f"<svg width='{width}' height='{height}' role='img' aria-label='{aria}'>",
             f"<rect x='{pad_l}' y='{pad_t}' width='{w}' height='{h}' fill='#f6f8fa' stroke='#d0d7de'/>"]
    for e in range(lo, hi + 1):
        y = xy(0, 10.0 ** e)[1]
        parts.append(f"<line x1='{pad_l}' x2='{pad_l + w}' y1='{y:.1f}' y2='{y:.1f}' stroke='#eaeef2'/>"
                     f"<text x='2' y='{y + 4:.1f}'>1e{e}</text>")
    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(i, v) for i, v in points))
    parts.append(f"<polyline fill='none' stroke='#0969da' stroke-width='1.5' points='{line}'/>")
    for i, title in ticks:
        x = xy(i, None)[0]
        parts.append(f"<line x1='{x:.1f}' x2='{x:.1f}' y1='{pad_t + h - 6}' y2='{pad_t + h}' stroke='#57606a'>"
                     f"<title>{title}</title></line>")
    if mark is not None:
        x = pad_l + w * min(mark, n) / n
        parts.append(f"<line x1='{x:.1f}' x2='{x:.1f}' y1='{pad_t}' y2='{pad_t + h}' stroke='#cf222e' stroke-dasharray='4 3'/>"
                     f"<text x='{x + 3:.1f}' y='{pad_t + 11}' style='fill:#cf222e'>{mark_label}</text>")
    parts.append(f"<text x='{pad_l}' y='{height - 4}'>{caption}</text></svg>")
    return "".join(parts)
