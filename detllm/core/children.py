"""Child processes detllm starts die with it.

Owns the preexec hook that asks Linux to SIGKILL a child when its parent dies
(PR_SET_PDEATHSIG): llama-server, probe workers and the re-derivation helper all use it,
so even a SIGKILLed detllm leaves no orphan. Does not start or stop any process itself.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Callable


def death_signal_hook() -> Callable[[], object] | None:
    """A preexec_fn asking Linux to SIGKILL the child when its parent dies (PR_SET_PDEATHSIG),
    so even a SIGKILLed owner leaves no orphan. Resolved here, in the parent: the child
    only calls a C function between fork and exec (no imports, no locks)."""
    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        return None  # PDEATHSIG fires when the forking *thread* ends; only the main thread lives as long as we do
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, int(signal.SIGKILL))


__all__ = ["death_signal_hook"]
