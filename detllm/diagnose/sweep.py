"""`detllm sweep`: run a grid of settings with repeats and put numbers on each cell.

Owns the grid (axes batch_size, dtype, threads, or any backend option), running each cell as
a real `run` in a probe worker (the model stays loaded between cells of one process; options
that need a new engine get one from the backend), and the statistics: per cell a label
(stable / fragile: tokens repeat, logprobs drift / unstable), unique outputs per prompt, the
divergence rate against the reference cell (the first cell that ran) with a Wilson 95% interval
over prompts (the independent unit: repeats of one prompt in one process are correlated), and a
table plus heatmap. Judging reads run folders only.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from ..runfolder import artifacts
from ..compare.steps import abs_diff
from ..core.config import RunConfig
from ..core.config import parse_axes as config_parse_axes
from ..runfolder.env import detllm_version
from ..core.errors import UsageError
from ..runfolder.nestseal import seal_nested
from .pool import Pool

CONFIG_AXES = {"batch_size": int, "dtype": str, "threads": int}
SWEEP = "sweep.json"


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval for k successes in n trials (95% by default)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, centre - half), min(1.0, centre + half)


def parse_axes(specs: list[str]) -> list[tuple[str, list[str]]]:
    """`name=v1,v2` strings to [(name, values)] by the tool's one axis parser (config.parse_axes)."""
    return config_parse_axes(specs, int_axes=[n for n, kind in CONFIG_AXES.items() if kind is int], command="sweep")


def cell_config(base: RunConfig, cell: dict[str, str], repeats: int) -> RunConfig:
    """The run config of one cell: config axes set directly, any other axis as a backend option."""
    opts = dict(base.options)
    fields: dict[str, Any] = {"runs": repeats, "vary_batch": (), "mode": "best-effort"}
    for name, value in cell.items():
        if name in CONFIG_AXES:
            fields[name] = CONFIG_AXES[name](value)
        else:
            opts[name] = value
    return dataclasses.replace(base, options=tuple(sorted(opts.items())), **fields)


def _outputs(records: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    by: dict[int, list[dict[str, Any]]] = {}
    for r in sorted(records, key=lambda r: (r["prompt_index"], r["run_index"])):
        by.setdefault(r["prompt_index"], []).append(r)
    return by


def _lp_diffs(a: dict[str, Any], b: dict[str, Any]) -> list[float]:
    """|dlogprob| per step over the steps where the tokens agree, by the one NaN rule
    (compare/steps.py): null equals null, null against a number is inf."""
    la, lb = a.get("logprobs") or [], b.get("logprobs") or []
    n = next((i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y), min(len(a["token_ids"]), len(b["token_ids"])))
    return [abs_diff(x, y) for x, y in zip(la[:n], lb[:n])]


def judge_cell(records: list[dict[str, Any]], reference: list[dict[str, Any]] | None, *, atol: float = 0.0) -> dict[str, Any]:
    """Label, unique outputs per prompt, and the divergence rate against the reference cell's
    first repeat: outputs (prompts x repeats) for the count, prompts (a prompt diverges when any
    of its repeats does) for the Wilson interval, since repeats of one prompt are correlated.
    A step whose logprob is null on one side only counts as drift but is no value: it is
    counted in `null_logprob_steps`, never in a maximum."""
    mine = _outputs(records)
    ref = _outputs(reference) if reference is not None else mine
    unique, within_tokens, within_lp, nulls = {}, False, [0.0], 0
    k = n = kp = 0
    ref_lp = [0.0]
    for p, recs in mine.items():
        seqs = {tuple(r["token_ids"]) for r in recs}
        unique[p] = len(seqs)
        within_tokens |= len(seqs) > 1
        for r in recs[1:]:
            within_lp += _lp_diffs(recs[0], r)
        anchor = ref.get(p, recs)[0]
        differs = [r["token_ids"] != anchor["token_ids"] for r in recs]
        n += len(recs)
        k += sum(differs)
        kp += any(differs)
        for r in recs:
            d = _lp_diffs(anchor, r)
            ref_lp += d
            nulls += sum(x == math.inf for x in d)
    within_inf = any(x == math.inf for x in within_lp)
    within, vs_ref = _finite_max(within_lp), _finite_max(ref_lp)
    label = "unstable" if within_tokens else ("fragile" if within > atol or within_inf else "stable")
    lo, hi = wilson(kp, len(mine))
    return {"label": label, "unique_outputs_per_prompt": unique, "max_unique_outputs": max(unique.values(), default=0),
            "within_cell_max_abs_logprob_diff": within, "diverged": k, "observations": n, "divergence_rate": k / n if n else 0.0,
            "prompts_diverged": kp, "prompts_compared": len(mine), "prompt_wilson_95": [lo, hi],
            "vs_reference_max_abs_logprob_diff": vs_ref, "null_logprob_steps": nulls}


def _finite_max(values: list[float]) -> float:
    return max((v for v in values if v != math.inf), default=0.0)


def _check_options(config: RunConfig, cells: list[dict[str, str]], repeats: int) -> None:
    """Every cell's config and backend options parsed and range-checked before anything runs."""
    from ..backends.base import parse_options
    from ..backends.registry import BACKENDS, backend_class

    for cell in cells:
        cfg = cell_config(config, cell, repeats)
        cfg.validate(command="run")
        if cfg.backend in BACKENDS and backend_class(cfg.backend).Options is not None:
            parse_options(backend_class(cfg.backend).Options, cfg.options, cfg.backend)


def sweep(config: RunConfig, axes: list[str] | list[tuple[str, list[str]]], *, repeats: int = 3, prompts: str | Path | None = None,
          out: str | Path | None = None, force: bool = False, progress: Callable[[str], None] | None = None,
          run_cells: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None) -> tuple[Path, dict[str, Any]]:
    """Run every cell of the grid; write sweep.json, sweep.txt, sweep.md and heatmap.png (when
    matplotlib is installed) under `out`; return (folder, document). `run_cells`: runs every cell's
    job at once elsewhere, each writing its folder at job["out"] (sweep --ray: cluster/cells.py);
    None: one after another in a local probe worker."""
    from ..core.prompts import load_prompts

    grid = parse_axes(list(axes)) if axes and isinstance(list(axes)[0], str) else [(a, list(v)) for a, v in axes]  # type: ignore[misc]
    if repeats < 2:
        raise UsageError(f"--repeats must be at least 2, got {repeats}")
    cells = [dict(zip([a for a, _ in grid], combo)) for combo in itertools.product(*[v for _, v in grid])]
    _check_options(config, cells, repeats)  # every bad value refused before anything runs
    texts = load_prompts(prompts).texts
    out = Path(out) if out is not None else artifacts.default_out_dir("sweep")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not ((out / SWEEP).is_file() and force))):
        raise UsageError(f"--out {str(out)!r} is not an empty folder", hint="choose another --out (or --force over an earlier sweep)")
    if out.is_dir():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    pfile = out / "prompts.jsonl"
    artifacts.atomic_write_text(pfile, "".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    reference, reference_cell = None, None
    jobs = [{"kind": "run", "config": (cfg := cell_config(config, cell, repeats)).to_json(), "prompts": str(pfile), "tier": cfg.tier,
             "out": str(out / "cells" / ("cell-%02d" % i))} for i, cell in enumerate(cells)]
    if run_cells is not None and progress:
        progress(f"{len(cells)} cells at once")
    ran = run_cells(jobs) if run_cells is not None else None
    with Pool(out / "logs") as pool:
        for i, cell in enumerate(cells):
            if progress and ran is None:
                progress(f"cell {i + 1}/{len(cells)}: " + ", ".join(f"{k}={v}" for k, v in cell.items()))
            folder = Path(jobs[i]["out"])
            started = time.monotonic()
            res = ran[i] if ran is not None else pool.shared().run(jobs[i])
            if not res.get("ok"):
                rows.append({"cell": cell, "status": "error", "error": res.get("error", ""), "folder": str(folder.relative_to(out))})
                continue
            records = artifacts.load_trace(folder / artifacts.TRACE, validate_records=False)
            if reference is None:
                reference, reference_cell = records, cell
            rows.append({"cell": cell, "status": "ran", "folder": str(folder.relative_to(out)),
                         "seconds": round(res["seconds"] if ran is not None else time.monotonic() - started, 2), **judge_cell(records, reference, atol=config.atol)})
    doc = artifacts.stamp("sweep", {
        "detllm_version": detllm_version(), "created_at": artifacts.utc_now(), "backend": config.backend, "model": config.model,
        "config": config.to_json(), "axes": [{"name": a, "values": v} for a, v in grid], "repeats": repeats, "prompts": len(texts),
        "reference_cell": reference_cell, "cells": rows, "seconds": round(time.monotonic() - t0, 2), "heatmap": None,
    })
    from .sweep_render import heatmap, render_markdown, render_text

    doc["heatmap"] = heatmap(doc, out / "heatmap.png")
    artifacts.write_json(out, SWEEP, doc)
    artifacts.atomic_write_text(out / "sweep.txt", render_text(doc))
    artifacts.atomic_write_text(out / "sweep.md", render_markdown(doc))
    seal_nested(out)  # last: verify and pack take the folder (runfolder/nestseal.py)
    return out, doc
