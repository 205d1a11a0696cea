"""Where train-check takes checkpoints by default, and what they cost on disk: before the first
step, after the last, and every k-th boundary between, k the smallest that keeps the run's
checkpoints under max(2 checkpoints, 2 GB). Owns the estimate and the line printed before training;
loop.py takes the checkpoints, train_config.json records the k used (`checkpoint_every`).
"""

from __future__ import annotations

BUDGET_BYTES = 2 * 10**9  # the default run's checkpoints stay under max(2 checkpoints, this)
COPIES = 3  # a checkpoint holds the parameters and AdamW's two moments, each the parameters' size


def count(steps: int, every: int | None) -> int:
    """Checkpoints of a run of `steps` steps (loop.boundaries): 0, every, 2·every, … below steps, and steps."""
    return len(set(range(0, steps, every)) | {steps}) if every else 2


def checkpoint_bytes(param_bytes: int) -> int:
    """About one checkpoint's size: the parameters and two optimizer moments (the rng and descriptor are ~kB)."""
    return COPIES * param_bytes


def default_every(steps: int, each: int) -> int | None:
    """The smallest k whose checkpoints fit max(2 checkpoints, BUDGET_BYTES); None: only 0 and `steps`."""
    budget = max(2 * each, BUDGET_BYTES)
    for k in range(1, steps):
        if count(steps, k) * each <= budget:
            return k
    return 1 if steps == 1 else None  # one step: 0 and 1 are every boundary


def size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def plan_line(steps: int, every: int | None, each: int, chosen: bool) -> str:
    """What train-check prints (stderr) before training: how many checkpoints, about how large."""
    n = count(steps, every)
    where = "every step" if every == 1 else f"every {every} steps and after the last" if every else "before the first step and after the last"
    why = (f" (the default: the smallest cadence whose checkpoints stay under max(2 checkpoints, {size(BUDGET_BYTES)}); "
           "--checkpoint-every N to choose)") if chosen else ""
    return f"checkpoints: {n} × ~{size(each)} = ~{size(n * each)}, {where}{why}"


__all__ = ["BUDGET_BYTES", "checkpoint_bytes", "count", "default_every", "plan_line", "size"]
