"""Served runs compared with local engines, like with like (issue 20, R3). A real HTTP server on
loopback speaks the OpenAI completions API the way hosted endpoints do (token strings, no ids,
text prompts it tokenizes itself); its "model" is detllm's own fake backend, so it generates
exactly what `--backend fake` generates. A diff of the two compares token texts with token
texts and never calls a representation a flip or unknown input ids a tokenizer difference; a
real flip the server makes is still found where it is."""

from __future__ import annotations

import hashlib
import json

import pytest

import detllm
from detllm.runfolder.artifacts import validate
from detllm.backends.base import Request
from detllm.backends.fake import FakeBackend, FakeOptions
from detllm.compare.represent import comparable, input_ids_known, representation
from detllm.core.config import Decoding

from .conftest import trace_records
from .stubhttp import JSONHandler, StubServer

PROMPTS = ["hello there", "general kenobi"]


class FakeServed(StubServer):
    """A strings-only completions server whose answers are FakeBackend's; `flip` makes one prompt's
    token at one step the runner-up (a real difference of the served side)."""

    def __init__(self) -> None:
        self.flip: tuple[str, int] | None = None
        served = self

        class Handler(JSONHandler):

            def do_GET(self):
                if self.path == "/v1/models":
                    return self.send_json(200, {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "tests"}]})
                self.send_error(404)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if self.path != "/v1/completions":
                    return self.send_error(404)
                self.send_json(200, served.answer(body))

        self.serve(Handler)

    def answer(self, body: dict) -> dict:
        text = body["prompt"]
        spec = f"prompt=0,pos={self.flip[1]}" if self.flip and self.flip[0] == text else ""
        fake = FakeBackend(FakeOptions(diverge=spec))
        req = Request(0, tuple(fake.tokenize(text)), text, hashlib.sha256(text.encode()).hexdigest())
        k = int(body.get("logprobs") or 0)
        gen = fake.generate([req], Decoding(max_new_tokens=int(body["max_tokens"])), seed=int(body.get("seed", 0)),
                            n_logprobs=max(k, 1), logprobs=bool(k))[0]
        choice = {"index": 0, "text": gen.text, "finish_reason": "length", "logprobs": None}
        if k:
            choice["logprobs"] = {"tokens": gen.token_texts, "token_logprobs": gen.logprobs, "text_offset": [0] * len(gen.token_ids),
                                  "top_logprobs": [{chr(t): lp for t, lp in step} for step in gen.top_logprobs]}
        return {"id": "cmpl-1", "object": "text_completion", "model": "fake", "choices": [choice],
                "usage": {"prompt_tokens": len(req.input_ids), "completion_tokens": len(gen.token_ids)}}


@pytest.fixture
def served():
    s = FakeServed()
    yield s
    s.close()


def _runs(tmp_path, served, cli):
    local = detllm.run(backend="fake", model="fake", prompts=PROMPTS, max_new_tokens=6, tier=2, logprobs=3,
                       out=tmp_path / "local").out_dir
    args = ["run", "--backend", "openai", "--base-url", served.url, "--model", "fake", "--max-new-tokens", "6",
            "--tier", "2", "--logprobs", "3", "--out", tmp_path / "served", "--no-progress"]
    for p in PROMPTS:
        args += ["--prompt", p]
    res = cli(*args)
    assert res.exit_code == 0, res.output
    return local, tmp_path / "served"


def test_the_same_generation_served_as_strings_is_no_divergence(tmp_path, served, cli):
    local, remote = _runs(tmp_path, served, cli)
    lrec, rrec = trace_records(local), trace_records(remote)
    # what makes the two hard to compare really happened: ids vs strings, real input ids vs none
    assert all(isinstance(t, int) for t in lrec[0]["token_ids"]) and lrec[0]["token_texts"] == rrec[0]["token_ids"]
    assert rrec[0]["evidence"]["tokens_as"] == "strings" and rrec[0]["evidence"]["prompt_as"] == "text"
    assert rrec[0]["input_ids"] == [] and lrec[0]["input_ids"] != []
    assert [r["logprobs"] for r in lrec] == [r["logprobs"] for r in rrec]
    for a, b in ((local, remote), (remote, local)):
        report = detllm.diff(a, b).report
        validate(report, "report")
        assert report["status"] == "PASS", (report["first_divergence"], report["causes"])
        assert report["tier"]["effective"] == 2
        assert "TOKENIZER_MISMATCH" not in [c["code"] for c in report["info"]]
        skipped = {n["field"] for n in report["not_compared"]}
        assert {"trace_record.token_ids", "trace_record.input_ids"} <= skipped


def test_a_real_flip_of_the_served_side_is_found_where_it_is(tmp_path, served, cli):
    served.flip = (PROMPTS[1], 2)
    local, remote = _runs(tmp_path, served, cli)
    res = cli("diff", local, remote, "--tier", "2")
    assert res.exit_code == 1, res.output
    report = detllm.diff(local, remote).report
    d = report["first_divergence"]
    assert (d["prompt_index"], d["token_index"], d["kind"]) == (1, 2, "token")
    assert d["left"]["token_id"] == trace_records(local)[1]["token_texts"][2] and d["right"]["token_id"] == trace_records(remote)[1]["token_ids"][2]
    # the top-k is keyed by text only where every entry's text is known; here it is not, so the gap is not
    # judged from a representation: no confident flip, and the reason named
    assert d["magnitude"]["label"] == "unclassified" and d["magnitude"]["why"] == "no logprobs for the two tokens"
    assert report["comparisons"][0]["prompts_diverged"] == 1


def test_records_alike_are_left_as_they_are():
    a = {"token_ids": [1, 2], "token_texts": ["a", "b"], "input_ids_sha256": "x" * 64}
    pairs = [(a, dict(a))]
    assert comparable(pairs) is pairs and representation(a) == "ids" and input_ids_known(a)
