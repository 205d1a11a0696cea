"""The `openai` backend against a small real HTTP server on loopback that speaks the OpenAI
completions API the way hosted endpoints do (token strings, no ids, no /tokenize). It produces
the faults a real llama-server cannot be made to produce on demand: 401, 404 for an unknown
model, no logprobs, a 500 mid-run, and a server that ignores the seed. The real servers are
tested in tests/test_openai_llamacpp.py; this file is in addition, never instead."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import subprocess
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.conftest import assert_valid_run

from .stubhttp import JSONHandler, StubServer

WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]


class Stub(StubServer):
    """One stub server; `mode` switches its behaviour between requests."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.key = None  # when set, a request without "Bearer <key>" gets 401
        self.completions = 0
        self.seen_auth: list[str | None] = []
        self.bodies: list[dict] = []
        self.one_at_a_time = threading.Lock()
        stub = self

        class Handler(JSONHandler):

            def _authorised(self) -> bool:
                auth = self.headers.get("Authorization")
                stub.seen_auth.append(auth)
                if stub.key is not None and auth != f"Bearer {stub.key}":
                    self.send_json(401, {"error": {"message": "invalid api key"}})
                    return False
                return True

            def do_GET(self):
                if not self._authorised():
                    return
                if self.path == "/v1/models":
                    return self.send_json(200, {"object": "list", "data": [{"id": "stub-model", "object": "model", "owned_by": "tests"}]})
                self.send_json(404, {"error": {"message": "not found"}})

            def do_POST(self):
                if not self._authorised():
                    return
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path != "/v1/completions":
                    return self.send_json(404, {"error": {"message": "not found"}})
                stub.bodies.append(body)
                if body.get("model") != "stub-model":
                    return self.send_json(404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}})
                stub.completions += 1
                if stub.mode == "fail_after_probe" and stub.completions > 1:
                    return self.send_json(500, {"error": {"message": "CUDA error: an illegal memory access was encountered"}})
                if stub.mode == "drop_after_probe" and stub.completions > 1:
                    self.connection.shutdown(2)  # the connection dies with no answer
                    return
                if stub.mode == "busy_once" and stub.completions == 2:
                    return self.send_json(503, {"error": {"message": "server busy"}})
                if stub.mode == "slow_after_probe" and stub.completions > 1:
                    import time

                    time.sleep(2.0)
                if stub.mode == "no_logprobs" and body.get("logprobs") is not None:
                    return self.send_json(400, {"error": {"message": "logprobs is not supported by this server"}})
                if stub.mode == "serial":  # one request at a time, each reporting its own time, as llama-server's timings
                    import time

                    with stub.one_at_a_time:
                        t0 = time.monotonic()
                        time.sleep(0.03)
                        doc = stub.answer(body)
                        doc["timings"] = {"prompt_ms": 0.0, "predicted_ms": (time.monotonic() - t0) * 1000}
                    return self.send_json(200, doc)
                self.send_json(200, stub.answer(body))

        class Quiet(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # the dropped-connection mode breaks pipes on purpose
                pass

        self.serve(Handler, Quiet)

    def answer(self, body: dict) -> dict:
        """A deterministic 'model': tokens from the prompt's hash (and the seed only if it is ignored on purpose)."""
        salt = str(self.completions) if self.mode == "ignores_seed" else ""
        h = hashlib.sha256((str(body["prompt"]) + salt).encode()).digest()
        n = int(body.get("max_tokens", 16))
        toks = [" " + WORDS[h[i % 32] % len(WORDS)] for i in range(n)]
        doc = {"id": "cmpl-1", "object": "text_completion", "model": "stub-model",
               "choices": [{"index": 0, "text": "".join(toks), "finish_reason": "length", "logprobs": None}],
               "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}}
        if self.mode == "no_cache":  # a server that reports its prefix cache, and never reads from it
            doc["usage"]["prompt_tokens_details"] = {"cached_tokens": 0}
        if body.get("logprobs") is not None:
            k = int(body["logprobs"])
            lps = [-0.1 - (h[i % 32] / 255.0) for i in range(n)]
            tops = [{t: lp, **{" " + w: lp - 1.0 - j for j, w in enumerate(WORDS[:k]) if " " + w != t}} for t, lp in zip(toks, lps)]
            tops = [dict(sorted(d.items(), key=lambda kv: -kv[1])[:k]) for d in tops]
            doc["choices"][0]["logprobs"] = {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops,
                                             "text_offset": [0] * n}
        return doc


@pytest.fixture
def stub():
    s = Stub()
    yield s
    s.close()


def _check(cli, stub, out: Path, *extra: str, model: str = "stub-model", env: dict | None = None):
    return cli("check", "--backend", "openai", "--base-url", stub.url, "--model", model, "--out", out, "--runs", "2",
               "--max-new-tokens", "4", "--no-progress", *extra, env=env)


def test_strings_only_server_passes_at_tier_2_with_token_strings(cli, stub, tmp_path):
    out = tmp_path / "run"
    res = _check(cli, stub, out, "--tier", "2")
    assert res.exit_code == 0, res.output
    report = assert_valid_run(out)
    assert report["status"] == "PASS" and report["tier"]["effective"] == 2
    recs = [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines()]
    assert recs and all(isinstance(t, str) for r in recs for t in r["token_ids"])
    assert recs[0]["evidence"]["tokens_as"] == "strings" and recs[0]["evidence"]["prompt_as"] == "text"
    assert all(isinstance(p[0], str) for step in recs[0]["top_logprobs"] for p in step)
    cfg = json.loads((out / "run_config.json").read_text())
    assert cfg["model"]["weights_sha256"] is None and cfg["model"]["remote"].startswith("weights not hashed: remote")
    assert cli("verify", out).exit_code == 0


def test_server_ignoring_the_seed_is_reported_not_hidden(cli, stub, tmp_path):
    stub.mode = "ignores_seed"
    out = tmp_path / "run"
    res = _check(cli, stub, out)
    assert res.exit_code == 1, res.output
    report = assert_valid_run(out, failed=True)
    assert report["category"] == "RUN_VARIANCE"


def test_api_key_comes_from_the_named_variable_and_is_never_written(cli, stub, tmp_path):
    stub.key = "sk-test-0123456789abcdef0123"
    out = tmp_path / "run"
    res = _check(cli, stub, out, "--api-key-env", "STUB_KEY", env={"STUB_KEY": stub.key})
    assert res.exit_code == 0, res.output
    assert f"Bearer {stub.key}" in stub.seen_auth
    for f in out.rglob("*"):
        if f.is_file():
            assert stub.key not in f.read_text(errors="replace"), f
    assert stub.key not in res.output


def test_401_is_one_line_and_nothing_written(cli, stub, tmp_path):
    stub.key = "sk-right-0123456789abcdef0123"
    out = tmp_path / "run"
    res = _check(cli, stub, out, "--api-key-env", "STUB_KEY", env={"STUB_KEY": "sk-wrong-0123456789abcdef01"})
    assert res.exit_code == 2, res.output
    assert "refused the credentials (HTTP 401" in res.output and "Traceback" not in res.output
    assert "sk-wrong" not in res.output
    assert not out.exists()


def test_unset_key_variable_is_a_usage_error(cli, stub, tmp_path):
    res = _check(cli, stub, tmp_path / "run", "--api-key-env", "DETLLM_TEST_UNSET_KEY", env={"DETLLM_TEST_UNSET_KEY": ""})
    assert res.exit_code == 2 and "DETLLM_TEST_UNSET_KEY" in res.output
    assert not (tmp_path / "run").exists()


def test_unknown_model_is_refused_with_the_served_names(cli, stub, tmp_path):
    res = _check(cli, stub, tmp_path / "run", model="no-such-model")
    assert res.exit_code == 2 and "does not serve model 'no-such-model'" in res.output and "stub-model" in res.output
    assert not (tmp_path / "run").exists()


def test_no_logprobs_caps_the_tier_and_says_why(cli, stub, tmp_path):
    stub.mode = "no_logprobs"
    out = tmp_path / "run"
    res = _check(cli, stub, out, "--tier", "2")
    assert res.exit_code == 0, res.output
    report = assert_valid_run(out)
    assert report["tier"] == {"requested": 2, "effective": 1}
    applied = json.loads((out / "determinism_applied.json").read_text())
    assert "rejected logprobs" in applied["downgrade_reason"]
    rec = json.loads((out / "trace.jsonl").read_text().splitlines()[0])
    assert rec["logprobs"] is None and rec["evidence"]["tokens_as"] == "whole text" and rec["token_ids"] == [rec["text"]]
    res = _check(cli, stub, tmp_path / "strict", "--tier", "2", "--mode", "strict")
    assert res.exit_code == 3 and not (tmp_path / "strict").exists()


@pytest.mark.parametrize("mode", ["fail_after_probe", "drop_after_probe"])
def test_server_failing_mid_run_is_exit_8_and_the_folder_is_not_complete(cli, stub, tmp_path, mode):
    stub.mode = mode
    out = tmp_path / "run"
    res = _check(cli, stub, out)
    assert res.exit_code == 8, res.output
    line = [ln for ln in res.output.splitlines() if ln.startswith("detllm: error:")]
    assert len(line) == 1 and "Traceback" not in res.output
    assert ("HTTP 500" in line[0]) if mode == "fail_after_probe" else ("connection dropped" in line[0])
    assert not (out / "manifest.json").exists() and not (out / "report.json").exists()
    assert len(stub.bodies) == 2  # the probe and one request: a failed generation is never resent


def test_refused_connection_before_the_run_is_exit_4(cli, tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = cli("check", "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}/v1", "--model", "m", "--out", tmp_path / "r",
              "--opt", "retries=0", "--no-progress")
    assert res.exit_code == 4, res.output
    assert "cannot connect to" in res.output and not (tmp_path / "r").exists()


@pytest.mark.parametrize("args, needle", [
    (["--backend", "openai", "--model", "m"], "needs --base-url"),
    (["--backend", "openai", "--model", "m", "--base-url", "ftp://x"], "http:// or https://"),
    (["--backend", "hf", "--base-url", "http://127.0.0.1:1/v1"], "applies to --backend openai"),
    (["--backend", "hf", "--concurrency", "1,8"], "applies to --backend openai"),
    (["--backend", "openai", "--model", "m", "--base-url", "http://127.0.0.1:1/v1", "--api-key-env", "sk-abcdef"], "NAME of an environment"),
    (["--backend", "openai", "--model", "m", "--base-url", "http://127.0.0.1:1/v1", "--concurrency", "1,8", "--vary-batch", "2"], "give one"),
])
def test_bad_flags_are_usage_errors(cli, tmp_path, args, needle):
    res = cli("check", *args, "--out", tmp_path / "r", "--no-progress")
    assert res.exit_code == 2, res.output
    assert needle in res.output and not (tmp_path / "r").exists()


def test_step_parsing_of_both_logprob_formats():
    from detllm.backends.openai.answers import steps as _steps

    chat = _steps({"content": [{"id": 5, "token": "a", "logprob": -0.5, "top_logprobs": [{"id": 5, "token": "a", "logprob": -0.5}]}]})
    assert chat[0].id == 5 and chat[0].top == [("a", 5, -0.5)]
    vllm = _steps({"tokens": ["token_id:7"], "token_logprobs": [-1.0], "top_logprobs": [{"token_id:7": -1.0, "token_id:3": -2.0}]})
    assert vllm[0].id == 7 and [t[1] for t in vllm[0].top] == [7, 3]
    assert _steps(None) is None
    assert math.isclose(vllm[0].logprob, -1.0)


def _as_generation(steps):
    """What _generation makes of steps() for token texts without ids: (ids, texts, logprobs, top-k)."""
    if not steps or any(s.id is not None for s in steps):
        return None
    return [s.token for s in steps], [s.token for s in steps], [s.logprob for s in steps], [[(t[0], t[2]) for t in s.top] for s in steps]


def test_the_plain_answer_path_gives_what_the_steps_give_and_leaves_the_rest_to_them():
    """plain_steps (most servers' completions layout, no step objects) is held to steps() as _generation reads
    them, on random answers with tied, reordered, integral, non-finite, missing and vLLM-id entries: wherever
    it answers, the same lists; wherever an entry is not plain, None (steps() then reads the answer)."""
    from detllm.backends.openai.answers import plain_steps, steps

    rng = random.Random(0)
    odd = [0, -1, float("nan"), float("inf"), None, "x", "-0.5"]  # values that are not finite floats
    answered = fell_back = 0
    for _ in range(3000):
        n = rng.randint(0, 5)
        tokens = [rng.choice([" a", " b", "c", "", "token_id:7", "\u00e9"]) for _ in range(n)]
        lps = [rng.choice([-0.5, -1.25, -0.0, 0.0, float("nan"), None]) for _ in range(n)]
        tops = []
        for _ in range(n):
            keys = rng.sample([" a", " b", " c", " d", "token_id:3"], rng.randint(0, 4))
            tops.append({k: rng.choice([-0.5, -1.5, -1.5, -2.0]) if rng.random() < 0.93 else rng.choice(odd) for k in keys})
        lp = {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops}
        if rng.random() < 0.05:
            lp[rng.choice(["token_logprobs", "top_logprobs"])] = (lps if rng.random() < 0.5 else tops)[:-1] or None
        got = plain_steps(lp)
        if got is None:
            fell_back += 1
            continue
        answered += 1
        assert got == _as_generation(steps(lp)), lp
        assert got[0] is not got[1]  # ids and texts: two lists
    assert answered > 300 and fell_back > 300, (answered, fell_back)
    chat = {"content": [{"token": "a", "logprob": -0.5, "top_logprobs": [{"token": "a", "logprob": -0.5}]}]}
    assert plain_steps(chat) is None and plain_steps(None) is None and plain_steps({"tokens": []}) is None


def test_replay_never_takes_the_url_or_key_variable_from_a_pack(cli, stub, tmp_path):
    stub.key = "sk-pack-0123456789abcdef0123"
    env = {"STUB_KEY": stub.key}
    pack = tmp_path / "pack"
    assert _check(cli, stub, pack, "--api-key-env", "STUB_KEY", env=env).exit_code == 0
    res = cli("replay", pack, "--out", tmp_path / "r0", "--no-progress", env=env)
    assert res.exit_code == 2 and "never takes its URL from the pack" in res.output and not (tmp_path / "r0").exists()
    n = len(stub.seen_auth)
    res = cli("replay", pack, "--base-url", stub.url, "--allow-model-change", "--out", tmp_path / "r1", "--no-progress", env=env)
    assert res.exit_code == 2 and "HTTP 401" in res.output  # the pack's api_key_env was dropped: no key was sent
    assert all(a is None for a in stub.seen_auth[n:]) and not (tmp_path / "r1").exists()
    res = cli("replay", pack, "--base-url", stub.url, "--api-key-env", "STUB_KEY", "--out", tmp_path / "r2", "--no-progress", env=env)
    assert res.exit_code == 7 and "never hashed" in res.output and not (tmp_path / "r2").exists()
    res = cli("replay", pack, "--base-url", stub.url, "--api-key-env", "STUB_KEY", "--allow-model-change", "--out", tmp_path / "r3",
              "--no-progress", env=env)
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "r3" / "report.json").read_text())["status"] == "PASS"


def test_503_is_retried_and_the_retry_recorded(cli, stub, tmp_path):
    stub.mode = "busy_once"
    out = tmp_path / "run"
    res = _check(cli, stub, out)
    assert res.exit_code == 0, res.output
    assert_valid_run(out)
    retries = [json.loads(line)["evidence"]["retries"] for line in (out / "trace.jsonl").read_text().splitlines()]
    assert retries[0] == 1 and sum(retries) == 1


def test_timeout_is_exit_8_with_one_line(cli, stub, tmp_path):
    stub.mode = "slow_after_probe"
    out = tmp_path / "run"
    res = _check(cli, stub, out, "--opt", "request_timeout=0.5")
    assert res.exit_code == 8, res.output
    assert "did not answer request 0 within 0.5 s" in res.output and "Traceback" not in res.output
    assert not (out / "report.json").exists()


def test_credentials_in_the_url_are_refused_and_never_echoed(cli, stub, tmp_path):
    for url in (stub.url.replace("http://", "http://user:pw-secret-123@"), stub.url + "?api_key=pw-secret-123"):
        res = cli("check", "--backend", "openai", "--base-url", url, "--model", "stub-model", "--out", tmp_path / "r", "--no-progress")
        assert res.exit_code == 2 and "carries a credential" in res.output, res.output
        assert "pw-secret-123" not in res.output and not (tmp_path / "r").exists()
    assert stub.completions == 0


def test_a_server_that_reveals_nothing_is_pass_marked_not_observable_or_unverified_when_required(cli, stub, tmp_path):
    """No /slots, no /metrics, no per-request times: whether the server computed the 4 requests together
    cannot be seen. PASS marked "engagement not observable"; --require-engagement makes it UNVERIFIED."""
    res = _check(cli, stub, tmp_path / "a", "--concurrency", "1,4")
    assert res.exit_code == 0, res.output
    report = assert_valid_run(tmp_path / "a")
    e = next(c for c in report["comparisons"] if c["name"] == "batch 4 vs batch 1")["engagement"]
    assert (report["status"], e["axis"], e["answer"]) == ("PASS", "concurrency", "not_observable"), e
    assert report["engagement"]["not_observable"] == ["batch 4 vs batch 1"]
    assert "PASS batch 4 vs batch 1 (engagement not observable)" in res.output
    assert "(engagement not observable)" in (tmp_path / "a" / "report.md").read_text()
    res = _check(cli, stub, tmp_path / "b", "--concurrency", "1,4", "--require-engagement", "--mode", "strict")
    assert res.exit_code == 3, res.output
    report = assert_valid_run(tmp_path / "b")
    assert report["status"] == "UNVERIFIED" and report["engagement"]["unverified"] == ["batch 4 vs batch 1"]
    assert cli("verify", tmp_path / "b").exit_code == 0


def test_a_cache_probe_whose_warm_side_read_nothing_is_unverified(cli, stub, tmp_path):
    """The server reports 0 cached prompt tokens on the warm side: warm vs cold compared two cold
    computations, so the probe's PASS would be vacuous: shown not engaged, UNVERIFIED."""
    stub.mode = "no_cache"
    res = cli("check", "--backend", "openai", "--base-url", stub.url, "--model", "stub-model", "--cache-probe",
              "--max-new-tokens", "4", "--out", tmp_path / "c", "--no-progress")
    assert res.exit_code == 0, res.output
    report = assert_valid_run(tmp_path / "c")
    e = next(c for c in report["comparisons"] if c["name"] == "warm vs cold")["engagement"]
    assert (report["status"], e["axis"], e["answer"]) == ("UNVERIFIED", "prefix cache", "not_engaged"), e
    assert "the warm side read 0 cached prompt tokens" in e["evidence"]
    assert cli("verify", tmp_path / "c").exit_code == 0


def test_a_server_that_computes_one_request_at_a_time_is_sent_again_then_unverified(cli, stub, tmp_path):
    """Its own per-request times add up to no more than the group's wall time (one after another), and it
    reports no slot count: the group is sent twice more, every connection opened first, each attempt
    recorded; still not engaged, so the check is UNVERIFIED."""
    stub.mode = "serial"
    res = _check(cli, stub, tmp_path / "c", "--concurrency", "1,4")
    assert res.exit_code == 0 and "warning: UNVERIFIED" in res.stderr, res.output
    report = assert_valid_run(tmp_path / "c")
    e = next(c for c in report["comparisons"] if c["name"] == "batch 4 vs batch 1")["engagement"]
    assert (report["status"], e["answer"]) == ("UNVERIFIED", "not_engaged"), e
    assert "the server computed them one after another" in e["evidence"]
    at4 = [json.loads(line) for line in (tmp_path / "c" / "trace.jsonl").read_text().splitlines() if '"batch_size":4' in line]
    attempts = at4[0]["evidence"]["server_batch"]["earlier_attempts"]
    assert [a["answer"] for a in attempts] == ["not_engaged", "not_engaged"]


def test_kld_of_a_server_keyed_by_token_text(cli, stub, tmp_path):
    """report --format kld over a served run whose top_logprobs are keyed by token text (no ids):
    the KLD is computed over the tokens' text (issue 32, SRE section), not a ValueError traceback."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert _check(cli, stub, a, "--tier", "2").exit_code == 0
    assert _check(cli, stub, b, "--tier", "2").exit_code == 0
    r = cli("report", "--format", "kld", a, b)
    assert r.exit_code == 0, r.output
    assert "tokens keyed by their text: the served model gave no token ids" in r.stdout
    assert "Mean    KLD:   0.000000 ±   0.000000" in r.stdout and "Same top p: 100.000 ± 0.000 %" in r.stdout
    assert "0 of 4 prompts diverged; logprobs and top-k identical at every position" in r.stdout
    fake = tmp_path / "f"  # one run keyed by ids, the other by text: refused in one line
    assert cli("run", "--backend", "fake", "--tier", "2", "--max-new-tokens", "4", "--out", fake).exit_code == 0
    r = cli("report", "--format", "kld", fake, a)
    assert r.exit_code == 2 and "one run records token ids, the other token text" in r.stderr and "Traceback" not in r.output


LEAN_PROBE = """
import sys
from detllm.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
heavy = [m for m in ("rich", "pygments", "httpx._main") if m in sys.modules]
import httpx._main  # imports as usual afterwards
print(f"exit {code} loaded {heavy} then {httpx._main.__name__}", file=sys.stderr)
"""


def test_a_served_check_imports_httpx_without_its_command_line_client(stub, tmp_path):
    """httpx imports its CLI (click, rich, pygments: ~30 ms, ~4.5 MiB) whenever they are installed; a served
    check to a log keeps it out while httpx imports (wire.httpx_module), and it imports as usual afterwards."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    proc = subprocess.run([sys.executable, "-c", LEAN_PROBE, "check", "--backend", "openai", "--base-url", stub.url, "--model",
                           "stub-model", "--runs", "2", "--max-new-tokens", "4", "--out", str(tmp_path / "r")],
                          env={**env, "PYTHONPATH": str(Path(__file__).parents[1])}, capture_output=True, text=True, timeout=120)
    assert "detllm check: PASS" in proc.stdout, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == "exit 0 loaded [] then httpx._main", proc.stderr[-2000:]
