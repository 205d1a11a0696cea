"""How idle OpenMP threads wait, set before torch loads its OpenMP runtime.

Owns one process-wide default: OMP_WAIT_POLICY=PASSIVE (idle threads sleep) unless the user set it.
libgomp spins an idle thread for ~300k iterations by default; on a shared or small machine those spins
burn the CPU the other threads need. The policy changes when a thread wakes, never which thread computes
what: results are the same bits. It is set in os.environ, so env.json records it; never once OpenMP is loaded.
"""

from __future__ import annotations

import os
import sys

VARIABLE = "OMP_WAIT_POLICY"
DEFAULT = "PASSIVE"
# variables that only say how idle OpenMP threads wait (libgomp, Intel's runtime): a diff notes them, never a cause
WAIT_ONLY = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def _openmp_loaded() -> bool:
    """An OpenMP runtime is mapped into this process already: it has read its environment."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return any(("libgomp" in line or "libiomp" in line or "libomp" in line) for line in maps)
    except OSError:  # no /proc (macOS): only torch's own import is known
        return False


def passive_before_torch() -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE if nothing set it and no OpenMP runtime has read the environment
    yet (torch not imported, no libgomp mapped); True when it was set here. A `--fresh-process` child
    keeps its parent's environment as it is, the one the run folder's env.json records."""
    if VARIABLE in os.environ or os.environ.get("DETLLM_FRESH_CHILD") or "torch" in sys.modules or _openmp_loaded():
        return False
    os.environ[VARIABLE] = DEFAULT
    return True
