"""The batch path's HTTP/1.1 transport (backends/openai/wire.py) against a real loopback server:
the answers httpx would read (content-length, chunked, close-delimited, gzip), the connection kept
for a request after a preconnect and from one batch to the next (never one the server closed or one
idle too long), a one-off GET on a connection closed before it returns, and each failure as the httpx error load.py translates: refused, dropped before an
answer, no answer in time. The proxy fallback (httpx) gives the same replies."""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import queue
import socket
import time
from http.server import ThreadingHTTPServer

import httpx
import pytest

from detllm.backends.openai import load, wire
from detllm.backends.openai.load import Endpoint
from detllm.backends.openai.wire import Connection
from detllm.core.errors import BackendError, UsageError

from .stubhttp import JSONHandler, StubServer

DOC = {"choices": [{"index": 0, "text": " é ☃", "finish_reason": "length"}], "usage": {"prompt_tokens": 3}}
RAW = json.dumps(DOC, ensure_ascii=False).encode()


class Server(StubServer):
    """Answers POST /v1/<mode> in the way the mode names; counts connections and keeps the bodies."""

    def __init__(self) -> None:
        self.bodies, self.peers, self.headers, self.gets, self.ended = [], set(), [], [], queue.Queue()
        # peers: the connections that carried a request, by a number each gets when accepted, not by the
        # client's address: the kernel may hand a closed connection's port to the next one
        self.serial = itertools.count()
        srv = self

        class Handler(JSONHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):  # once per connection accepted
                super().setup()
                self.conn = next(srv.serial)

            def finish(self):  # the client closed the connection (or the server did)
                super().finish()
                srv.ended.put(self.client_address)

            def do_GET(self):
                srv.peers.add(self.conn)
                srv.gets.append(self.client_address)
                self.send_json(200 if self.path == "/health" else 404, {"status": "ok"})

            def do_POST(self):
                srv.peers.add(self.conn)
                srv.headers.append({k.lower(): v for k, v in self.headers.items()})
                srv.bodies.append(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                mode = self.path.rsplit("/", 1)[-1]
                if mode == "drop":
                    self.close_connection = True
                    return  # closes the socket without a byte
                if mode == "slow":
                    time.sleep(1.5)
                    return  # the client gave up: nothing to answer
                if mode == "chunked":
                    self.send_response(200)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for part in (RAW[:7], RAW[7:]):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                    self.wfile.write(b"0\r\n\r\n")
                    return
                if mode == "close":  # no length: the body ends where the server closes
                    self.send_response(200)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(RAW)
                    self.close_connection = True
                    return
                body = gzip.compress(RAW) if mode == "gzip" else RAW
                self.send_response(429 if mode == "busy" else 200)
                if mode == "gzip":
                    self.send_header("Content-Encoding", "gzip")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                if mode == "hangup":  # a whole answer, then, once the client has it, a close without a word
                    self.wfile.flush()
                    time.sleep(0.2)
                    self.close_connection = True

        self.serve(Handler, ThreadingHTTPServer)


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.close()


def _post(server, mode, body=None, timeout=10.0):
    async def go():
        conn = Connection(server.url, {"Content-Type": "application/json", "Authorization": "Bearer k"}, timeout=timeout,
                          connect_timeout=5.0, tls=None)
        try:
            return await conn.post(f"{server.url}/{mode}", json=body or {"prompt": "é", "n": 1})
        finally:
            conn.close()
    return asyncio.run(go())


@pytest.mark.parametrize("mode", ["plain", "chunked", "close", "gzip"])
def test_every_body_framing_reads_the_same_answer(server, mode):
    ans = _post(server, mode)
    assert ans.status_code == 200 and ans.json() == DOC


@pytest.mark.parametrize("mode, by_h11", [("plain", False), ("gzip", False), ("busy", False), ("chunked", True), ("close", True)])
def test_a_simply_framed_answer_is_read_without_h11_as_h11_reads_it(server, monkeypatch, mode, by_h11):
    """Content-Length answers are read by wire._simple (h11 never built); chunked and close-delimited ones
    by h11. Either way the status, headers and body are what h11 alone reads."""
    sent = []
    real = wire._h11_sent
    monkeypatch.setattr(wire, "_h11_sent", lambda *a: sent.append(a) or real(*a))
    fast = _post(server, mode)
    assert bool(sent) is by_h11
    monkeypatch.setattr(wire, "_simple", lambda buf, end: None)  # every answer through h11
    slow = _post(server, mode)
    assert (fast.status_code, fast.content) == (slow.status_code, slow.content)
    drop = {"date"}  # the server's clock
    assert {k: v for k, v in fast.headers.items() if k not in drop} == {k: v for k, v in slow.headers.items() if k not in drop}


def test_the_request_is_what_httpx_sends(server):
    _post(server, "plain", {"prompt": "é", "temperature": 0.0, "seed": 7})
    assert server.bodies[-1] == json.dumps({"prompt": "é", "temperature": 0.0, "seed": 7}, ensure_ascii=False,
                                           separators=(",", ":")).encode()
    head = server.headers[-1]
    assert head["content-type"] == "application/json" and head["authorization"] == "Bearer k"
    assert head["host"] == f"127.0.0.1:{server.port}"


def test_a_preconnected_connection_carries_the_request(server):
    async def go():
        conn = Connection(server.url, {}, timeout=10.0, connect_timeout=5.0, tls=None)
        try:
            assert (await conn.get(server.url.removesuffix("/v1") + "/health")).status_code == 200
            return await conn.post(f"{server.url}/plain", json={"prompt": "x"})
        finally:
            conn.close()
    before = len(server.peers)
    assert asyncio.run(go()).json() == DOC
    assert len(server.peers) == before + 1  # one connection: the GET's, kept alive


def test_failures_are_httpx_errors(server):
    with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
        _post(server, "drop")
    with pytest.raises(httpx.ReadTimeout):
        _post(server, "slow", timeout=0.3)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(httpx.ConnectError, match=r"\[Errno 111\] Connection refused"):
        asyncio.run(Connection(f"http://127.0.0.1:{port}/v1", {}, timeout=1.0, connect_timeout=1.0, tls=None).post(
            f"http://127.0.0.1:{port}/v1/plain", json={}))


def _endpoint(server) -> Endpoint:
    return Endpoint(server.url, api_key=None, timeout=10.0, connect_timeout=5.0, retries=0)


@pytest.fixture
def wire_endpoint(server, monkeypatch):
    """An endpoint of the server on wire.py's transport (no proxy in the environment), closed after the test."""
    monkeypatch.setitem(load._SHARED, "proxies", False)
    ep = _endpoint(server)
    yield ep
    ep.close()


@pytest.mark.parametrize("proxied", [False, True], ids=["wire", "httpx"])
def test_a_batch_reads_the_same_replies_through_either_transport(server, monkeypatch, proxied):
    monkeypatch.setitem(load._SHARED, "proxies", proxied)  # a proxy in the environment: the batch goes through httpx
    ep = _endpoint(server)
    replies, _ = ep.send_batch("/gzip", [{"prompt": str(i)} for i in range(5)], sample=None, interval=1.0, preconnect=True)
    assert [r.doc for r in replies] == [DOC] * 5 and all(r.retries == 0 for r in replies)
    with pytest.raises(BackendError, match="connection dropped during request 0"):
        ep.send_batch("/drop", [{"prompt": "x"}], sample=None, interval=1.0)
    ep.retries, sent = 1, len(server.bodies)
    with pytest.raises(UsageError, match=r"rejected the request \(HTTP 429"):
        ep.send_batch("/busy", [{"prompt": "x"}], sample=None, interval=1.0)
    assert len(server.bodies) == sent + 2  # a 429 is sent again once (--opt retries=1), then reported


def test_a_batch_reuses_the_last_batchs_open_connections(server, wire_endpoint, monkeypatch):
    ep = wire_endpoint
    before = len(server.peers)
    for _ in range(3):
        replies, _ = ep.send_batch("/plain", [{"prompt": str(i)} for i in range(4)], sample=None, interval=1.0)
        assert [r.doc for r in replies] == [DOC] * 4
    assert len(server.peers) == before + 4, "three batches of 4 on the first batch's 4 connections"
    replies, _ = ep.send_batch("/plain", [{"prompt": str(i)} for i in range(6)], sample=None, interval=1.0)
    assert len(replies) == 6 and len(server.peers) == before + 6, "4 reused, 2 new"
    ep.send_batch("/plain", [{"prompt": "x"}] * 2, sample=None, interval=1.0)
    assert len(server.peers) == before + 6 and len(ep._pool._idle) == 2, "2 reused, the 4 others closed, not kept idle"
    monkeypatch.setattr(wire, "KEEP_IDLE_S", 0.0)  # idle too long: none is reused
    ep.send_batch("/plain", [{"prompt": "x"}] * 2, sample=None, interval=1.0)
    assert len(server.peers) == before + 8
    ep.close()
    assert ep._pool is None and ep._runner is None


def test_a_connection_the_server_closed_is_never_reused(server, wire_endpoint):
    """The server closes each connection after its answer (no Connection: close): every batch
    opens new ones, and none fails on a connection that was closed under it."""
    before = len(server.peers)
    for _ in range(3):
        replies, _ = wire_endpoint.send_batch("/hangup", [{"prompt": str(i)} for i in range(3)], sample=None, interval=1.0)
        assert [r.doc for r in replies] == [DOC] * 3
        time.sleep(1.0)  # the server's close arrives while no batch runs: seen by the poll, not by the loop
    assert len(server.peers) == before + 9


def test_a_get_is_httpxs_answer_on_a_connection_closed_before_it_returns(server, wire_endpoint, monkeypatch):
    """Endpoint.get on wire.py: the status, body and headers httpx's client gets; its connection
    is closed when get() returns (an open one would hold a thread of llama-server's HTTP pool), and
    the batches' kept connections survive a GET that failed."""
    ep = wire_endpoint
    ep.send_batch("/plain", [{"prompt": str(i)} for i in range(2)], sample=None, interval=1.0)
    kept = list(ep._pool._idle)
    got = ep.get("/health", root=True)
    assert got[0] == 200 and got[1] == {"status": "ok"}
    while server.ended.get(timeout=10) != server.gets[-1]:  # the server saw the GET's close (no timer: an open one never ends)
        pass
    assert ep.get("/nothing", root=True)[:2] == (404, {"status": "ok"})
    monkeypatch.setitem(load._SHARED, "proxies", True)  # through httpx's client: the same answer
    by_httpx = ep.get("/health", root=True)
    assert by_httpx[:2] == got[:2] and by_httpx[2]["content-type"] == got[2]["content-type"] == "application/json"
    monkeypatch.setitem(load._SHARED, "proxies", False)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ep.base_url = ep.root = f"http://127.0.0.1:{port}"
    status, why, headers = ep.get("/health", root=True)
    assert (status, headers) == (0, {}) and why == "ConnectError: [Errno 111] Connection refused"
    assert ep._pool._idle == kept, "a failed GET leaves the loop and the batches' connections as they were"


def test_https_with_the_clients_tls_context(tmp_path):
    """An https base URL: the connection is TLS, checked against the context's CAs and the host name."""
    import shutil
    import ssl
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    s = Server()
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)
    s.httpd.socket = served.wrap_socket(s.httpd.socket, server_side=True)
    url = f"https://127.0.0.1:{s.port}/v1"
    try:
        trusted = ssl.create_default_context(cafile=str(cert))
        ans = asyncio.run(Connection(url, {}, timeout=10.0, connect_timeout=5.0, tls=trusted).post(f"{url}/plain", json={}))
        assert ans.json() == DOC
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):  # a certificate no CA of the context signed
            asyncio.run(Connection(url, {}, timeout=10.0, connect_timeout=5.0, tls=ssl.create_default_context()).post(f"{url}/plain", json={}))
    finally:
        s.close()


def test_the_request_bytes_are_h11s_and_a_bad_header_is_left_to_h11():
    conn = Connection("http://127.0.0.1:8080/v1", {"Content-Type": "application/json", "Authorization": "Bearer k"},
                      timeout=1.0, connect_timeout=1.0, tls=None)
    for method, target, body in (("POST", "/v1/completions", '{"prompt":"é"}'.encode()), ("GET", "/health", None),
                                 ("POST", "/v1/x?a=1&b=%20", b"{}")):
        head = conn.head + ([("Content-Type", "application/json"), ("Content-Length", str(len(body)))] if body is not None else [])
        assert conn._request_bytes(method, target, head, body) == wire._h11_sent(method, target, head, body)[1]
    bad = Connection("http://127.0.0.1:8080/v1", {"Authorization": "Bearer k\r\nX-Injected: 1"}, timeout=1.0, connect_timeout=1.0,
                     tls=None)
    assert bad._request_bytes("GET", "/health", bad.head, None) is None, "h11 checks it (and refuses it) as before"
    assert conn._request_bytes("GET", "/a b", conn.head, None) is None
