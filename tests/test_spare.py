"""The spare comparison worker (compare/spare.py) in a long-lived process: once it exits untaken
it is reaped at once, never left a zombie for as long as the process lives (review R15)."""

from __future__ import annotations

import time
from pathlib import Path

from detllm.compare import spare


def _state(pid: int) -> str | None:
    """The process's state letter in /proc (Z: a zombie nobody reaped), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_a_spare_that_exits_untaken_is_reaped(monkeypatch):
    monkeypatch.setattr(spare, "usable_cpus", lambda: 2)
    monkeypatch.setattr(spare, "_waiting", None)
    spare.warm()
    proc = spare._waiting
    assert proc is not None, "no spare started"
    try:
        proc.stdin.close()  # the worker reads EOF and returns, as it does after WAIT_S with nobody taking it
        deadline = time.monotonic() + 10
        while _state(proc.pid) not in (None, "Z") and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # a reaper needs a moment after the exit
        assert _state(proc.pid) is None, f"the spare's process is left in state {_state(proc.pid)!r}"
        assert proc.returncode == 0  # reaped through Popen, so no later wait() hangs or misreads it
    finally:
        spare.drop()
    assert spare._waiting is None
