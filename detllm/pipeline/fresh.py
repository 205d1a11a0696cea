"""Fresh-process repeats (`check --fresh-process N`): N of the repeats each run in a new
Python process that imports the engine, loads the model and applies the determinism
settings anew, so what is fixed once per process (autotuning, CUDA graph capture, cuBLAS
heuristics, thread pools, caches) is varied too.

Owns which repeats are fresh, the child's entry point (`python -m detllm.fresh`), the
parent <-> child protocol (JSON lines: requests on the child's stdin, results on a pipe
of their own, so engine logs on stdout never corrupt them), and the check that the child
ran the same model under the same settings. Does not own batching or the trace (runner.py).
The child is spawned, never forked: a fork of a process that initialised torch is not a
fresh process, and libgomp can hang after fork.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Sequence

from ..core import errors
from ..backends.base import Backend, Generation, Request
from ..core.config import RunConfig
from ..core.errors import BackendError, DetllmError

PROTOCOL = 1


def fresh_runs(config: RunConfig) -> frozenset[int]:
    """Run indexes (at config.batch_size) that run in a fresh process: the last N repeats,
    so run 0, the reference every repeat is compared with, stays in the parent."""
    return frozenset(range(config.runs - config.fresh_process, config.runs)) if config.fresh_process else frozenset()


def served_scope(config: RunConfig, records: list[dict[str, Any]] | None) -> str:
    """A served check's scope: what is known about the server across the repeats (the client's process says nothing)."""
    prints = sorted({str(ev["system_fingerprint"]) for r in records or () if isinstance(ev := r.get("evidence"), dict)
                     and ev.get("system_fingerprint")})
    if len(prints) == 1:
        server = (f"the server reported one system_fingerprint ({prints[0]}) across every repeat (its build and configuration, "
                  "not one process: its start time is not reported)")
    elif prints:
        server = f"the server reported {len(prints)} different system_fingerprints across the repeats"
    else:
        server = "whether one server process answered every repeat is unknown (it reports no identity or start time)"
    levels = [b for b in config.batch_sizes if b != 1]
    conc = f"; concurrency {', '.join(map(str, levels))} vs 1: the server chose its own batches" if levels else ""
    return f"served: every repeat went to one endpoint; {server}{conc}"


def scope_text(config: RunConfig, records: list[dict[str, Any]] | None = None) -> str:
    """What a PASS of this check covers, for report.json's `scope` and the verdict."""
    n = config.fresh_process
    if config.backend == "openai" and n == 0:
        return served_scope(config, records)
    if n == 0:
        return ("repeatable within one process: every repeat shared one process and one loaded engine, so what is fixed "
                "per process (autotuning, graph capture, library heuristics, thread pools) was never varied; "
                "--fresh-process N varies it")
    runs = ", ".join(f"run_{r}" for r in sorted(fresh_runs(config)))
    rest = "" if n == config.runs - 1 else "; the other repeats shared the process of run_0, the reference"
    once = "; each --vary-batch size ran once, in run_0's process" if len(config.batch_sizes) > 1 else ""
    return (f"repeatable across processes: {n} of {config.runs - 1} repeats ({runs}) each ran in a new process "
            f"(new import, model load and determinism settings){rest}{once}")


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the detllm this parent runs, whatever the child's cwd
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["DETLLM_FRESH_CHILD"] = "1"
    return env


class FreshProcess:
    """One repeat in a child process: spawned (it imports and loads at once), checked when
    ready, fed batch after batch, closed when the repeat is done. Raises the child's
    DetllmError as the same class."""

    def __init__(self, config: RunConfig, *, tier: int, identity: dict[str, Any], settings: list[dict[str, Any]],
                 wait: bool = True) -> None:
        self.config, self.tier, self.identity, self.settings = config, tier, identity, settings
        self.timings: dict[str, float] = {}
        self._ready = False
        self._log = tempfile.TemporaryFile(mode="w+b")  # child's stdout and stderr: engines log there
        res_r, res_w = os.pipe()
        started, spawned_at = time.perf_counter(), time.time()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "detllm.pipeline.fresh", str(res_w)], stdin=subprocess.PIPE, stdout=self._log,
                stderr=self._log, pass_fds=(res_w,), env=_child_env(), close_fds=True,
            )
        except OSError as exc:
            os.close(res_r)
            raise BackendError(f"cannot start a fresh process for a repeat: {exc}") from exc
        finally:
            os.close(res_w)  # the child holds the only write end: its exit is our EOF
        self._results: IO[str] = os.fdopen(res_r, "r", encoding="utf-8")
        self._started, self._spawned_at = started, spawned_at
        self._send({"protocol": PROTOCOL, "config": config.to_json(), "tier": tier})
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until the child has loaded the engine; refuse it unless it holds the same model
        under the same settings as the reference run. Safe to call twice."""
        if self._ready:
            return
        waited = time.perf_counter()
        ready = self._receive("ready")
        now = time.perf_counter()
        self.timings = dict(ready["timings"], spawn_to_ready_s=now - self._started, waited_for_ready_s=now - waited,
                            python_start_s=ready["timings"].pop("entered_at") - self._spawned_at)
        try:
            self._same_model(ready["identity"])
            self._same_settings(ready["settings"])
        except BackendError:
            self.kill()  # never leave a refused child waiting for batches
            raise
        self._ready = True

    def generate(self, requests: Sequence[Request], *, seed: int, n_logprobs: int, logprobs: bool) -> list[Generation]:
        self.wait_ready()
        self._send({"requests": [dataclasses.asdict(r) for r in requests], "seed": seed, "n_logprobs": n_logprobs,
                    "logprobs": logprobs})
        return [Generation(**g) for g in self._receive("generations")]

    def close(self) -> None:
        """Let the child restore its settings and exit; collect its timings. Safe to call twice."""
        if self._proc.poll() is None and self._proc.stdin and not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()  # EOF: the child leaves its determinism block and exits
                done = self._receive("done")
                self.timings.update(done["timings"])
            finally:
                self._wait()
        self._results.close()
        self._log.close()

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._wait()
        self._results.close()
        self._log.close()

    # ------------------------------------------------------------ protocol

    def _send(self, msg: dict[str, Any]) -> None:
        try:
            assert self._proc.stdin is not None
            self._proc.stdin.write((json.dumps(msg) + "\n").encode())
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise self._died() from exc

    def _receive(self, kind: str) -> Any:
        line = self._results.readline()
        if not line:
            raise self._died()
        msg = json.loads(line)
        if "error" in msg:
            err = msg["error"]
            cls = getattr(errors, err["class"], BackendError)
            if not (isinstance(cls, type) and issubclass(cls, DetllmError)):
                cls = BackendError
            raise cls(f"in the fresh process: {err['message']}", hint=err.get("hint"))
        return msg[kind]

    def _wait(self) -> None:
        try:
            self._proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _died(self) -> BackendError:
        self._wait()
        self._log.seek(0)
        tail = [ln for ln in self._log.read().decode(errors="replace").splitlines() if ln.strip()][-1:]
        why = f": {tail[0][:300]}" if tail else ""
        return BackendError(f"the fresh process for a repeat exited with status {self._proc.returncode}{why}")

    def _same_model(self, child: dict[str, Any]) -> None:
        for key in ("weights_sha256", "tokenizer_sha256", "config_sha256"):
            if child.get(key) != self.identity.get(key):
                raise BackendError(f"the fresh process loaded a different model ({key} {str(child.get(key))[:12]} vs "
                                   f"{str(self.identity.get(key))[:12]}): the model files changed while the check ran",
                                   hint="re-run the check on files nothing edits meanwhile")

    def _same_settings(self, child: list[dict[str, Any]]) -> None:
        def key(s: dict[str, Any]) -> tuple:
            return s["name"], json.dumps(s["requested"], sort_keys=True), s["applied"], json.dumps(s["value"], sort_keys=True)

        mine, theirs = [key(s) for s in self.settings], [key(s) for s in child]
        if mine != theirs:
            diff = next(((a, b) for a, b in zip(mine, theirs) if a != b), (mine[len(theirs):] or [None])[:1] + (theirs[len(mine):] or [None])[:1])
            raise BackendError(f"the fresh process applied other determinism settings than the reference run: {diff[0]} vs {diff[1]}",
                               hint="the repeats would not be comparable; set the differing setting explicitly")


class Dispatcher:
    """What the runner generates through: the parent's backend for in-process repeats and
    batch sizes, a FreshProcess (one per fresh repeat) for the others."""

    def __init__(self, config: RunConfig, backend: Backend, *, tier: int, identity: dict[str, Any],
                 settings: list[dict[str, Any]]) -> None:
        self.config, self.backend, self.tier, self.identity, self.settings = config, backend, tier, identity, settings
        self.fresh = fresh_runs(config)
        self.timings: list[dict[str, float]] = []  # per fresh repeat, in run order
        self._child: FreshProcess | None = None
        self._child_run: int | None = None
        if self.fresh and not self._needs_the_device():
            # the first child imports and loads while this process generates its own runs (fresh repeats
            # come last): the same work, overlapped, and the child is no less a new process
            self._child = FreshProcess(config, tier=tier, identity=identity, settings=settings, wait=False)
            self._child_run = min(self.fresh)

    def __enter__(self) -> "Dispatcher":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(failed=exc_type is not None)

    def is_fresh(self, batch_size: int, run: int) -> bool:
        return batch_size == self.config.batch_size and run in self.fresh

    def generate(self, requests: Sequence[Request], *, batch_size: int, run: int, seed: int, n_logprobs: int,
                 logprobs: bool) -> list[Generation]:
        if not self.is_fresh(batch_size, run):  # the runner puts fresh repeats last: a child is never left waiting here
            return self.backend.generate(requests, self.config.decoding, seed=seed, n_logprobs=n_logprobs, logprobs=logprobs)
        if self._child_run != run:
            self._end_child()
            self._make_room()
            self._child = FreshProcess(self.config, tier=self.tier, identity=self.identity, settings=self.settings)
            self._child_run = run
        assert self._child is not None
        return self._child.generate(requests, seed=seed, n_logprobs=n_logprobs, logprobs=logprobs)

    def _needs_the_device(self) -> bool:
        """A backend that holds the device for the process (a GPU vLLM engine): a child can start
        only once it is released."""
        return self.backend.holds_device()

    def _make_room(self) -> None:
        if self._needs_the_device():
            self.backend.release_device()

    def _end_child(self) -> None:
        if self._child is not None:
            child, self._child, self._child_run = self._child, None, None
            child.close()
            self.timings.append(child.timings)

    def close(self, *, failed: bool = False) -> None:
        if self._child is not None and (failed or not self._child._ready):  # an error, or a child never used
            self._child.kill()
            self._child = None
        self._end_child()


# ------------------------------------------------------------------ the child


def _child_main(result_fd: int) -> int:
    """Read the start message, load the engine, apply the settings, then generate each batch
    sent until stdin closes. Every outcome is one JSON line on the result pipe."""
    t0, entered_at = time.perf_counter(), time.time()  # the interpreter and detllm.fresh are imported by now
    out = os.fdopen(result_fd, "w", encoding="utf-8")

    def send(msg: dict[str, Any]) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    try:
        start = json.loads(sys.stdin.readline())
        if start.get("protocol") != PROTOCOL:
            raise BackendError(f"fresh-process protocol {start.get('protocol')} is not {PROTOCOL}: parent and child are different detllm versions")
        config = RunConfig.from_json(start["config"])
        from ..backends.registry import create_backend  # the engine import happens here, in the child

        t_import = time.perf_counter()
        with create_backend(config) as backend:  # engine import + model load
            t_load = time.perf_counter()
            identity = backend.model_identity().to_json()  # re-hashes the files: nothing is cached across processes
            t_identity = time.perf_counter()
            with backend.determinism(tier=start["tier"], seed=config.seed, threads=config.threads) as applied:
                send({"ready": {"identity": identity, "settings": [a.to_json() for a in applied], "timings": {
                    "entered_at": entered_at, "start_s": t_import - t0, "load_s": t_load - t_import,
                    "identity_s": t_identity - t_load, "settings_s": time.perf_counter() - t_identity}}})
                t_gen = 0.0
                for line in sys.stdin:
                    msg = json.loads(line)
                    reqs = [Request(**dict(r, input_ids=tuple(r["input_ids"]))) for r in msg["requests"]]
                    t = time.perf_counter()
                    gens = backend.generate(reqs, config.decoding, seed=msg["seed"], n_logprobs=msg["n_logprobs"],
                                            logprobs=msg["logprobs"])
                    t_gen += time.perf_counter() - t
                    for g in gens:  # the process that computed it: engagement.py shows the repeat really ran apart
                        g.evidence = {**(g.evidence or {}), "pid": os.getpid()}
                    send({"generations": [dataclasses.asdict(g) for g in gens]})
        send({"done": {"timings": {"generate_s": t_gen, "child_total_s": time.perf_counter() - t0}}})
        out.close()
        os._exit(0)  # everything is sent and the engine closed: skip tearing down torch's interpreter state (~2 s)
    except DetllmError as err:
        send({"error": {"class": type(err).__name__, "message": err.message, "hint": err.hint}})
        return err.exit_code
    except Exception as exc:  # noqa: BLE001 - the parent turns it into one BackendError line
        send({"error": {"class": "BackendError", "message": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}})
        return 8


if __name__ == "__main__":
    sys.exit(_child_main(int(sys.argv[1])))
