"""How idle OpenMP threads wait, set before torch loads its OpenMP runtime.

Owns one process-wide default, chosen once from how busy the machine is, unless the user set any
wait variable. libgomp spins an idle thread for ~300k iterations (~3 ms) by default: on a busy or
small machine those spins burn the CPU the other threads need (a tiny check at load 17 took 78 s
instead of 20). So: when fewer than half the CPUs are busy with other work (_busy), a short spin,
GOMP_SPINCOUNT=10000 (~0.1 ms), keeps the wake-up cheap between the many small ops of a decode step
(a tiny check ~0.6 s faster than sleeping); otherwise OMP_WAIT_POLICY=PASSIVE, idle threads sleep.
Either changes when a thread wakes, never which thread computes what: results are the same bits.
It is set in os.environ, so env.json records it; never once OpenMP is loaded.
"""

from __future__ import annotations

import os
import sys

VARIABLE = "OMP_WAIT_POLICY"
DEFAULT = "PASSIVE"
SPIN = ("GOMP_SPINCOUNT", "10000")  # libgomp's own knob: about 0.1 ms of spinning before a thread sleeps
# variables that only say how idle OpenMP threads wait (libgomp, Intel's runtime): a diff notes them, never a cause
WAIT_ONLY = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def _openmp_loaded() -> bool:
    """An OpenMP runtime is mapped into this process already: it has read its environment."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return any(("libgomp" in line or "libiomp" in line or "libomp" in line) for line in maps)
    except OSError:  # no /proc (macOS): only torch's own import is known
        return False


def _busy() -> float:
    """How many CPUs other work keeps busy: the 1-minute load average, or the tasks runnable right now
    besides this one (/proc/loadavg), whichever is lower: the load average lags by a minute (a check
    started just after another one ended reads ~1 on an idle machine), a busy machine shows in both."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average: the safe side
        return float("inf")
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            running = int(f.read().split()[3].split("/")[0]) - 1  # this process is runnable while it reads
    except (OSError, ValueError, IndexError):
        return load
    return min(load, max(running, 0))


def _mostly_idle() -> bool:
    """Fewer than half of this process's CPUs busy with other work."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return _busy() < cpus / 2


def wait_default_before_torch() -> bool:
    """Set the wait default (short spin on a mostly idle machine, else OMP_WAIT_POLICY=PASSIVE) if the
    user set no wait variable and no OpenMP runtime has read the environment yet (torch not imported,
    no libgomp mapped); True when one was set here. A `--fresh-process` child keeps its parent's
    environment as it is, the one the run folder's env.json records."""
    if any(v in os.environ for v in WAIT_ONLY) or os.environ.get("DETLLM_FRESH_CHILD") or "torch" in sys.modules \
            or _openmp_loaded():
        return False
    if _mostly_idle():
        os.environ[SPIN[0]] = SPIN[1]
    else:
        os.environ[VARIABLE] = DEFAULT
    return True
