"""Parent side of the probe workers: start a child process, hand it jobs, collect results.

Owns process lifetime (every worker dies with its parent: PR_SET_PDEATHSIG, killed on close
and on Ctrl-C) and the one-job-at-a-time protocol of diagnose/worker.py. A `Worker` keeps its
engine loaded between jobs; `fresh()` gives a new process. Knows nothing of probes.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..core.errors import BackendError
from .worker import MARKER

_ids = itertools.count()


class Worker:
    """One child `python -m detllm.diagnose.worker`; its stderr and chatter go to `log`."""

    def __init__(self, scratch: Path, env: dict[str, str | None] | None = None) -> None:
        """`env`: variables set (None: removed) in the child's environment, before it imports anything."""
        from ..core.children import death_signal_hook

        self.scratch = scratch
        scratch.mkdir(parents=True, exist_ok=True)
        self.log_path = scratch / f"worker-{os.getpid()}-{next(_ids)}.log"
        self._log = open(self.log_path, "a", encoding="utf-8")
        child_env = dict(os.environ, PYTHONUNBUFFERED="1")
        for name, value in (env or {}).items():
            if value is None:
                child_env.pop(name, None)
            else:
                child_env[name] = value
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "detllm.diagnose.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, text=True, env=child_env, preexec_fn=death_signal_hook(),
        )
        self.jobs = 0

    def run(self, job: dict[str, Any]) -> dict[str, Any]:
        """Run one job (kind, config, ...) in this process; returns the worker's result dict."""
        jid = f"{next(_ids)}"
        result = self.scratch / f"result-{os.getpid()}-{jid}.json"
        job = dict(job, id=jid, result=str(result))
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            for line in self.proc.stdout:
                if line.startswith(MARKER):
                    break
                self._log.write(line)
            else:
                raise BackendError(f"a probe worker died (exit {self.proc.wait()}); its log: {self.log_path}")
        except BrokenPipeError as exc:
            raise BackendError(f"a probe worker died; its log: {self.log_path}") from exc
        self.jobs += 1
        body = json.loads(result.read_text(encoding="utf-8"))
        result.unlink()
        return body

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc: object) -> None:
        if exc and exc[0] is not None and self.proc.poll() is None:
            self.proc.kill()  # Ctrl-C or an error: do not wait for a job still running
        self.close()


class Pool:
    """The shared worker (model loaded once) plus fresh workers on demand."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self._shared: Worker | None = None

    def shared(self) -> Worker:
        if self._shared is None or self._shared.proc.poll() is not None:
            self._shared = Worker(self.scratch)
        return self._shared

    def fresh(self, job: dict[str, Any], env: dict[str, str | None] | None = None) -> dict[str, Any]:
        """Run one job in a brand-new process (with `env` changes, see Worker), then end that process."""
        with Worker(self.scratch, env) as w:
            return w.run(job)

    def close(self, kill: bool = False) -> None:
        if self._shared is not None:
            if kill and self._shared.proc.poll() is None:
                self._shared.proc.kill()
            self._shared.close()
            self._shared = None

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(kill=bool(exc and exc[0] is not None))
