"""A training run in a fresh Python process: `python -m detllm.training.child REQUEST.json RESULT.json`
imports torch, loads the model and seeds everything anew, runs the RunRequest and writes its
outcome (or its DetllmError) as JSON. The parent side, run_fresh, spawns it (never forks: a fork
of a process that initialised torch is not fresh), and it dies with its parent (children.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..core import errors
from ..core.children import death_signal_hook
from ..core.errors import BackendError, DetllmError
from .loop import RunRequest, RunResult, load_dump, read_steps, run_steps


def _env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent.parent)  # the detllm this parent runs, whatever the child's cwd
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_fresh(req: RunRequest) -> RunResult:
    """Run `req` in a new process; its records come back through the steps file, the first
    divergent step's tensors through req.dump. Raises the child's DetllmError as the same class."""
    with tempfile.TemporaryDirectory(prefix="detllm-train-") as tmp:
        request, result, log = Path(tmp) / "request.json", Path(tmp) / "result.json", Path(tmp) / "log.txt"
        if req.reference and not req.dump:
            req = RunRequest(**{**req.to_json(), "dump": str(Path(tmp) / "divergent.safetensors")})
        request.write_text(json.dumps(req.to_json()), encoding="utf-8")
        with open(log, "w+b") as logf:
            proc = subprocess.Popen([sys.executable, "-m", "detllm.training.child", str(request), str(result)],
                                    stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, env=_env(), close_fds=True,
                                    preexec_fn=death_signal_hook())
            try:
                code = proc.wait()
            except BaseException:
                proc.kill()
                proc.wait()
                raise
            logf.seek(0)
            tail = logf.read()[-2000:].decode("utf-8", "replace")
        outcome = json.loads(result.read_text()) if result.is_file() else None
        if outcome is None or not outcome.get("ok"):
            if outcome is not None and outcome.get("error") in errors.__dict__:
                cls = getattr(errors, outcome["error"])
                raise cls(outcome["message"], hint=outcome.get("hint"))
            last = tail.strip().splitlines()[-1] if tail.strip() else f"exit code {code}"
            raise BackendError(f"the fresh training process failed: {last}")
        records = read_steps(Path(req.steps_file))
        out = RunResult(records, outcome["checkpoints"], seconds=outcome["seconds"])
        if req.dump and Path(req.dump).is_file():
            out.divergent, out.divergent_step = load_dump(Path(req.dump))
        return out


def main(argv: list[str]) -> int:
    request, result = Path(argv[0]), Path(argv[1])
    try:
        req = RunRequest(**json.loads(request.read_text(encoding="utf-8")))
        res = run_steps(req)
        doc: dict[str, Any] = {"ok": True, "seconds": res.seconds, "checkpoints": res.checkpoints}
    except DetllmError as exc:
        doc = {"ok": False, "error": type(exc).__name__, "message": exc.message, "hint": exc.hint}
    result.write_text(json.dumps(doc), encoding="utf-8")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


__all__ = ["main", "run_fresh"]
