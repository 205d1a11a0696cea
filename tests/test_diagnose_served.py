"""diagnose of a served check whose repeats diverge because the server reused cached prompt
tokens (run 0 cold, later runs warm). Against the real llama-server (session fixture) the cache
is a knob: `cache_prompt: false` on every request makes the divergence vanish, confirmed in fresh
processes. Against real HTTP servers on loopback that identify as vLLM or SGLang, whose cache is
switched where the server is started, the knob is named as not flippable and the per-record
cached-token evidence is ranked. An unreachable endpoint is one line, exit 4, nothing written.
Assertions read the recorded cached-token counts, never which run happened to be warm."""

from __future__ import annotations

import hashlib
import json

import pytest

from detllm.runfolder.artifacts import read_json

from .conftest import trace_records, write_prompts
from .stubhttp import JSONHandler, StubServer

WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]


def _pairs_with_different_cache(records: list[dict]) -> list[tuple[int, int, int, int]]:
    """(prompt, run, cached at run 0, cached at that run) where the counts differ."""
    by = {(r["prompt_index"], r["run_index"]): r["evidence"]["cached_prompt_tokens"] for r in records}
    return [(p, k, by[(p, 0)], c) for (p, k), c in sorted(by.items()) if k > 0 and c != by[(p, 0)]]


class CachingServer(StubServer):
    """A real HTTP server that speaks the OpenAI completions API as a vLLM (`/version`) or
    SGLang (`/get_server_info`) server does, with a prefix cache: a prompt seen before is answered
    with usage.prompt_tokens_details.cached_tokens > 0 and logprobs off by 1e-4 (the numerics of a
    prefill that reused cached KV)."""

    def __init__(self, kind: str, identify_by: str = "route") -> None:
        self.seen: set[str] = set()
        self.bodies: list[dict] = []
        server = self

        class Handler(JSONHandler):

            def do_GET(self):
                if self.path == "/v1/models":
                    return self.send_json(200, {"object": "list", "data": [{"id": "stub-model", "object": "model", "owned_by": kind}]})
                if identify_by == "route" and kind == "vllm" and self.path == "/version":
                    return self.send_json(200, {"version": "0.9.0"})
                if identify_by == "route" and kind == "sglang" and self.path == "/get_server_info":
                    return self.send_json(200, {"version": "0.4.6", "disable_radix_cache": False})
                self.send_json(404, {"error": {"message": "not found"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path != "/v1/completions":
                    return self.send_json(404, {"error": {"message": "not found"}})
                server.bodies.append(body)
                self.send_json(200, server.answer(body))

        self.serve(Handler)

    def answer(self, body: dict) -> dict:
        prompt = str(body["prompt"])
        cached = 3 if prompt in self.seen else 0
        self.seen.add(prompt)
        h = hashlib.sha256(prompt.encode()).digest()
        n = int(body.get("max_tokens", 16))
        toks = [" " + WORDS[h[i] % len(WORDS)] for i in range(n)]
        doc = {"id": "cmpl-1", "object": "text_completion", "model": "stub-model",
               "choices": [{"index": 0, "text": "".join(toks), "finish_reason": "length", "logprobs": None}],
               "usage": {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": 4 + n,
                         "prompt_tokens_details": {"cached_tokens": cached}}}
        if body.get("logprobs") is not None:
            lps = [-0.1 - h[i] / 255.0 - (1e-4 if cached else 0.0) for i in range(n)]
            doc["choices"][0]["logprobs"] = {"tokens": toks, "token_logprobs": lps, "top_logprobs": [{t: lp} for t, lp in zip(toks, lps)],
                                             "text_offset": [0] * n}
        return doc


@pytest.mark.parametrize("kind,identify_by,switch", [
    ("vllm", "route", "--enable-prefix-caching"),
    ("sglang", "route", "/flush_cache"),
    ("vllm", "models", "/reset_prefix_cache"),  # no /version: the owner /v1/models names identifies it
])
def test_server_level_cache_is_named_not_flipped_and_the_recorded_counts_are_ranked(cli, tmp_path, kind, identify_by, switch):
    srv = CachingServer(kind, identify_by)
    try:
        prompts = write_prompts(tmp_path / "prompts.jsonl", ["first prompt here", "second prompt here"])
        chk = cli("check", "--backend", "openai", "--base-url", srv.url, "--model", "stub-model", "--runs", "3", "--tier", "2",
                  "--max-new-tokens", "4", "--prompts", prompts, "--out", tmp_path / "chk", "--no-progress")
        assert chk.exit_code == 1, chk.output
        env = json.loads((tmp_path / "chk" / "env.json").read_text())
        assert env["backend"]["server"] == kind and switch in env["backend"]["cache_switch"]
        differ = _pairs_with_different_cache(trace_records(tmp_path / "chk"))
        assert differ and all(c0 != ck for _, _, c0, ck in differ)
        res = cli("diagnose", tmp_path / "chk", "--out", tmp_path / "d", "--fresh-repeats", "2")
        assert res.exit_code == 0, res.output
        doc = read_json(tmp_path / "d" / "diagnosis.json", "diagnosis")
        skipped = {s["knob"]: s["reason"] for s in doc["skipped_knobs"]}
        assert switch in skipped["prefix cache"] and "cannot flip it" in skipped["prefix cache"]
        assert "cache_prompt" not in {p["knob"] for p in doc["probes"]}  # nothing flipped on a server-level cache
        assert not any("cache_prompt" in b for b in srv.bodies)  # and no request carried llama-server's field
        top = doc["knobs"][0]
        assert (top["knob"], top["verdict"], top["rank"]) == ("prefix cache", "follows", 1)
        p, k, c0, ck = differ[0]
        assert f"run_{k} vs run_0 @ batch 1, prompt {p}: {c0} vs {ck} cached prompt tokens" in top["summary"]
        assert doc["conclusion"].startswith("The divergence follows prefix cache")

        # the per-request switch is llama-server's: asked of this server, it is refused before anything is written
        bad = cli("check", "--backend", "openai", "--base-url", srv.url, "--model", "stub-model", "--opt", "cache_prompt=false",
                  "--prompts", prompts, "--out", tmp_path / "bad", "--no-progress")
        assert bad.exit_code == 2 and f"this {kind} server takes no such field" in bad.output and switch in bad.output
        assert not (tmp_path / "bad").exists()
    finally:
        srv.close()
    # the endpoint is gone: one line, exit 4, no diagnosis folder
    gone = cli("diagnose", tmp_path / "chk", "--out", tmp_path / "d2")
    assert gone.exit_code == 4, gone.output
    assert "cannot connect to" in gone.output and "Traceback" not in gone.output
    assert len([ln for ln in gone.output.splitlines() if ln.startswith("detllm: error:")]) == 1
    assert not (tmp_path / "d2").exists()


@pytest.mark.engine
def test_llama_server_cache_prompt_false_is_probed_and_makes_the_divergence_vanish(llama_served, cli, tmp_path):
    """The real llama-server (8 slots, prompt caching on as it ships): a repeat that reused cached
    prompt tokens differs in its logprobs from the cold run 0. diagnose flips the cache per request
    (cache_prompt: false), the divergence vanishes, and fresh processes confirm it."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", ["diagnose served cache: the lighthouse keeper counted", "diagnose served cache: seven blue boats",
                                  "diagnose served cache: under the old bridge the water"])
    chk = cli("check", "--backend", "openai", "--base-url", llama_served.url, "--model", "tiny", "--runs", "3", "--tier", "2",
              "--max-new-tokens", "16", "--prompts", prompts, "--out", tmp_path / "chk", "--no-progress")
    assert chk.exit_code == 1, chk.output
    base = trace_records(tmp_path / "chk")
    differ = _pairs_with_different_cache(base)
    assert differ, "the server reused cached prompt tokens in some repeat"
    res = cli("diagnose", tmp_path / "chk", "--out", tmp_path / "d", "--fresh-repeats", "2")
    assert res.exit_code == 0, res.output
    doc = read_json(tmp_path / "d" / "diagnosis.json", "diagnosis")
    probe = next(p for p in doc["probes"] if p["name"] == "cache_prompt=false")
    assert probe["status"] == "ran" and probe["outcome"] == "vanish"
    flipped = trace_records(tmp_path / "d" / probe["folder"])
    assert flipped and all(r["evidence"]["cached_prompt_tokens"] == 0 for r in flipped)  # no request reused the cache
    applied = json.loads((tmp_path / "d" / probe["folder"] / "determinism_applied.json").read_text())
    cache = next(a for a in applied["settings"] if a["name"] == "prefix_cache")
    assert cache["requested"] is False and cache["value"]["cache_prompt"] is False
    knob = doc["knobs"][0]
    assert (knob["knob"], knob["verdict"]) == ("cache_prompt", "vanishes")
    by = {(r["prompt_index"], r["run_index"]): r for r in base}
    diverged = [(p, k) for (p, k), r in by.items() if k > 0 and (r["token_ids"], r["logprobs"]) != (by[p, 0]["token_ids"], by[p, 0]["logprobs"])]
    cached = {key: r["evidence"]["cached_prompt_tokens"] for key, r in by.items()}
    assert diverged and all(cached[p, k] != cached[p, 0] for p, k in diverged)  # what the recorded evidence says ...
    assert f"every diverged prompt reused different numbers of cached prompt tokens ({len(diverged)}/{len(diverged)}" in knob["summary"]
    passing = doc["passing_settings"]
    assert passing["settings"] == {"cache_prompt": "false"} and passing["fresh_process_passes"] == passing["fresh_process_runs"] == 2
    assert "cache_prompt" not in {s["knob"] for s in doc["skipped_knobs"]}
    assert "not an option of the openai backend" not in (tmp_path / "d" / "diagnosis.txt").read_text()
