"""HTTP for the `openai` backend: starts N requests together (one connection each, on wire.py's
transport), samples what the server says about its own batch while they are in flight, retries
only where safe, and turns every transport or HTTP failure into one detllm error.

Owns timeouts, retries, the /slots and /metrics samplers and error translation; the one-off GETs
(discovery, env.json's) and the probe go on wire.py too, a POST to /tokenize and the samplers use
httpx, as does everything when a proxy is set.
Knows nothing of tokens, logprobs or runs: backend.py builds the bodies and reads
the answers. httpx is imported lazily (the `openai` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from ...core.errors import BackendError, BackendUnavailableError, UsageError
from .answers import busy_from  # re-exported: the samplers' reading of /slots and /metrics

WATCH_INTERVAL = 1.0  # seconds between /health looks (on a new connection) while a group is in flight
RETRY_STATUS = (429, 503)  # the server says it did not take the request: resending is safe
INSTALL_HINT = "install httpx: pip install 'detllm[openai]'"


def _httpx():
    from .wire import httpx_module  # httpx without its command-line client

    try:
        return httpx_module()
    except ImportError as exc:  # pragma: no cover - httpx ships with the openai extra
        raise BackendUnavailableError("the openai backend needs httpx", hint=INSTALL_HINT) from exc


_SHARED: dict[str, Any] = {}  # built once per process, not once per client (a fleet runs N endpoints on threads)
_SHARED_LOCK = threading.Lock()


def _tls() -> Any:
    """The TLS context every client uses: httpx builds one per client otherwise (~50 ms of CPU each,
    loading the CA bundle). The same context httpx builds by default (SSL_CERT_FILE/SSL_CERT_DIR honoured)."""
    with _SHARED_LOCK:
        if "tls" not in _SHARED:
            _SHARED["tls"] = _httpx().create_ssl_context(trust_env=True)
        return _SHARED["tls"]


def _env_proxies() -> bool:
    """Whether the environment names a proxy (HTTP_PROXY, ALL_PROXY...): only then does a client need
    to read the environment (httpx reads all of it for each client it makes)."""
    with _SHARED_LOCK:
        if "proxies" not in _SHARED:
            import urllib.request

            _SHARED["proxies"] = bool(urllib.request.getproxies())
        return _SHARED["proxies"]


@dataclass
class Reply:
    """One request's answer: the JSON body and what happened on the way."""

    doc: Any
    headers: dict[str, str]
    retries: int = 0
    started_ms: float = 0.0  # offset from the batch start
    finished_ms: float = 0.0


@dataclass
class BatchEvidence:
    """What the server reported about its batch while one group of requests was in flight."""

    source: str | None  # "/slots", "/metrics" or None (the server reveals nothing)
    samples: int = 0
    busy: list[int] = field(default_factory=list)  # requests the server was computing, per sample

    def to_json(self, in_flight: int) -> dict[str, Any]:
        out: dict[str, Any] = {"in_flight": in_flight, "source": self.source, "samples": self.samples}
        if self.busy:
            out["server_busy_max"] = max(self.busy)
            out["server_busy_mean"] = round(sum(self.busy) / len(self.busy), 3)
        return out


class Endpoint:
    """A server's base URL (the /v1 root), its credentials and limits. `root` is the URL without
    /v1, where llama-server, vLLM and SGLang keep /tokenize, /slots, /metrics, /props."""

    def __init__(self, base_url: str, *, api_key: str | None, timeout: float, connect_timeout: float, retries: int) -> None:
        self.base_url = base_url.rstrip("/")
        self.root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"  # never logged: errors quote the URL, not the headers
        self.timeout, self.connect_timeout, self.retries = timeout, connect_timeout, retries
        self.running = False  # True once a run started: a refused connection then means the server went away
        self._runner: Any = None  # the asyncio.Runner whose loop runs every batch (and holds the pool's connections)
        self._pool: Any = None  # wire.Pool: the connections one batch leaves open for the next; None: a new one each
        self._sync: Any = None  # the httpx.Client of get() and try_post()

    def _timeout(self, httpx, timeout: float | None = None):
        return httpx.Timeout(timeout or self.timeout, connect=self.connect_timeout)

    def url(self, path: str, *, root: bool = False) -> str:
        return (self.root if root else self.base_url) + path

    # -- one-off calls (probe, identity, tokenize) --

    def get(self, path: str, *, root: bool = False, timeout: float = 10.0) -> tuple[int, Any, dict[str, str]]:
        """(status, JSON or text, headers); a transport failure is (0, why, {}), `why` a NoAnswer when
        the server took the connection and did not answer in time. Waits at most request_timeout."""
        httpx = _httpx()
        timeout = min(timeout, self.timeout)
        try:
            resp = self._get(httpx, self.url(path, root=root), timeout)
        except httpx.TimeoutException as exc:
            why = f"{type(exc).__name__}: {exc}"
            return 0, (why if isinstance(exc, httpx.ConnectTimeout) else NoAnswer(why, timeout)), {}
        except httpx.HTTPError as exc:
            return 0, f"{type(exc).__name__}: {exc}", {}
        return resp.status_code, _body(resp), dict(resp.headers)

    def _get(self, httpx, url: str, timeout: float) -> Any:
        """One GET on wire.py's transport and this endpoint's loop, on a connection of its own (~11 per
        endpoint: 0.17 -> 0.12 s of CPU at 8 endpoints, httpx's import included); httpx's where a proxy is set."""
        if _env_proxies():
            return self._client_sync(httpx).get(url, timeout=self._timeout(httpx, timeout))
        from .wire import get_once

        got = self._on_loop(get_once(self._connections(1, timeout)[0], url))  # handed back: a raise there closes the loop's connections
        if isinstance(got, Exception):
            raise got
        return got

    def post(self, path: str, body: Any, *, root: bool = False, what: str = "") -> Reply:
        """POST and raise a detllm error on failure (the same rules as a batch)."""
        return self._on_loop(self._post_one(path, body, root=root, what=what))

    async def _post_one(self, path: str, body: Any, *, root: bool, what: str) -> Reply:
        if self._pool is not None and not _env_proxies():  # a connection the next batch can take on
            (conn,) = self._pool.take(1)
            try:
                return await self._send(conn, path, body, root=root, what=what, t0=time.monotonic())
            finally:
                self._pool.give([conn])
        httpx = _httpx()
        async with httpx.AsyncClient(headers=self._headers, timeout=self._timeout(httpx), verify=_tls()) as client:
            return await self._send(client, path, body, root=root, what=what, t0=time.monotonic())

    def try_post(self, path: str, body: Any, *, root: bool = False, timeout: float = 30.0) -> tuple[int, Any]:
        """(status, body) of an optional endpoint (tokenize, cache reset); (0, why) when unreachable.
        Waits at most request_timeout."""
        httpx = _httpx()
        timeout = min(timeout, self.timeout)
        try:
            resp = self._client_sync(httpx).post(self.url(path, root=root), json=body, timeout=self._timeout(httpx, timeout))
        except httpx.HTTPError as exc:
            return 0, f"{type(exc).__name__}: {exc or 'no detail'}"
        return resp.status_code, _body(resp)

    def _client_sync(self, httpx) -> Any:
        """The one httpx client of try_post (and of get() where a proxy is set; a client per call cost ~1 ms
        of CPU). It keeps no connection open between calls: an idle one holds a thread of a server
        with a thread pool (llama-server's cpp-httplib), which a batch then lacks (one fewer request
        computed at once)."""
        if self._sync is None:
            self._sync = httpx.Client(headers=self._headers, timeout=self._timeout(httpx), verify=_tls(),
                                      limits=httpx.Limits(max_keepalive_connections=0))
        return self._sync

    # -- a group of requests started together --

    def send_batch(self, path: str, bodies: Sequence[Any], *, sample: str | None, interval: float,
                   preconnect: bool = False) -> tuple[list[Reply], BatchEvidence]:
        """POST every body at once (one connection each) and return the replies in order, with
        the server's own view of its batch sampled from `sample` ("/slots" or "/metrics").
        `preconnect`: open every connection (GET /health) before any request body is sent."""
        return self._on_loop(self._batch(path, list(bodies), sample, interval, preconnect))

    def _on_loop(self, coro):
        """Run a batch (or a POST) on this endpoint's own event loop, kept from call to call (asyncio.Runner,
        Python 3.11+) so that the connections one leaves open carry the next (wire.Pool). On 3.10, or
        called from a running loop, on a new loop each time and no connection is kept. A failure or an
        interrupt closes the loop and its connections, as asyncio.run would."""
        runner = getattr(asyncio, "Runner", None)
        if runner is None or _loop_running():
            self._drop_loop()
            return _run(coro)
        if self._runner is None:
            from .wire import Pool

            self._runner, self._pool = runner(), Pool(lambda: self._connections(1)[0])
        try:
            return self._runner.run(coro)
        except BaseException:
            self._drop_loop()
            raise

    def _drop_loop(self) -> None:
        pool, runner, self._pool, self._runner = self._pool, self._runner, None, None
        if pool is not None:
            pool.close()
        if runner is not None:
            runner.close()  # runs the loop once more: the closed connections' sockets are released

    def close(self) -> None:
        """Close every connection kept between calls and batches, and their loop. Safe to call twice."""
        sync, self._sync = self._sync, None
        if sync is not None:
            sync.close()
        self._drop_loop()

    async def _batch(self, path: str, bodies: list[Any], sample: str | None, interval: float,
                     preconnect: bool = False) -> tuple[list[Reply], BatchEvidence]:
        httpx = _httpx()
        n = len(bodies)
        evidence = BatchEvidence(sample)
        async with contextlib.AsyncExitStack() as stack:
            # a connection per request (wire.py: ~0.1-0.2 ms of CPU each, an httpx client ~1.1 ms); through
            # httpx where the environment names a proxy. The sampler's client is httpx's either way.
            if _env_proxies():
                clients = [await stack.enter_async_context(self._client(httpx)) for _ in range(n)]
            elif self._pool is not None:  # on this endpoint's own loop: the last batch's connections, where still open
                clients = self._pool.take(n)
                stack.callback(self._pool.give, clients)
                # new ones opened before any body goes out: a reused one would start a connect ahead (_send reports a failure)
                await asyncio.gather(*(c.ensure_open() for c in clients if not c.idle()), return_exceptions=True)
            else:
                clients = self._connections(n)
                for c in clients:
                    stack.callback(c.close)
            polls = await stack.enter_async_context(self._client(httpx)) if sample else None  # the sampler's client
            if preconnect:  # each client's one connection is open (kept alive) before the first body goes out
                await asyncio.gather(*(c.get(self.url("/health", root=True)) for c in clients), return_exceptions=True)
            t0 = time.monotonic()
            tasks = [asyncio.create_task(self._send(c, path, b, root=False, what=f"request {i}", t0=t0))
                     for i, (c, b) in enumerate(zip(clients, bodies))]
            sampler = asyncio.create_task(self._sample(polls, sample, interval, evidence)) if polls is not None else None
            answers = asyncio.gather(*tasks)
            watch = asyncio.create_task(self._watch(n))
            try:
                done, _ = await asyncio.wait({answers, watch}, return_when=asyncio.FIRST_COMPLETED)
                if answers not in done:
                    watch.result()  # the watcher only ever returns by raising: the server is going away
                replies = answers.result()
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, answers, return_exceptions=True)  # answers too: its outcome is retrieved, never logged
                raise
            finally:
                for side in (sampler, watch):
                    if side is not None:
                        side.cancel()
                        await asyncio.gather(side, return_exceptions=True)
        return list(replies), evidence

    def _client(self, httpx) -> Any:
        # one connection per client: httpcore's pool scans every connection of a client for each
        # request it serves, n^2 work for n in flight (~1 s of CPU per 200 requests at 100)
        return httpx.AsyncClient(headers=self._headers, timeout=self._timeout(httpx), verify=_tls(), trust_env=_env_proxies(),
                                 limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))

    def _connections(self, n: int, timeout: float | None = None) -> list[Any]:
        from .wire import Connection

        return [Connection(self.root, self._headers, timeout=timeout or self.timeout, connect_timeout=self.connect_timeout, tls=_tls()
                           if self.root.startswith("https:") else None) for _ in range(n)]

    async def _watch(self, in_flight: int) -> None:
        """While a group is in flight, ask for /health on a NEW connection every WATCH_INTERVAL s.
        A server stopped normally (llama-server on SIGTERM) keeps the open connections and never
        answers them, but refuses new ones: two refusals in a row (or a /health that answered 200
        and now fails with 5xx) end the group at once instead of waiting out request_timeout."""
        httpx = _httpx()
        health = self.url("/health", root=True)
        bad, healthy = 0, False
        timeout = httpx.Timeout(5.0, connect=self.connect_timeout)
        async with httpx.AsyncClient(headers=self._headers, timeout=timeout, limits=httpx.Limits(max_keepalive_connections=0),
                                     verify=_tls()) as client:
            while True:
                await asyncio.sleep(0.25 if bad else WATCH_INTERVAL)
                try:
                    resp = await client.get(health)
                except httpx.ConnectError as exc:
                    why = f"it refused a new connection ({exc or type(exc).__name__})"
                except httpx.HTTPError:  # slow or odd, not gone: no conclusion
                    bad = 0
                    continue
                else:
                    if resp.status_code == 200:
                        bad, healthy = 0, True
                        continue
                    if not (healthy and resp.status_code >= 500):
                        continue  # a server without /health answers 404: nothing to learn
                    why = f"its /health now fails with HTTP {resp.status_code}"
                bad += 1
                if bad >= 2:
                    raise BackendError(f"the server at {safe_url(self.root)} is going away (shutting down or stopped): {why} "
                                       f"while {in_flight} request(s) were in flight",
                                       hint="a server that is shutting down never answers the requests it holds; "
                                            "nothing of this run is complete: start the server again and rerun")

    async def _sample(self, client, source: str, interval: float, evidence: BatchEvidence) -> None:
        """Poll the server while the batch is in flight; a failed poll is skipped, never fatal."""
        wait = min(interval, 0.002)  # early looks, then every `interval`: a short batch may be over within one interval
        while True:
            await asyncio.sleep(wait)
            wait = min(wait * 2, interval)
            try:
                resp = await client.get(self.url(source, root=True), timeout=5.0)
            except Exception:  # noqa: BLE001 - evidence is best effort; the requests themselves report failures
                continue
            if resp.status_code != 200:
                continue
            busy = busy_from(source, _body(resp))
            if busy is not None:
                evidence.samples += 1
                evidence.busy.append(busy)

    async def _send(self, client, path: str, body: Any, *, root: bool, what: str, t0: float) -> Reply:
        httpx = _httpx()
        url = self.url(path, root=root)
        retries = 0
        while True:
            started = (time.monotonic() - t0) * 1000
            try:
                resp = await client.post(url, json=body)
            except httpx.ConnectError as exc:  # nothing was sent: safe to retry
                if retries < self.retries:
                    retries += 1
                    await asyncio.sleep(0.2 * retries)
                    continue
                raise self.unreachable(safe_url(url), exc) from exc
            except httpx.TimeoutException as exc:
                raise BackendError(f"{safe_url(url)} did not answer {what or 'the request'} within {self.timeout:g} s",
                                   hint="raise --opt request_timeout, or lower --concurrency") from exc
            except httpx.HTTPError as exc:  # the connection dropped mid-request: the server may have computed it
                raise BackendError(f"{safe_url(url)}: the connection dropped during {what or 'a request'} ({type(exc).__name__}: {exc or 'no detail'})",
                                   hint="the server crashed or was restarted; nothing was retried") from exc
            if resp.status_code in RETRY_STATUS and retries < self.retries:
                retries += 1
                after = resp.headers.get("retry-after")
                await asyncio.sleep(min(float(after), 10.0) if _num(after) else 0.5 * retries)
                continue
            if resp.status_code != 200:
                raise http_error(safe_url(url), resp.status_code, _body(resp), retries)
            return Reply(_body(resp), dict(resp.headers), retries, started, (time.monotonic() - t0) * 1000)

    def unreachable(self, url: str, exc: object) -> Exception:
        if isinstance(exc, NoAnswer):  # it took the connection: hung or overloaded, not unreachable
            err = BackendUnavailableError(
                f"{url} took the connection but did not answer within {exc.seconds:g} s ({exc})",
                hint="the server is hung (stopped, deadlocked) or overloaded; raise --opt request_timeout if it is only slow")
            err.__cause__ = TimeoutError(str(exc))  # its kind: timeout (a fleet's replica error)
            return err
        if self.running:
            return BackendError(f"{url} stopped accepting connections mid-run ({exc or type(exc).__name__})",
                                hint="the server went away; nothing of this run is complete")
        return BackendUnavailableError(f"cannot connect to {url} ({exc or type(exc).__name__})",
                                       hint="is the server running, and is --base-url its /v1 address?")


class NoAnswer(str):
    """Why a GET got no answer: the server accepted the connection and then said nothing within
    `seconds` (a read, write or pool timeout; a connect timeout is unreachable)."""

    seconds: float

    def __new__(cls, why: str, seconds: float) -> "NoAnswer":
        self = super().__new__(cls, why)
        self.seconds = seconds
        return self


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _run(coro):
    """asyncio.run, also from code that already runs an event loop (a notebook): then on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def http_error(url: str, status: int, body: Any, retries: int = 0) -> Exception:
    """One detllm error for a non-200 answer."""
    msg = _message(body)
    tried = f" after {retries} retr{'y' if retries == 1 else 'ies'}" if retries else ""
    if status in (401, 403):
        return UsageError(f"{url} refused the credentials (HTTP {status}: {msg})",
                          hint="put the key in an environment variable and name it with --api-key-env")
    if status == 404:
        if "model" in msg.lower():
            return UsageError(f"the server does not serve that model (HTTP 404: {msg})", hint="see GET /v1/models for the names it serves")
        return BackendUnavailableError(f"{url} does not exist on this server (HTTP 404)",
                                       hint="--base-url must be the OpenAI-compatible root, e.g. http://host:port/v1")
    if 400 <= status < 500:
        return UsageError(f"{url} rejected the request (HTTP {status}: {msg})")
    return BackendError(f"{url} failed with HTTP {status}{tried}: {msg}", hint="a server error; nothing of this run is complete")


def safe_url(url: str) -> str:
    """A URL without user:password@ and without a query string (tokens travel there): what errors
    and env.json may show."""
    return re.sub(r"://[^/@\s]+@", "://<redacted>@", url.split("?", 1)[0])


def _message(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body.get("message", body)))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:300]
    return str(body or "no body")[:300]


def _body(resp) -> Any:
    try:
        return resp.json()
    except ValueError:
        return resp.text


def _num(x: Any) -> bool:
    try:
        float(x)
        return True
    except (TypeError, ValueError):
        return False


__all__ = ["BatchEvidence", "Endpoint", "Reply", "busy_from", "http_error", "safe_url"]
