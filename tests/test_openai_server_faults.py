"""A real llama-server on loopback that goes away the normal way, and a --base-url without /v1
(issue 21, items 11-13): each fails at once with its own reason and exit code, never a wait for
request_timeout, a usage error, or a dict dump. Each test starts (and stops) its own server."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

import detllm
from detllm.core.errors import BackendError

from .conftest import llama_server_or_fail

pytestmark = pytest.mark.engine


def _server(*extra: str):
    from detllm.backends.llamacpp import Server, free_port
    from detllm.models import builtin_path

    port = free_port()
    srv = Server([str(llama_server_or_fail()), "-m", str(builtin_path("tiny", "gguf") / "model.gguf"), "--host", "127.0.0.1",
                  "--port", str(port), "-np", "2", "-c", "1024", "--alias", "tiny", "--no-webui", "-t", "1", *extra], port, 60.0)
    srv.wait_ready(60.0)
    srv.root = f"http://127.0.0.1:{port}"
    return srv


def _sigterm_attempt(out) -> tuple[bool, bool, BackendError]:
    """One run against a fresh server that gets SIGTERM while a filler (ignore_eos) is mid-generation.
    Returns (fired, went_away, the error check raised). went_away: new connections were refused within
    3 s of the signal, as llama-server does when it shuts down. Under heavy load it has been seen to
    keep answering /health for a minute instead; such an attempt cannot test the watcher, so the
    server is killed at once to end it, and the caller tries again."""
    srv = _server("--context-shift")  # a filler (ignore_eos) then runs its 100000 tokens: seconds in flight
    state = {"fired": False, "went_away": False}

    def term_when_a_filler_is_in_flight():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and srv.proc.poll() is None:
            try:
                slots = httpx.get(srv.root + "/slots", timeout=5).json()
            except (httpx.HTTPError, ValueError):
                continue
            if any(s.get("is_processing") and (s.get("params") or {}).get("ignore_eos")
                   and (s.get("next_token") or [{}])[0].get("n_remain", 0) > 10000 for s in slots):
                srv.proc.send_signal(signal.SIGTERM)
                state["fired"] = True
                break
            time.sleep(0.01)
        end = time.monotonic() + 3
        while state["fired"] and time.monotonic() < end:
            try:
                httpx.get(srv.root + "/health", timeout=1)
            except httpx.ConnectError:
                state["went_away"] = True
                return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        srv.proc.kill()  # not going away (or never fired): end this attempt now

    watcher = threading.Thread(target=term_when_a_filler_is_in_flight, daemon=True)
    watcher.start()
    try:
        with pytest.raises(BackendError) as caught:
            detllm.check(backend="openai", model="tiny", prompts=["Once upon a time"], runs=2, vary_batch=(1, 2),
                         max_new_tokens=100000, options={"base_url": srv.root + "/v1", "request_timeout": "60"},
                         out=out, progress=False)
    finally:
        watcher.join(70)
        srv.stop()
    return state["fired"], state["went_away"], caught.value


def test_sigterm_mid_run_fails_at_once_as_a_server_going_away(tmp_path):
    """SIGTERM while a request is in flight: llama-server refuses new connections but keeps the open
    ones and never answers them. Before: the run waited out request_timeout and advised raising it.
    The server's part (refusing new connections) is checked first; detllm's part is held strictly."""
    for attempt in range(3):
        out = tmp_path / f"term{attempt}"
        fired, went_away, err = _sigterm_attempt(out)
        assert fired, "the filler was never seen in flight"
        if went_away:
            break
    else:
        pytest.fail("llama-server kept accepting connections after SIGTERM in 3 attempts: the fault under test never happened")
    assert err.exit_code == 8
    assert "is going away" in err.message and "refused a new connection" in err.message, err.one_line()
    assert "request_timeout" not in err.one_line()  # only the watcher says "going away": the 60 s timeout was not waited out
    assert not (out / "manifest.json").exists() and not (out / "report.json").exists()


def test_server_gone_while_tokenizing_is_a_backend_fault(tmp_path):
    """The server tokenized the probe, then went away before the prompts: exit 8 and say so (before:
    exit 2, 'pass --opt prompt_as=text')."""
    from detllm.backends.openai.backend import OpenAIBackend
    from detllm.backends.openai.options import OpenAIOptions

    srv = _server()
    try:
        backend = OpenAIBackend("tiny", OpenAIOptions(base_url=srv.root + "/v1", retries=0))
        assert backend.prompt_as == "ids" and backend.tokenize("Hello")
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(30)
        with pytest.raises(BackendError) as caught:
            backend.tokenize("Once upon a time")
    finally:
        srv.stop()
    assert caught.value.exit_code == 8
    assert "went away while tokenizing" in caught.value.message and "prompt_as" not in caught.value.one_line()


def test_base_url_without_v1_names_the_v1_url(llama_served, cli, tmp_path):
    """llama-server answers its native API at the root: one line naming the /v1 URL, exit 4, nothing
    written (before: exit 8 and a Python dict cut mid-string)."""
    root = llama_served.url.removesuffix("/v1")
    res = cli("check", "--backend", "openai", "--base-url", root, "--model", "tiny", "--out", tmp_path / "r", "--no-progress")
    assert res.exit_code == 4, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert lines == [f"detllm: error: {root}/completions answered with llama-server's native API, not the OpenAI one "
                     f"(use --base-url {root}/v1)"], res.output
    assert not (tmp_path / "r").exists()
