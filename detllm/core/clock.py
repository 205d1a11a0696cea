"""Wall and CPU time of a piece of work, as [wall, cpu] seconds: cpu is this process's user + sys
over all its threads (time.process_time), the figure that stays meaningful when other processes
share the cores. Used for locate's cost (a re-run with and without capture)."""

from __future__ import annotations

import time


def clock() -> tuple[float, float]:
    """Now, as (wall, cpu): pass it to since()."""
    return time.perf_counter(), time.process_time()


def since(start: tuple[float, float]) -> list[float]:
    """[wall, cpu] seconds since `start` (a clock())."""
    return [time.perf_counter() - start[0], time.process_time() - start[1]]


def add(a: list[float] | None, b: list[float] | None) -> list[float]:
    """The sum of two [wall, cpu] pairs (None counts as zero)."""
    a, b = a or [0.0, 0.0], b or [0.0, 0.0]
    return [a[0] + b[0], a[1] + b[1]]
