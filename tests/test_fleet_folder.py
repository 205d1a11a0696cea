"""The fleet folder as an artifact: sealed (a fleet check's OUT and an N-way diff's --out), checked by
`detllm verify` with its replica folders (an edited fleet.json or replica file fails with exit 6),
rendered by `detllm report`, and a fleet check stopped by Ctrl-C (SIGINT to a real `detllm check`
against slow loopback endpoints) exits 130 at once. Endpoints: tests/stubhttp.py stubs on 127.0.0.1."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

import detllm
from detllm.fleet.folder import check_fleet_out
from tests.stubhttp import JSONHandler, StubServer

TOKENS = 4
TOP = {" a": -0.5, " b": -1.5, " c": -2.5}
ANSWER = json.dumps({"object": "text_completion", "model": "tiny", "usage": {"prompt_tokens": 4, "completion_tokens": TOKENS},
                     "choices": [{"index": 0, "text": " a" * TOKENS, "finish_reason": "length",
                                  "logprobs": {"tokens": [" a"] * TOKENS, "token_logprobs": [-0.5] * TOKENS,
                                               "top_logprobs": [TOP] * TOKENS}}]}).encode()


def _handler(delay: float, probe_too: bool = True, held: threading.Semaphore | None = None) -> type[JSONHandler]:
    """Completions answered after `delay` s (the capability probe, max_tokens 1, at once unless
    `probe_too`); `held` is released as each delayed request arrives."""
    class Handler(JSONHandler):
        def do_GET(self):
            if self.path == "/v1/models":
                return self.send_json(200, {"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "stub"}]})
            self.send_json(404, {"error": "not found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path.endswith("/completions") and delay and (probe_too or body.get("max_tokens") != 1):
                if held is not None:
                    held.release()
                time.sleep(delay)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(ANSWER)))
            self.end_headers()
            try:
                self.wfile.write(ANSWER)
            except OSError:  # the client went away (the Ctrl-C test)
                pass

        def handle_one_request(self):
            try:
                super().handle_one_request()
            except OSError:
                pass
    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads, block_on_close = True, False  # close() does not wait for a held request


def _stubs(n: int, delay: float, **kw) -> list[StubServer]:
    stubs = []
    for _ in range(n):
        s = StubServer()
        s.serve(_handler(delay, **kw), _Server)
        stubs.append(s)
    return stubs


@pytest.fixture(scope="module")
def fleet_folder(tmp_path_factory):
    stubs = _stubs(2, 0.0)
    try:
        out = tmp_path_factory.mktemp("fleetf") / "fleet"
        cfg = detllm.make_config(backend="openai", model="tiny", tier=2, runs=2, max_new_tokens=TOKENS)
        outcome = detllm.fleet_check(cfg, [s.url for s in stubs], prompts=["hello", "world"], out=out)
        assert outcome.category == "AGREE", outcome.report["verdict"]
        yield out
    finally:
        for s in stubs:
            s.close()


def test_fleet_check_folder_is_sealed_and_verifies(fleet_folder, cli):
    names = {f["path"] for f in json.loads((fleet_folder / "manifest.json").read_text())["files"]}
    assert names == {"fleet.json", "fleet.txt", "fleet.md", "replica_0/manifest.json", "replica_1/manifest.json"}
    assert not (fleet_folder / "detllm.partial").exists()
    r = cli("verify", fleet_folder)
    assert r.exit_code == 0, r.output
    assert "2 replica folder(s) verified" in r.output


@pytest.mark.parametrize("where, edit, needle", [
    ("fleet.json", lambda t: t.replace('"AGREE"', '"OUTLIER"'), "fleet.json: changed after sealing"),
    ("replica_1/report.txt", lambda t: t + "x\n", "replica_1/report.txt: changed after sealing"),
    ("replica_0/trace.jsonl", lambda t: t.replace("-0.5", "-0.25", 1), "replica_0/trace.jsonl line 1"),
    ("replica_1/manifest.json", lambda t: t.replace('"sha256"', '"sha256" ', 1), "replica_1/manifest.json: changed after sealing"),
])
def test_an_edited_fleet_folder_fails_verify(fleet_folder, tmp_path, cli, where, edit, needle):
    copy = tmp_path / "fleet"
    shutil.copytree(fleet_folder, copy)
    p = copy / where
    p.write_text(edit(p.read_text()))
    r = cli("verify", copy)
    assert r.exit_code == 6, r.output
    assert needle in r.output


def test_nway_diff_out_is_sealed(fleet_folder, tmp_path, cli):
    out = tmp_path / "nway"
    r = cli("diff", fleet_folder / "replica_0", fleet_folder / "replica_1", fleet_folder / "replica_0", "--out", out)
    assert r.exit_code == 0, r.output
    assert cli("verify", out).exit_code == 0
    (out / "fleet.md").write_text("# edited\n")
    r = cli("verify", out)
    assert r.exit_code == 6 and "fleet.md: changed after sealing" in r.output


def test_report_reads_a_fleet_folder(fleet_folder, tmp_path, cli):
    doc = json.loads((fleet_folder / "fleet.json").read_text())
    assert cli("report", fleet_folder).output == (fleet_folder / "fleet.txt").read_text()
    assert cli("report", fleet_folder, "--format", "md").output == (fleet_folder / "fleet.md").read_text()
    assert json.loads(cli("report", fleet_folder, "--format", "json").output) == doc
    r = cli("report", fleet_folder, "--format", "html", "--out", tmp_path / "f.html", "--junit", tmp_path / "f.xml")
    assert r.exit_code == 0, r.output
    assert "replica_1" in (tmp_path / "f.html").read_text() and "<testcase" in (tmp_path / "f.xml").read_text()
    r = cli("report", fleet_folder, "--format", "issue")
    assert r.exit_code == 2 and "fleet" in r.output


def test_a_fleet_folder_packs_verifies_and_reports(fleet_folder, tmp_path, cli):
    pack = tmp_path / "fleet.tar.gz"
    assert cli("pack", fleet_folder, "-o", pack).exit_code == 0
    r = cli("verify", pack)
    assert r.exit_code == 0 and "2 replica folder(s) verified" in r.output, r.output
    assert cli("report", pack).output == (fleet_folder / "fleet.txt").read_text()


def _descendants(pid: int) -> list[int]:
    kids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(d.name))
        except (OSError, ValueError, IndexError):
            pass
    return kids


@pytest.mark.parametrize("probe_too", [True, False], ids=["in_the_probe", "in_a_batch"])
def test_ctrl_c_stops_a_fleet_check_at_once(tmp_path, cli, probe_too):
    held = threading.Semaphore(0)
    # every completion (or every one after the capability probe) takes 30 s: the check is waiting on
    # both endpoints when interrupted; in the probe its event loop has nothing else to wake it
    stubs = _stubs(2, 30.0, probe_too=probe_too, held=held)
    out = tmp_path / "fleet"
    args = [sys.executable, "-m", "detllm", "check", "-b", "openai", "-m", "tiny", "--tier", "2", "--runs", "2",
            "--max-new-tokens", str(TOKENS), "--prompt", "hello", "--prompt", "world", "--no-progress", "--out", str(out),
            "--opt", "request_timeout=120", "--base-url", stubs[0].url, "--base-url", stubs[1].url]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(2):  # a held request on each endpoint
            assert held.acquire(timeout=60), proc.communicate(timeout=30)
        time.sleep(0.3)
        assert proc.poll() is None
        assert len(os.listdir(f"/proc/{proc.pid}/task")) >= 3  # the main thread and one per replica
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=15)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for s in stubs:
            s.close()
    assert proc.returncode == 130, err
    assert took < 5, took  # the grace for the replica threads is 2 s, not the servers' 30 s
    assert err.strip() == "detllm: interrupted"  # one line: no traceback, no thread's complaint
    assert _descendants(proc.pid) == []
    if probe_too:  # interrupted in the first probe, before anything is written: no folder
        assert not out.exists()
        return
    assert (out / "detllm.partial").exists()  # an interrupted fleet folder says so, and verify refuses it
    r = cli("verify", out)
    assert r.exit_code == 5 and "incomplete" in r.output
    check_fleet_out(out)  # and it may be the --out of the next fleet check


def test_interrupted_replicas_unwind():
    """In-process: the interrupt reaches each replica thread, whose cleanup (a backend's close) runs."""
    from detllm.fleet.stopping import run_replicas

    closed, threads = [], []

    def replica(i: int):
        threads.append(threading.current_thread())
        try:
            while True:
                time.sleep(0.05)  # a check's Python-level work between waits
        finally:
            closed.append(i)

    threading.Timer(0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_replicas(replica, 3)
    assert time.monotonic() - t0 < 1.5
    assert sorted(closed) == [0, 1, 2] and not any(t.is_alive() for t in threads)


def test_a_fleet_check_restores_the_collectors_thresholds(tmp_path):
    """fewer_collections raises the young threshold only while a fleet runs, and puts it back on the
    way out, an error's way included (here: no endpoint answering, exit 4)."""
    import gc
    import socket

    import detllm
    from detllm.core.errors import BackendUnavailableError
    from detllm.fleet.stopping import GC_YOUNG, fewer_collections

    before = gc.get_threshold()
    with fewer_collections():
        assert gc.get_threshold() == (max(before[0], GC_YOUNG), *before[1:])
    assert gc.get_threshold() == before
    ports = []
    for _ in range(2):  # ports nothing listens on
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    cfg = detllm.make_config(backend="openai", model="tiny", tier=2, runs=2, options={"retries": "0"})
    with pytest.raises(BackendUnavailableError):
        detllm.fleet_check(cfg, [f"http://127.0.0.1:{p}/v1" for p in ports], prompts=["hi"], out=tmp_path / "f")
    assert gc.get_threshold() == before and not (tmp_path / "f").exists()
