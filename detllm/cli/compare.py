"""`detllm diff`, `detllm diagnose` and `detllm sweep`: the commands that find and explain a
difference (docs/causes.md, docs/diagnose.md). diff compares recorded artifacts and imports no
engine; diagnose and sweep run probes and grids through the library (diagnose/).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..runfolder.artifacts import check_output_file
from ..core.errors import UsageError
from .shell import Backend, JUnit, Model, app, emit, guarded, write_html


@app.command(help="Compare two run folders (or FOLDER::run_N, FOLDER::batch_B, FOLDER::run_N@batch_B selections): "
                  "first divergent token, ranked causes with evidence, drift. No engine is imported (except with --locate).")
def diff(
    a: Annotated[Optional[str], typer.Argument(metavar="A", help="Left side: FOLDER, FOLDER::run_N@batch_B (default run 0 at its --batch-size) or a trace .jsonl file.")] = None,
    b: Annotated[Optional[str], typer.Argument(metavar="B", help="Right side, the same way.")] = None,
    more: Annotated[Optional[list[str]], typer.Argument(metavar="C", help="More sides: an N-way diff of run folders (docs/fleet.md): traces grouped per prompt, the majority and the outliers; --out writes fleet.json.")] = None,
    left: Annotated[Optional[str], typer.Option("--left", help="Left side, instead of A (the seed's spelling).")] = None,
    right: Annotated[Optional[str], typer.Option("--right", help="Right side, instead of B.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write report.json, report.txt, report.md (and diffs/) here.")] = None,
    force: Annotated[bool, typer.Option(help="Write into an existing non-detllm folder.")] = False,
    tier: Annotated[Optional[int], typer.Option(help="1 tokens, 2 + logprobs and top-k, 3 + across batch sizes (default: the lower recorded tier).")] = None,
    atol: Annotated[float, typer.Option(help="Logprob tolerance at tier >= 2 (0 = bitwise).")] = 0.0,
    junit: JUnit = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="PNG of logprob drift by position (needs matplotlib).")] = None,
    html: Annotated[Optional[Path], typer.Option("--html", help="Also write a self-contained HTML report here.")] = None,
    validate_schema: Annotated[bool, typer.Option("--validate-schema", help="Accepted for compatibility: every artifact is always validated.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print report.json instead of the verdict.")] = False,
    locate: Annotated[bool, typer.Option("--locate", help="Then run `detllm locate` on the two sides (into --out when given): the only "
                                                          "path on which diff loads an engine, to re-run each side's recorded batch.")] = False,
    script: Annotated[Optional[list[str]], typer.Option("--script", metavar="PATH.py[:make]", help="Two training packs made with "
                                                        "--script: their script (once for both, or A's then B's; sha256 checked), "
                                                        "to re-run the divergent step for max |Δ| and the first op.")] = None,
) -> None:
    def body() -> int:
        from ..commands.diffsides import diff_any, pick_sides

        if more and script:
            raise UsageError("--script applies to a diff of two training packs")
        if more:  # N sides: the fleet's N-way verdict (detllm/fleet/nway.py)
            return nway(a, b, more, left, right, out, atol, tier, junit, plot, html, as_json)
        left_arg, right_arg = pick_sides(a, b, left, right)
        check_output_file(html, "--html")
        if html is not None:
            from ..training.diffing import is_training_side

            if is_training_side(left_arg) or is_training_side(right_arg):
                raise UsageError("--html does not apply to training packs")
        outcome = diff_any(left_arg, right_arg, out=out, force=force, atol=atol, tier=tier, junit=junit, plot=plot, script=script)
        if not hasattr(outcome, "report"):  # two training packs (training/diffing.py)
            from .training import emit_training

            return emit_training(outcome, as_json)
        write_html(outcome, html)
        code = emit(outcome, as_json=as_json, folder_line=not locate)  # the library wrote --junit; --locate: the folder last
        if locate:
            from .locate import after_diff

            after_diff(left_arg, right_arg, outcome.out_dir, quiet=as_json)
        return code

    guarded(body)


def nway(a, b, more, left, right, out, atol, tier, junit, plot, html, as_json) -> int:
    from ..fleet.nway import fleet_diff
    from .fleet import emit_fleet

    if left is not None or right is not None or plot is not None:
        raise UsageError("an N-way diff takes its sides as A B C ...; --left, --right and --plot are for two sides")
    check_output_file(junit, "--junit")
    check_output_file(html, "--html")
    outcome = fleet_diff([a, b, *more], out=out, atol=atol, tier=tier)
    return emit_fleet(outcome, as_json=as_json, junit=junit, html=html)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             help="From a FAIL to the knob that causes it: `detllm diagnose RUN_DIR` (a failing check or diff folder) or "
                  "`detllm diagnose CHECK-OPTIONS` (runs that check first, into OUT/baseline). Runs real probes, cheapest "
                  "first, and writes diagnosis.json/.txt/.md/.html. Exit 0 when the diagnosis was written.")
def diagnose(
    ctx: typer.Context,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Diagnosis folder (default: a new folder under artifacts/).")] = None,
    force: Annotated[bool, typer.Option(help="Replace an earlier diagnosis in --out.")] = False,
    budget: Annotated[Optional[str], typer.Option(help="Probe count (12) or time (90s, 5m).")] = None,
    fresh_repeats: Annotated[int, typer.Option(help="Fresh processes per fresh-process probe and confirmation.")] = 3,
    probe: Annotated[Optional[list[str]], typer.Option("--probe", help="Run only these probes (repeatable): a knob (kv_type, threads, batch_invariant...) or ladder, needle, fresh_process, prefill.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print diagnosis.json instead of the text.")] = False,
    tier: Annotated[Optional[int], typer.Option("--tier", help="A folder: judge the divergence at this tier instead of the recorded one (3: logprobs across batch sizes). With a check's options: the check's tier.")] = None,
    atol: Annotated[Optional[float], typer.Option("--atol", help="A folder: logprob tolerance at tier >= 2 instead of the recorded one (0 = bitwise). With a check's options: the check's --atol.")] = None,
    ray: Annotated[Optional[str], typer.Option("--ray", metavar="ADDRESS", help="Run every probe as a Ray task, all on one node of the cluster at ADDRESS (HOST:PORT or auto); takes a folder (docs/ray.md).")] = None,
    ray_test_hold: Annotated[Optional[str], typer.Option("--ray-test-hold", hidden=True)] = None,
) -> None:
    def body() -> int:
        import contextlib

        from ..diagnose import diagnose as run_diagnosis
        from ..diagnose.render import render_text

        args = list(ctx.args)
        run_dir = args[0] if len(args) == 1 and not args[0].startswith("-") else None
        if not args:
            raise UsageError("diagnose needs a failing run folder or check's options", hint="e.g. detllm diagnose RUN_DIR")
        say = None if as_json else (lambda text: typer.echo(f"detllm: {text}", err=True))
        judge_tier, judge_atol = tier, atol
        if run_dir is None:  # the check's options: --tier/--atol are the check's own, as before they judged a folder
            args += [*(["--tier", str(tier)] if tier is not None else []), *(["--atol", repr(atol)] if atol is not None else [])]
            judge_tier = judge_atol = None
        if ray is not None and run_dir is None:
            raise UsageError("diagnose --ray takes a failing run folder, not a check's options",
                             hint="run the check first (locally or with check --ray), then: detllm diagnose FOLDER --ray ADDRESS")
        with contextlib.nullcontext() if ray is None else _ray_pools(ray, ray_test_hold) as pools:
            result = run_diagnosis(run_dir=run_dir, check_args=None if run_dir else args, out=out, force=force, budget=budget,
                                   fresh_repeats=fresh_repeats, progress=say, only=probe, tier=judge_tier, atol=judge_atol,
                                   pool_factory=pools)
        typer.echo(json.dumps(result.doc, indent=2) if as_json else render_text(result.doc) + f"diagnosis folder: {result.out_dir}")
        return 0

    guarded(body)


@app.command(help="Run a grid of settings (--axis batch_size=1,2,8 --axis dtype=float32,bfloat16 --axis threads=1,2; any other "
                  "axis name is a backend --opt) with --repeats per cell: each cell labelled stable / fragile / unstable, unique "
                  "outputs per prompt, divergence rate against the first cell that ran with a Wilson 95% interval over prompts; "
                  "sweep.json, a table "
                  "and heatmap.png. Exit 0 when the sweep was written.")
def sweep(
    axis: Annotated[list[str], typer.Option("--axis", help="name=v1,v2 (repeatable).")],
    repeats: Annotated[int, typer.Option(help="Repeats per cell (in one process).")] = 3,
    backend: Backend = "hf",
    model: Model = "tiny",
    prompts: Annotated[Optional[Path], typer.Option(help="Prompt file (.jsonl or text).")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Sweep folder (default: a new folder under artifacts/).")] = None,
    force: Annotated[bool, typer.Option(help="Replace an earlier sweep in --out.")] = False,
    tier: Annotated[int, typer.Option(help="Tier recorded for each cell's runs.")] = 2,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per prompt.")] = 16,
    dtype: Annotated[str, typer.Option(help="dtype of cells without a dtype axis.")] = "float32",
    seed: Annotated[int, typer.Option(help="Seed for every run.")] = 0,
    opt: Annotated[Optional[list[str]], typer.Option("--opt", help="Backend option key=value for every cell (repeatable).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print sweep.json instead of the table.")] = False,
    ray: Annotated[Optional[str], typer.Option("--ray", metavar="ADDRESS", help="Run every cell at once as a Ray task, all on one node of the cluster at ADDRESS (HOST:PORT or auto) (docs/ray.md).")] = None,
) -> None:
    def body() -> int:
        import contextlib

        from ..core.config import Decoding, RunConfig, parse_options
        from ..diagnose.sweep import sweep as run_sweep
        from ..diagnose.sweep_render import render_text

        cfg = RunConfig(backend=backend, model=model, dtype=dtype, seed=seed, tier=tier,
                        decoding=Decoding(max_new_tokens=max_new_tokens), options=parse_options(opt or []))
        say = None if as_json else (lambda text: typer.echo(f"detllm: {text}", err=True))
        with contextlib.nullcontext() if ray is None else _ray_cells(ray) as cells:
            folder, doc = run_sweep(cfg, axis, repeats=repeats, prompts=prompts, out=out, force=force, progress=say, run_cells=cells)
        typer.echo(json.dumps(doc, indent=2) if as_json else render_text(doc) + f"sweep folder: {folder}")
        return 0

    guarded(body)


def _ray_pools(address: str, hold: str | None):
    """diagnose --ray: the probes' pool on the cluster (detllm.cluster.probes); ray is imported only here."""
    from ..cluster.probes import ray_pools
    from .cluster import _hold

    return ray_pools(address, _hold(hold))


def _ray_cells(address: str):
    """sweep --ray: the cells' runner on the cluster (detllm.cluster.cells); ray is imported only here."""
    from ..cluster.cells import ray_cells

    return ray_cells(address)
