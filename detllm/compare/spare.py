"""The pair worker's process: started ahead as a spare while a large trace loads, taken by
the comparison that needs it, or ended as soon as none will.

Owns the process alone (start, hand over, end) and the CPUs it may use; what the worker
does, and what it says on its pipes, is compare/pairs.py's (the program it runs).
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading

WAIT_S = 60  # a spare nobody takes exits after this long
PROC_FD = f"/proc/{os.getpid()}/fd"  # how a spare opens this process's descriptors (Linux)
_waiting: subprocess.Popen | None = None  # a worker started ahead (warm()), waiting for its setup


def warm() -> None:
    """Start a worker now, ahead of a comparison that may need one (compare/trace.load_records
    of a large trace): it imports numpy and simdjson while this process reads the headers. Only
    where a spare can reach this process's descriptors (/proc); else one starts when needed."""
    global _waiting
    if (_waiting is not None and _waiting.poll() is None) or usable_cpus() < 2 or not os.path.isdir(PROC_FD):
        return
    if _waiting is not None:
        end(_waiting)  # exited untaken: close its pipes
    _waiting = spawn([])
    if _waiting is not None:
        # a spare nobody takes exits on its own (WAIT_S): reaped by this thread the moment it does, so a
        # long-lived process (the Python API) that never compares again keeps no zombie. Popen's
        # waitpid lock makes poll()/wait()/kill() elsewhere safe beside it (poll() reads "alive" until reaped)
        threading.Thread(target=_waiting.wait, name="detllm-spare-reaper", daemon=True).start()


def drop() -> None:
    """No worker will be needed (the comparison found few large differing pairs): end the spare
    now, so its imports stop competing with this process for the other core."""
    global _waiting
    spare, _waiting = _waiting, None
    if spare is not None:
        end(spare)


def take() -> subprocess.Popen | None:
    """The spare, for a comparison to hand its pairs to; None when there is none alive (or it was
    started by the process this one forked from)."""
    global _waiting
    spare, _waiting = _waiting, None
    if spare is not None and spare.poll() is None and PROC_FD == f"/proc/{os.getpid()}/fd":
        return spare
    if spare is not None:
        end(spare)
    return None


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


@atexit.register
def _end_waiting() -> None:
    if _waiting is not None:
        end(_waiting)


def _forget_in_child() -> None:
    """A forked child neither owns its parent's spare nor has the reaper thread (whose waitpid
    lock it may have inherited held): it forgets the spare, and starts its own if it needs one."""
    global _waiting, PROC_FD
    _waiting, PROC_FD = None, f"/proc/{os.getpid()}/fd"


os.register_at_fork(after_in_child=_forget_in_child)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), else every CPU the machine has."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
