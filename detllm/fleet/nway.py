"""`detllm diff A B C ...`: N run folders (or FOLDER::run_N@batch_B selections, or packs) in one
N-way verdict. Each side is loaded as the pairwise diff loads it (diff.load_sides) and every pair
is compared by its engine (verdict.py); with --out the fleet report is written there.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..core.config import check_atol
from ..commands.diff import Selection, load_sides
from ..core.errors import UsageError
from ..runfolder.seedlayout import refuse_seed_layout
from ..commands.diffsides import as_folder, is_bare_trace
from .folder import FleetOutcome, check_fleet_out, prepare_fleet_out, write_fleet
from ..runfolder.fleetseal import begin_fleet, seal_fleet
from ..commands.fleetverdict import Replica, fleet_verdict, prompt_keys, side_own


def fleet_diff(sides: Sequence[str | Path], *, out: str | Path | None = None, atol: float = 0.0,
               tier: int | None = None) -> FleetOutcome:
    """Group N sides' traces per prompt; the majority, the outliers and identity (verdict.py)."""
    if len(sides) < 2:
        raise UsageError("an N-way diff needs two or more sides")
    check_atol(atol)
    if tier is not None and tier not in (1, 2, 3):
        raise UsageError(f"diff compares outputs: --tier must be 1, 2 or 3, got {tier}")
    args = [as_folder(str(s)) for s in sides]
    for arg in args:
        if is_bare_trace(arg):
            raise UsageError(f"{arg!r} is a bare trace file: an N-way diff compares run folders",
                             hint="pass the run folders (or diff two trace files pairwise)")
        path = Path(arg.rpartition("::")[0] if "::" in arg else arg)
        if path.exists():
            refuse_seed_layout(path)
    sels = [Selection.parse(a) for a in args]
    out_dir = Path(out) if out is not None else None
    if out_dir is not None:
        if any(s.folder.exists() and out_dir.exists() and out_dir.resolve() == s.folder.resolve() for s in sels):
            raise UsageError(f"--out {str(out_dir)!r} is one of the folders being compared", hint="choose another --out")
        check_fleet_out(out_dir)
    loaded = load_sides(*sels)
    replicas = [Replica(index=i, name=side.label, source=arg, side=side, folder=str(sel.folder), own=side_own(side, sel),
                        keys=prompt_keys(side.records or [])) for i, (arg, sel, side) in enumerate(zip(args, sels, loaded))]
    report = fleet_verdict(replicas, command="diff", atol=atol, tier=tier)
    if out_dir is not None:
        prepare_fleet_out(out_dir)
        begin_fleet(out_dir)
        write_fleet(out_dir, report)
        seal_fleet(out_dir)
    return FleetOutcome(out_dir, report)


__all__ = ["fleet_diff"]
