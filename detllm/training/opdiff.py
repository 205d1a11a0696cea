"""The first module or op that differs inside a divergent training step (diff of two training
packs): each side re-runs from its nearest checkpoint to step t with the step loop's own
`train_step`, the last step under `taps.tap` (forward outputs, then module and parameter gradients
in backward order), and the two captures are compared in completion order, bit for bit. Asked only
when both sides drew the same batch at t (else the inputs differ and the batch is the answer).
Owns the re-run driver and the comparison; the hooks are taps.py's.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable

from ..taps import Tap, tap
from . import rng
from .checkpoint import apply_checkpoint, load_checkpoint
from .loop import tamper_of, torch_threads
from .steps import train_step
from .task import build_task

MAX_BYTES = 256 << 20  # a capture past this keeps layer boundaries only (taps' bound)


def tapped_step(config: dict[str, Any], model_path: Path, resume: dict[str, Any], step: int,
                make_task: Callable[[dict[str, Any], Path], Any] = build_task) -> Tap:
    """Re-run steps [checkpoint boundary, step] as loop.run_steps would (this process, the caller's
    RNG and threads put back), capturing step `step` whole, forward and backward. `make_task`: a
    --script pack's (script.script_runner, its batches fast-forwarded to the checkpoint)."""
    with rng.Saved(), torch_threads(config["threads"]):
        task = make_task(config, model_path)
        data = rng.seed_all(config["seed"])
        ckpt = load_checkpoint(resume["dir"], resume.get("descriptor_sha256"))
        apply_checkpoint(task, ckpt, data)
        tamper = tamper_of(config, 0)
        for t in range(ckpt.boundary, step):
            train_step(task, data, t, rng_state=rng.capture(data), tamper=tamper, capture=False)
        with warnings.catch_warnings(), tap(task.model, forward=True, backward=True, max_bytes=MAX_BYTES, keep_inputs=False) as got:
            warnings.simplefilter("ignore")  # torch's note on full backward hooks of modules whose inputs need no grad
            train_step(task, data, step, rng_state=rng.capture(data), tamper=tamper, capture=False)
    return got


def first_differing(a: Tap, b: Tap) -> dict[str, Any] | None:
    """The first capture (in A's completion order: forward, then backward) whose tensor differs
    bit for bit from B's of the same name and phase; None when every common one is equal."""
    import numpy as np

    theirs = {(t.name, t.phase): t for t in b.tensors}
    for mine in a.tensors:
        other = theirs.get((mine.name, mine.phase))
        if other is None:
            continue
        x, y = np.asarray(mine.output), np.asarray(other.output)
        if x.shape != y.shape:
            return {"name": mine.name, "phase": mine.phase, "kind": mine.kind, "max_abs_diff": None, "detail": "shapes differ"}
        if not np.array_equal(x, y, equal_nan=True):
            d = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))) if x.size else 0.0
            return {"name": mine.name, "phase": mine.phase, "kind": mine.kind, "max_abs_diff": d if d == d else None,
                    "detail": f"the first of {len(a.tensors)} captures (completion order) whose {mine.phase} tensor differs"}
    return None


__all__ = ["first_differing", "tapped_step"]
