"""The transport of a batch's requests (load.py's hot path): one connection per request on asyncio
streams; an answer with a Content-Length read here, any other by h11 (the HTTP/1.1 parser httpx itself
runs on). About 0.1-0.2 ms of CPU per request where an httpx client costs 1.1 ms (benchmarks/bench_fleet.py):
a fleet reads 800 answers at once.

Owns connecting (TLS included), writing a request, reading its answer under httpx's timeout rules
(connect, then each write and each read) and raising httpx's own exception classes, so that load.py
translates every failure in one place, and the connections a batch leaves open for the next batch of
the same endpoint (Pool). No redirects or proxies: with a proxy in the environment load.py sends the
batch through httpx instead. h11 is imported lazily (the `openai` extra).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import select
import socket
import ssl
import sys
import threading
import time
import zlib
from typing import Any, Callable
from urllib.parse import urlsplit

from ...core.keepout import kept_out

_READ = 1 << 16  # bytes per socket read
_dumps = json.dumps  # `json` is httpx's argument name in post()
_timeout = getattr(asyncio, "timeout", None)  # Python 3.11+: a deadline without a task per wait
# a connection idle longer is not reused: well under the servers' own keep-alive timeouts (5 s in
# uvicorn, which vLLM and SGLang serve on, and in llama-server's cpp-httplib), so that none closes it
# as a request goes out on it
KEEP_IDLE_S = 2.0


_HTTPX: Any = None  # httpx once imported (httpx_module)
_HTTPX_LOCK = threading.Lock()


def httpx_module() -> Any:
    """httpx (ImportError where it is not installed), imported without its command-line client:
    httpx/__init__ imports httpx._main, and with it click, rich and pygments, whenever those are
    installed (typer installs them), for the `httpx` console script, which runs in a process of its
    own. While httpx imports, `import httpx._main` finds nothing, so httpx.main is its "install
    httpx[cli]" stand-in in this process: ~30 ms and ~4.5 MiB less per served check. Afterwards
    httpx._main imports as usual; a process that imported httpx before is left as it is."""
    global _HTTPX
    if _HTTPX is None:
        with _HTTPX_LOCK:
            if _HTTPX is None:
                with kept_out("httpx._main", when="httpx" not in sys.modules):
                    import httpx
                _HTTPX = httpx
    return _HTTPX


async def _within(aw: Any, seconds: float, exc: type[Exception]) -> Any:
    """`aw`, or `exc("timed out")` after `seconds` (one operation: httpx's per-read/write rule)."""
    try:
        if _timeout is not None:
            async with _timeout(seconds):
                return await aw
        return await asyncio.wait_for(aw, seconds)
    except (asyncio.TimeoutError, TimeoutError):
        raise exc("timed out") from None


def _oserror(exc: OSError) -> str:
    """'[Errno 111] Connection refused', as httpcore words it (asyncio adds the address)."""
    if exc.errno and exc.errno > 0 and not isinstance(exc, (socket.gaierror, ssl.SSLError)):  # an SSLError's errno is its own code
        return f"[Errno {exc.errno}] {os.strerror(exc.errno)}"
    return str(exc) or type(exc).__name__


class Answer:
    """What load.py reads of an answer, spelled as an httpx.Response spells it."""

    def __init__(self, status_code: int, headers: dict[str, str], content: bytes) -> None:
        self.status_code, self.headers, self.content = status_code, headers, content

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")


class Connection:
    """One HTTP/1.1 connection to the endpoint's host. `request` opens it on first use and again when
    the server closed it; `close` drops it. Not shared between tasks: one request at a time."""

    def __init__(self, base_url: str, headers: dict[str, str], *, timeout: float, connect_timeout: float, tls: Any) -> None:
        parts = urlsplit(base_url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.https else 80)
        self.tls = tls if self.https else None
        # the request headers of every request, as httpx sends them (Host with a non-default port)
        self.head = [("Host", parts.netloc.rsplit("@", 1)[-1]), ("Accept", "*/*"), ("Accept-Encoding", "gzip, deflate"),
                     ("Connection", "keep-alive"), *((k, v) for k, v in headers.items() if k.lower() != "content-type")]
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._ready = False  # open, and at the start of a request (the last answer read in full, kept alive)
        self._head_ok: bool | None = None  # whether h11 accepts self.head (checked once)

    async def ensure_open(self) -> None:
        if not self._ready:
            await self._open()

    async def get(self, url: str) -> Answer:
        return await self.request("GET", url, None)

    async def post(self, url: str, json: Any) -> Answer:  # noqa: A002 - httpx's name for it
        body = _dumps(json, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")  # httpx's encoding
        return await self.request("POST", url, body)

    async def request(self, method: str, url: str, body: bytes | None) -> Answer:
        httpx = httpx_module()
        if not self._ready:
            await self._open()
        parts = urlsplit(url)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = self.head + ([("Content-Type", "application/json"), ("Content-Length", str(len(body)))] if body is not None else [])
        sent = (method, target, head, body)
        data = self._request_bytes(*sent)
        conn = None
        if data is None:  # a head h11 must check (and refuse) itself
            conn, data = _h11_sent(*sent)
        self._ready = False
        writer = self._writer
        try:
            writer.write(data)  # type: ignore[union-attr]
            if writer.transport.get_write_buffer_size():  # type: ignore[union-attr]  # else all went to the socket at once
                await _within(writer.drain(), self.timeout, httpx.WriteTimeout)  # type: ignore[union-attr]
        except OSError as exc:
            self.close()
            raise httpx.WriteError(_oserror(exc)) from exc
        try:
            return await self._answer(conn, sent)
        except BaseException:
            self.close()  # a half-read answer leaves the connection unusable
            raise

    def _request_bytes(self, method: str, target: str, head: list[tuple[str, str]], body: bytes | None) -> bytes | None:
        """The request as h11 writes it (the same bytes), without its per-request checks: the fixed
        headers were checked by h11 once for the connection; None where they or the target fail."""
        if self._head_ok is None:
            import h11

            try:
                h11.Request(method="GET", target="/", headers=self.head)
                self._head_ok = True
            except (h11.LocalProtocolError, UnicodeError, TypeError):
                self._head_ok = False
        if not self._head_ok or not _TARGET.fullmatch(target):
            return None
        lines = [f"{method} {target} HTTP/1.1\r\n", *(f"{k}: {v}\r\n" for k, v in head), "\r\n"]
        return "".join(lines).encode("ascii") + (body or b"")

    async def _read(self) -> bytes:
        httpx = httpx_module()
        try:
            return await _within(self._reader.read(_READ), self.timeout, httpx.ReadTimeout)  # type: ignore[union-attr]
        except OSError as exc:
            raise httpx.ReadError(_oserror(exc)) from exc

    async def _answer(self, conn: Any, sent: tuple) -> Answer:
        """The answer: read here when it is laid out as most servers send it (_simple); anything else
        (chunked, close-delimited, 1xx first, cut short, more than one answer) is h11's, fed the bytes so far."""
        import h11

        httpx = httpx_module()
        buf = b""
        while conn is None:
            data = await self._read()
            if not data and not buf:  # httpcore's words for it
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
            buf += data
            end = buf.find(b"\r\n\r\n") if data else -1
            if end < 0 and data and len(buf) <= _MAX_HEAD and b"\n\n" not in buf:
                continue  # the head is not all here yet
            got = _simple(buf, end) if end >= 0 else None
            if got is not None and len(buf) - end - 4 < got[2]:
                continue  # the body is not all here yet
            if got is None or len(buf) - end - 4 != got[2]:
                conn = _h11_sent(*sent)[0]
                conn.receive_data(buf)
                break
            status, headers, _, keep = got
            self._ready = keep
            if not keep:
                self.close()
            return Answer(status, headers, _decoded(buf[end + 4:], headers.get("content-encoding")))
        status, headers, chunks = 0, {}, []
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise httpx.RemoteProtocolError(str(exc)) from exc
            if event is h11.NEED_DATA:
                data = await self._read()
                if data == b"" and conn.their_state is h11.SEND_RESPONSE:  # httpcore's words for it
                    raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
                conn.receive_data(data)
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
            # an InformationalResponse (1xx) is skipped: the final answer follows
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            self._ready = True  # kept alive: the next request goes on this connection
        else:
            self.close()
        return Answer(status, headers, _decoded(b"".join(chunks), headers.get("content-encoding")))

    async def _open(self) -> None:
        httpx = httpx_module()
        self.close()
        try:
            self._reader, self._writer = await _within(
                asyncio.open_connection(self.host, self.port, ssl=self.tls, server_hostname=self.host if self.tls else None),
                self.connect_timeout, httpx.ConnectTimeout)
        except OSError as exc:  # refused, unreachable, name not known, a TLS failure
            raise httpx.ConnectError(_oserror(exc)) from exc
        self._ready = True

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None
        self._ready = False

    def idle(self) -> bool:
        """Open, its last answer read in full, and nothing read since (not even the server's close)."""
        reader, writer = self._reader, self._writer
        return (self._ready and reader is not None and writer is not None and not reader.at_eof()
                and not getattr(reader, "_buffer", b"?") and not writer.transport.is_closing())

    def fileno(self) -> int:
        return self._writer.get_extra_info("socket").fileno()  # type: ignore[union-attr]


class Pool:
    """The connections one batch leaves open, carrying the next batch of the same endpoint: no new
    TCP connection (and no new thread in a threading server) per request per batch. Only on the one
    event loop they were opened on (load.py keeps it from batch to batch). A connection is reused only
    when idle() and idle for less than KEEP_IDLE_S, and when nothing is waiting to be read on its
    socket: what a server sends to an idle connection is its close (or a timeout answer). A batch
    takes what it needs and the rest are closed: an idle connection holds a thread of a server with
    a thread pool (llama-server's cpp-httplib), which the batch's own requests would then lack."""

    def __init__(self, make: Callable[[], Connection]) -> None:
        self._make = make
        self._idle: list[tuple[float, Connection]] = []  # (when it became idle, the connection), oldest first

    def take(self, n: int) -> list[Connection]:
        """n connections: the most recently idle that may be reused, new ones for the rest."""
        now, idle, self._idle = time.monotonic(), self._idle, []
        live = [(t, c) for t, c in idle if now - t < KEEP_IDLE_S and c.idle()]
        quiet = _quiet([c for _, c in live])
        ok = [(t, c) for t, c in live if id(c) in quiet]  # oldest first
        kept = {id(c) for _, c in ok}
        for _, c in idle:
            if id(c) not in kept:
                c.close()
        use = [c for _, c in reversed(ok[len(ok) - n:] if n < len(ok) else ok)]
        for _, c in ok[:max(0, len(ok) - n)]:  # none is left open idle while the batch runs: see Pool
            c.close()
        return use + [self._make() for _ in range(n - len(use))]

    def give(self, conns: list[Connection]) -> None:
        """A batch's connections back, once its answers are in: those idle() are kept, the others closed."""
        now = time.monotonic()
        for c in conns:
            if c.idle():
                self._idle.append((now, c))
            else:
                c.close()

    def close(self) -> None:
        for _, c in self._idle:
            c.close()
        self._idle = []


async def get_once(conn: Connection, url: str) -> Answer | Exception:
    """GET `url` on `conn`, then close it (an open one holds a thread of a threading server; its socket
    is closed by a loop callback that runs before the loop's run ends); a failure (httpx's classes) is
    handed back, not raised."""
    try:
        return await conn.get(url)
    except Exception as exc:  # noqa: BLE001 - the caller raises it outside the loop
        return exc
    finally:
        conn.close()


def _h11_sent(method: str, target: str, head: list[tuple[str, str]], body: bytes | None) -> tuple[Any, bytes]:
    """An h11 client connection that has sent this request, and the bytes it wrote."""
    import h11

    conn = h11.Connection(h11.CLIENT)
    data = conn.send(h11.Request(method=method, target=target, headers=head))
    if body is not None:
        data += conn.send(h11.Data(data=body))
    return conn, data + conn.send(h11.EndOfMessage())


_TARGET = re.compile(r"[\x21-\x7e]+")  # h11's request-target: visible ASCII
_STATUS = re.compile(rb"HTTP/1\.1 ([2-9][0-9][0-9]) [^\r\n]*")  # a final status; a reason phrase after the space
_NAME = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")  # a header name: an RFC 9110 token
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # control characters (HTAB allowed)
_MAX_HEAD = 1 << 16


def _simple(buf: bytes, end: int) -> tuple[int, dict[str, str], int, bool] | None:
    """(status, headers, body length, kept alive) of the answer whose head is buf[:end], when it is laid
    out as most servers send it: HTTP/1.1, a final status with a body, one Content-Length, no transfer
    coding, no folded or malformed line. None for anything else: h11 reads it (and refuses what it must).
    Headers as h11 gives them: names lower-cased, values without surrounding blanks, the last of a name."""
    lines = buf[:end].split(b"\r\n")
    m = _STATUS.fullmatch(lines[0])
    if m is None or m.group(1) in (b"204", b"304"):
        return None
    headers: dict[str, str] = {}
    length = None
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        value = value.strip(b" \t")
        if not colon or not _NAME.fullmatch(name) or _BAD_VALUE.search(value):
            return None
        key = name.decode("ascii").lower()
        if key == "transfer-encoding" or (key == "content-length" and (length is not None or not value.isdigit())):
            return None
        if key == "content-length":
            length = int(value)
        headers[key] = value.decode("latin-1")
    if length is None:
        return None
    keep = "close" not in (t.strip().lower() for t in headers.get("connection", "").split(","))
    return int(m.group(1)), headers, length, keep


def _quiet(conns: list[Connection]) -> set[int]:
    """id() of each connection whose socket has nothing to read (one poll for all); none without poll()."""
    if not conns or not hasattr(select, "poll"):
        return set()
    poller, by_fd = select.poll(), {c.fileno(): c for c in conns}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    readable = {fd for fd, _ in poller.poll(0)}
    return {id(c) for fd, c in by_fd.items() if fd not in readable}


def _decoded(content: bytes, encoding: str | None) -> bytes:
    """The body without its content-encoding (gzip or deflate, the two this client accepts)."""
    httpx = httpx_module()
    if not encoding or encoding.strip().lower() == "identity":
        return content
    enc = encoding.strip().lower()
    try:
        if enc == "gzip":
            return zlib.decompress(content, 16 + zlib.MAX_WBITS)
        if enc == "deflate":
            try:
                return zlib.decompress(content)
            except zlib.error:
                return zlib.decompress(content, -zlib.MAX_WBITS)  # raw deflate, as some servers send it
    except zlib.error as exc:
        raise httpx.DecodingError(f"the answer's {enc} body does not decode ({exc})") from exc
    raise httpx.DecodingError(f"the answer came with content-encoding {enc!r}, which was not asked for")


__all__ = ["KEEP_IDLE_S", "Answer", "Connection", "Pool", "get_once"]
