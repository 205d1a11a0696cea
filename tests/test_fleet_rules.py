"""The fleet's rules on real loopback endpoints (tests/stubhttp.py stubs and a socket that takes
connections and never answers, as a SIGSTOPped server does): verify re-derives the fleet verdict
(an edited fleet.json resealed with the project's own seal fails), a fleet with a replica that failed
mid-run packs and verifies, a hung endpoint is a `timeout` within --opt request_timeout, no endpoint
answering exits 4 with nothing written, --reference-url, `report --format kld FLEET`, JUnit names."""

from __future__ import annotations

import json
import shutil
import socket
import tarfile
import xml.etree.ElementTree as ET

import pytest

import detllm
from detllm.runfolder.fleetseal import seal_fleet
from tests.stubhttp import JSONHandler, StubServer

TOKENS = 4


def _answer(lp: float) -> dict:
    top = {" a": lp, " b": -1.5, " c": -2.5}
    return {"object": "text_completion", "model": "tiny", "usage": {"prompt_tokens": 4, "completion_tokens": TOKENS},
            "choices": [{"index": 0, "text": " a" * TOKENS, "finish_reason": "length",
                         "logprobs": {"tokens": [" a"] * TOKENS, "token_logprobs": [lp] * TOKENS, "top_logprobs": [top] * TOKENS}}]}


def _stub(lp: float = -0.5, fail_runs: bool = False) -> StubServer:
    """A completions endpoint answering with chosen-token logprob `lp`; `fail_runs`: it answers the
    capability probe (max_tokens 1), then refuses every request of the run (HTTP 400)."""
    class Handler(JSONHandler):
        def do_GET(self):
            if self.path == "/v1/models":
                return self.send_json(200, {"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "stub"}]})
            self.send_json(404, {"error": "not found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if fail_runs and body.get("max_tokens") != 1:
                return self.send_json(400, {"error": {"message": "the replica broke"}})
            self.send_json(200, _answer(lp))
    s = StubServer()
    s.serve(Handler)
    return s


class Hung:
    """A listening socket that is never accepted from: connections open (the kernel's backlog) and
    no byte ever comes back, as from a SIGSTOPped server."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"

    def close(self) -> None:
        self.sock.close()


def _dead_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return f"http://127.0.0.1:{port}/v1"


def _cfg(**opt):
    return detllm.make_config(backend="openai", model="tiny", tier=2, runs=2, max_new_tokens=TOKENS,
                              options={"request_timeout": 2, **opt})


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Replicas 0, 1, 3 answer; 2 answers with other logprobs (the outlier); 4 breaks after its probe."""
    stubs = [_stub(), _stub(), _stub(lp=-0.25), _stub(), _stub(fail_runs=True)]
    try:
        out = tmp_path_factory.mktemp("rules") / "fleet"
        outcome = detllm.fleet_check(_cfg(), [s.url for s in stubs], prompts=["hello", "world"], out=out)
        yield out, outcome, [s.url for s in stubs]
    finally:
        for s in stubs:
            s.close()


def test_the_fleet_folder_marks_the_broken_replica(fleet):
    out, outcome, urls = fleet
    doc = outcome.report
    assert (doc["category"], doc["outliers"], outcome.exit_code) == ("OUTLIER", [2], 1)
    broken = doc["replicas"][4]
    assert broken["status"] == "error" and broken["error"]["kind"] == "error" and "the replica broke" in broken["error"]["message"]
    assert (out / "replica_4" / "detllm.partial").exists()


def test_verify_re_derives_the_fleet_verdict(fleet, tmp_path, cli):
    out, _, _ = fleet
    r = cli("verify", out)
    assert r.exit_code == 0, r.output
    assert "fleet verdict re-derived from the replica folders: FAIL OUTLIER" in r.output
    # OUTLIER -> AGREE, resealed with the project's own seal (no key): the replicas say otherwise
    copy = tmp_path / "forged"
    shutil.copytree(out, copy)
    doc = json.loads((copy / "fleet.json").read_text())
    doc.update(status="PASS", category="AGREE", outliers=[])
    (copy / "fleet.json").write_text(json.dumps(doc))
    seal_fleet(copy)
    r = cli("verify", copy)
    assert r.exit_code == 6, r.output
    assert "fleet.json: status is 'PASS', but the replicas give 'FAIL'" in r.output
    # a replica marked failed although its folder is a sealed run: the groups no longer follow
    copy2 = tmp_path / "forged2"
    shutil.copytree(out, copy2)
    doc = json.loads((copy2 / "fleet.json").read_text())
    doc["replicas"][2].update(status="error", error={"kind": "timeout", "exit_code": 8, "message": "x"})
    (copy2 / "fleet.json").write_text(json.dumps(doc))
    seal_fleet(copy2)
    r = cli("verify", copy2)
    assert r.exit_code == 6 and "but the replicas give" in r.output, r.output


def test_a_fleet_with_a_failed_replica_packs_and_verifies(fleet, tmp_path, cli):
    out, _, _ = fleet
    pack = tmp_path / "incident.tar.gz"
    r = cli("pack", out, "-o", pack)
    assert r.exit_code == 0, r.output
    assert "replica_4: failed (error: " in r.output and "marked incomplete by its detllm.partial" in r.output
    with tarfile.open(pack) as tar:
        assert any(n.endswith("replica_4/detllm.partial") for n in tar.getnames())
    r = cli("verify", pack)
    assert r.exit_code == 0 and "re-derived from the replica folders: FAIL OUTLIER" in r.output, r.output
    assert cli("report", pack).output == (out / "fleet.txt").read_text()


def test_report_kld_reference_refusals(fleet, cli):
    """The blocks themselves are tested on real llama-servers (test_fleet_servers.py)."""
    out, _, _ = fleet
    r = cli("report", out, "--format", "kld", "--reference", "replica_4")
    assert r.exit_code == 2 and "failed in this fleet" in r.output
    r = cli("report", out, "--format", "kld", "--reference", "replica_9")
    assert r.exit_code == 2 and "names no replica of this fleet" in r.output
    r = cli("report", out, "--reference", "replica_1")
    assert r.exit_code == 2 and "--format kld" in r.output


def test_junit_names_carry_the_url(fleet, tmp_path, cli):
    out, _, urls = fleet
    assert cli("report", out, "--junit", tmp_path / "j.xml").exit_code == 0
    names = [c.get("name") for c in ET.parse(tmp_path / "j.xml").getroot().iter("testcase")]
    assert names == [f"replica {i} replica_{i} {u}" for i, u in enumerate(urls)]
    r = cli("diff", out / "replica_0", out / "replica_2")  # a served side's device is not claimed
    assert "openai tiny" in r.output and " cpu " not in r.output and "remote" in r.output


def test_reference_url_judges_the_others_against_it(tmp_path, cli):
    stubs = [_stub(), _stub(), _stub(lp=-0.25)]
    try:
        urls = [s.url for s in stubs]
        out = tmp_path / "ref"
        r = cli("check", "-b", "openai", "-m", "tiny", "--tier", "2", "--max-new-tokens", str(TOKENS), "--prompt", "hello",
                "--no-progress", *[a for u in urls for a in ("--base-url", u)], "--reference-url", urls[2], "--out", out)
        assert r.exit_code == 1, r.output
        doc = json.loads((out / "fleet.json").read_text())
        assert doc["reference"] == {"replica": 2, "used": True} and doc["outliers"] == [0, 1]
        assert doc["majority"]["replicas"] == [2] and "reference: replica 2" in r.output
        assert cli("verify", out).exit_code == 0  # re-derived with the same reference
        r = cli("check", "-b", "openai", "-m", "tiny", "--prompt", "hello", "--no-progress", "--base-url", urls[0],
                "--base-url", urls[1], "--reference-url", "http://127.0.0.1:9/v1", "--out", tmp_path / "bad")
        assert r.exit_code == 2 and "is not one of the --base-url" in r.output and not (tmp_path / "bad").exists()
    finally:
        for s in stubs:
            s.close()


def test_a_hung_endpoint_is_a_timeout_within_request_timeout(tmp_path):
    hung, good = Hung(), _stub()
    try:
        with pytest.raises(detllm.DetllmError) as exc:  # one endpoint: the same error, exit 4, nothing written
            detllm.check(_cfg(base_url=hung.url), prompts=["hello"], out=tmp_path / "one")
        assert exc.value.exit_code == 4 and "did not answer within 2 s" in exc.value.message and "cannot connect" not in exc.value.message
        assert not (tmp_path / "one").exists()
        doc = detllm.fleet_check(_cfg(), [good.url, hung.url], prompts=["hello"], out=tmp_path / "f").report
        err = doc["replicas"][1]["error"]
        assert (err["kind"], doc["category"]) == ("timeout", "ENDPOINT_ERROR")
        assert "did not answer within 2 s" in err["message"]  # request_timeout, not the probe's own 10 s
    finally:
        hung.close()
        good.close()


def test_no_endpoint_answering_writes_nothing_and_exits_4(tmp_path, cli):
    hung = Hung()
    try:
        out = tmp_path / "f0"
        r = cli("check", "-b", "openai", "-m", "tiny", "--prompt", "hello", "--no-progress", "--opt", "request_timeout=2",
                "--base-url", _dead_url(), "--base-url", _dead_url(), "--base-url", hung.url, "--out", out)
        assert r.exit_code == 4, r.output
        assert "no endpoint of the fleet answered its first probe" in r.output and "nothing was written" in r.output
        assert not out.exists()
    finally:
        hung.close()


def test_exit_8_when_no_replica_produced_a_verdict(tmp_path):
    broken = _stub(fail_runs=True)
    try:
        outcome = detllm.fleet_check(_cfg(), [broken.url, _dead_url()], prompts=["hello"], out=tmp_path / "f8")
        assert outcome.exit_code == 8 and outcome.category == "ENDPOINT_ERROR"
        kinds = [r["error"]["kind"] for r in outcome.report["replicas"]]
        assert kinds == ["error", "unreachable"]
        assert (tmp_path / "f8" / "manifest.json").is_file() and (tmp_path / "f8" / "replica_0" / "detllm.partial").exists()
        assert not (tmp_path / "f8" / "replica_1").exists()
    finally:
        broken.close()


def test_verify_re_derives_an_nway_diff_folder_from_its_sides(tmp_path, cli):
    f = tmp_path / "c"
    detllm.check(backend="fake", model="tiny", runs=3, tier=2, max_new_tokens=8, options={"diverge": "prompt=1,pos=3,run=1"}, out=f)
    out = tmp_path / "nway"
    assert cli("diff", f"{f}::run_0", f"{f}::run_1", f"{f}::run_2", "--out", out).exit_code == 1
    r = cli("verify", out)
    assert r.exit_code == 0 and "fleet verdict re-derived from the sides it names: FAIL OUTLIER" in r.output, r.output
    doc = json.loads((out / "fleet.json").read_text())
    doc.update(outliers=[], category="NO_MAJORITY")
    (out / "fleet.json").write_text(json.dumps(doc))
    seal_fleet(out)
    r = cli("verify", out)
    assert r.exit_code == 6 and "fleet.json: category is 'NO_MAJORITY', but the replicas give 'OUTLIER'" in r.output, r.output
    shutil.rmtree(f)  # the sides are gone: said plainly, not claimed
    r = cli("verify", out)
    assert r.exit_code == 0 and "not re-derived: side" in r.output and "is not at hand here" in r.output, r.output


def test_nway_diff_folder_sides_read_beside_it_and_kld(tmp_path, cli, monkeypatch):
    """Sides given to diff by relative paths are found beside the diff folder when verify and
    report run elsewhere; report --format kld of the N-way folder measures each side against run 0."""
    monkeypatch.chdir(tmp_path)
    detllm.check(backend="fake", model="tiny", runs=3, tier=2, max_new_tokens=8, options={"diverge": "prompt=1,pos=3,run=1"}, out="c")
    assert cli("diff", "c::run_0", "c::run_1", "c::run_2", "--out", "nway").exit_code == 1
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    r = cli("verify", tmp_path / "nway")
    assert r.exit_code == 0 and "re-derived from the sides it names: FAIL OUTLIER" in r.output, r.output
    r = cli("report", tmp_path / "nway", "--format", "kld")
    assert r.exit_code == 0, r.output
    assert "against the reference, replica 0 c::run_0@batch_1" in r.output
    assert [b.split()[0] for b in r.output.split("== replica ")[1:]] == ["1", "2"]


def test_an_earlier_fleet_json_is_not_re_derived_and_says_so(fleet, tmp_path, cli):
    out, _, _ = fleet
    copy = tmp_path / "old"
    shutil.copytree(out, copy)
    doc = json.loads((copy / "fleet.json").read_text())
    del doc["grouping"]
    (copy / "fleet.json").write_text(json.dumps(doc))
    seal_fleet(copy)
    r = cli("verify", copy)
    assert r.exit_code == 0 and "the fleet verdict is as sealed, not re-derived (written by a detllm that grouped" in r.output


def test_a_failed_reference_falls_back_to_the_majority(tmp_path):
    stubs = [_stub(), _stub()]
    try:
        dead = _dead_url()
        doc = detllm.fleet_check(_cfg(), [stubs[0].url, stubs[1].url, dead], prompts=["hello"], out=tmp_path / "f",
                                 reference_url=dead).report
        assert doc["reference"] == {"replica": 2, "used": False}
        assert (doc["category"], doc["majority"]["replicas"], doc["outliers"]) == ("ENDPOINT_ERROR", [0, 1], [])
        assert "reference: replica 2 failed: judged by the majority instead" in (tmp_path / "f" / "fleet.txt").read_text()
    finally:
        for s in stubs:
            s.close()
