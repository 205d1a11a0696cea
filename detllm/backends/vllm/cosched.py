"""Which requests vLLM's scheduler co-scheduled, read per step from the in-process engine core.

Owns the per-record engagement evidence of a vLLM batch (pipeline/engagement.py judges it): while
one `LLM.generate` runs, the scheduler's `schedule()` is wrapped and each step's request ids (the
keys of SchedulerOutput.num_scheduled_tokens) are kept; a request's `rows` is the most requests any
step computed it with. An engine that cannot co-schedule the batch (max_num_seqs 1) gives 1.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator


def _scheduler(llm: Any) -> Any:
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)  # InprocClient -> EngineCore
    return getattr(core, "scheduler", None)


def _key(request_id: str) -> str:
    return str(request_id).split("-", 1)[0]  # "<counter>-<suffix>" inside the engine core; "<counter>" outside


@contextmanager
def watch(llm: Any) -> Iterator[list[set[str]] | None]:
    """Yield the list each step's co-scheduled request keys are appended to; None where the scheduler
    is not in this process (nothing is observed)."""
    sched = _scheduler(llm)
    if sched is None or not callable(getattr(sched, "schedule", None)):
        yield None
        return
    steps: list[set[str]] = []
    real = sched.schedule

    def schedule(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        ids = getattr(out, "num_scheduled_tokens", None)
        if isinstance(ids, dict) and ids:
            steps.append({_key(k) for k in ids})
        return out

    sched.schedule = schedule
    try:
        yield steps
    finally:
        try:
            del sched.schedule  # the instance attribute: the class's method is back
        except AttributeError:
            sched.schedule = real


def computed_with(steps: list[set[str]] | None, request_id: str) -> dict[str, Any] | None:
    """The most requests one scheduler step computed this request with; None when it was never seen."""
    if steps is None:
        return None
    mine = [len(s) for s in steps if _key(request_id) in s]
    if not mine:
        return None
    return {"rows": max(mine), "steps": len(mine), "seen_by": "vLLM scheduler: requests per step (num_scheduled_tokens)"}


__all__ = ["computed_with", "watch"]
