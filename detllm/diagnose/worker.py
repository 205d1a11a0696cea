"""A probe worker: a child process that runs probe jobs on a real engine, one after another.

Owns the child side of diagnose and sweep. The parent (diagnose/pool.py) writes one JSON job
per line to stdin; the worker runs it (a `check` or `run` through the runner, a needle-in-a-
batch trial set, a prefill-vs-decode scoring, a layers locate) and writes the result to the job's result file,
then prints a marker line. A model stays loaded between jobs of one worker; a fresh worker is
a fresh process (new thread pools, kernel choices, caches). Never imported by the parent.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

MARKER = "\x1edetllm-job-done"


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    from ..core.config import RunConfig
    from ..core.errors import DetllmError

    config = RunConfig.from_json(job["config"])
    started = time.monotonic()
    try:
        if job["kind"] in ("check", "run"):
            body = _check(job, config)
        elif job["kind"] == "needle":
            from .needle import run_needle

            body = run_needle(config, job)
        elif job["kind"] == "score":
            from .prefill import run_prefill_probe

            body = run_prefill_probe(config, job)
        elif job["kind"] == "layers":
            from .layers import run_layers_probe

            body = run_layers_probe(job)
        else:
            raise ValueError(f"unknown job kind {job['kind']!r}")
        body["ok"] = True
    except DetllmError as err:
        body = {"ok": False, "error": err.one_line(), "exit_code": err.exit_code}
    except Exception as err:  # an engine bug: one line for the diagnosis, the traceback for the log
        traceback.print_exc(file=sys.stderr)
        body = {"ok": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}", "exit_code": 8}
    body["seconds"] = round(time.monotonic() - started, 3)
    return body


def _check(job: dict[str, Any], config) -> dict[str, Any]:
    from ..pipeline.runner import execute

    outcome = execute(config, command=job["kind"], prompts_path=job.get("prompts"), out=Path(job["out"]))
    return {"status": outcome.status, "out": str(outcome.out_dir), "exit_code": outcome.exit_code}


def main() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        result = run_job(job)
        Path(job["result"]).write_text(json.dumps(result), encoding="utf-8")
        print(f"{MARKER} {job['id']}", flush=True)


if __name__ == "__main__":
    main()
