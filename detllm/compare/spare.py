"""The pair worker's process: started when a comparison hands over enough large differing pairs
(compare/pairs.py), ended when that comparison is through.

Owns the process alone (start, end) and the CPUs it may use; what the worker does, and what it
says on its pipes, is compare/pairs.py's (the program it runs). No worker is started ahead of a
comparison: one started while the traces load (until round 3 of issue 36) cost ~0.17 CPU-s
wherever few pairs differed (a planted flip: 0.41 s one process, 0.58-0.73 s beside the untaken
worker, 2 cores under load) and gained nothing measurable where every pair drifted (docs/causes.md).
"""

from __future__ import annotations

import os
import subprocess
import sys

WAIT_S = 60  # a worker whose setup does not come exits after this long


def spawn(fds: list[int]) -> subprocess.Popen | None:
    """A worker (compare/pairs.py run as a program) that inherits the descriptors fds; None
    where none can start (this process then settles every pair)."""
    if not sys.executable:  # an embedded interpreter: no program to start
        return None
    try:
        return subprocess.Popen([sys.executable, "-m", "detllm.compare.pairs"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, pass_fds=fds, close_fds=True)
    except OSError:
        return None


def end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()  # it only reads: nothing to finish
    proc.wait()
    for f in (proc.stdin, proc.stdout):
        try:
            f.close()  # type: ignore[union-attr]
        except OSError:
            pass


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), else every CPU the machine has."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
