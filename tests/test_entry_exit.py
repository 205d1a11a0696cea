"""The console script's exit (cli/entrypoint.py): after the command, atexit handlers run and the
output is flushed, the interpreter's teardown is skipped only when nothing of ours is left (no child
process, no non-daemon thread, no engine that cleans up in finalizers), and the exit code is the command's."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from detllm.cli import entrypoint

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import atexit, subprocess, sys
marker = sys.argv[1]
atexit.register(lambda: open(marker, "a").write("atexit\\n"))
class Held:  # freed by the interpreter's teardown only: its __del__ says whether the teardown ran
    def __del__(self, write=open, path=marker):
        write(path, "a").write("teardown\\n")
held = Held()
if sys.argv[2] == "--with-child":  # a child of ours still running when the command returns
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
sys.argv = ["detllm"] + sys.argv[3:]
from detllm.cli import entry
entry()
"""


def _run(tmp_path: Path, *args: str, child: bool = False) -> tuple[subprocess.CompletedProcess, list[str]]:
    marker = tmp_path / "marker"
    proc = subprocess.run([sys.executable, "-c", PROBE, str(marker), "--with-child" if child else "-", *args], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    return proc, (marker.read_text().split() if marker.exists() else [])


def test_a_check_leaves_quickly_after_atexit_with_its_output_flushed(tmp_path):
    proc, seen = _run(tmp_path, "check", "--backend", "fake", "--runs", "2", "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    assert "detllm check: PASS" in proc.stdout  # a pipe: block-buffered, so only a flush puts it there
    assert seen == ["atexit"]  # atexit ran, the teardown (which would free `held`) did not


def test_the_exit_code_of_a_failing_command_is_kept(tmp_path):
    proc, seen = _run(tmp_path, "check", "--backend", "fake", "--opt", "max_tier=7", "--out", str(tmp_path / "run"))
    assert proc.returncode == 2 and "--opt max_tier must be in [0, 3], got 7" in proc.stderr
    assert seen == ["atexit"]


def test_with_a_child_still_running_the_teardown_runs(tmp_path):
    proc, seen = _run(tmp_path, "check", "--backend", "fake", "--runs", "2", "--out", str(tmp_path / "run"), child=True)
    assert proc.returncode == 0 and "detllm check: PASS" in proc.stdout, proc.stderr
    assert seen == ["atexit", "teardown"]


def test_a_live_child_process_thread_or_engine_takes_the_normal_teardown(monkeypatch):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not entrypoint._nothing_left()
    finally:
        child.kill()
        child.wait()
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)  # not a daemon: the normal exit would wait for it
    worker.start()
    try:
        assert not entrypoint._nothing_left()
    finally:
        stop.set()
        worker.join()
    monkeypatch.setitem(sys.modules, "vllm", sys.modules.get("vllm") or object())  # cleans up in finalizers
    assert not entrypoint._nothing_left()
