"""The fleet on real components: four real llama-servers on loopback, one started with `-fa off`
(on tiny: the same tokens, logprobs up to ~3e-3 apart), plus an endpoint nobody listens on and one
that never answers; `check --base-url x6` names the -fa off server as the outlier, the other three
agree, the dead and the slow endpoint are reported and excluded. N-way diff of five real hf folders,
three float32 and two bfloat16, groups them {3}, {2}. The servers die with the module (tested)."""

from __future__ import annotations

import json
import os
import time
import xml.etree.ElementTree as ET
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

import detllm
from detllm.runfolder.artifacts import validate

from .conftest import llama_server_or_fail, write_prompts
from .stubhttp import JSONHandler, StubServer

pytestmark = pytest.mark.engine

PROMPTS = ["The capital of France is", "Once upon a time", "Numbers: 1 2 3"]


def start_llama(binary: Path, extra: list[str], tries: int = 3, ctx: int = 1024):
    """A llama-server on a free loopback port; a port taken between the probe and the bind is retried."""
    from detllm.backends.llamacpp import Server, free_port
    from detllm.core.errors import BackendError
    from detllm.models import builtin_path

    gguf = builtin_path("tiny", "gguf") / "model.gguf"
    for attempt in range(tries):
        port = free_port()
        srv = Server([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", "2", "-c", str(ctx),
                      "--alias", "tiny", "--no-webui", "-t", "1", *extra], port, 60.0)
        try:
            srv.wait_ready(60.0)
            srv.url = f"http://127.0.0.1:{port}/v1"
            return srv
        except BackendError:
            srv.stop()
            if attempt == tries - 1:
                raise


class Slow(JSONHandler):
    """A llama-server look-alike that hangs: it lists model tiny, shows /props and tokenizes, then
    holds every completion longer than the fleet's --opt request_timeout."""

    def do_GET(self):
        if self.path == "/v1/models":
            return self.send_json(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        if self.path == "/props":
            return self.send_json(200, {"build_info": "stub", "total_slots": 1})
        self.send_json(404, {"error": "not found"})

    def do_POST(self):
        if self.path == "/tokenize":
            return self.send_json(200, {"tokens": [1, 2]})
        time.sleep(6)
        self.send_json(500, {"error": "too late"})


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):  # the client gave up on a held request: expected here
        pass


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    binary = llama_server_or_fail()
    servers = []
    slow = StubServer()
    slow.serve(Slow, QuietServer)
    try:
        for i in range(4):
            servers.append(start_llama(binary, ["-fa", "off" if i == 3 else "on"]))
        from detllm.backends.llamacpp import free_port

        dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
        yield servers, dead, slow.url
    finally:
        slow.close()
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def fleet_run(fleet, tmp_path_factory):
    from typer.testing import CliRunner

    from detllm.cli import app

    servers, dead, slow = fleet
    root = tmp_path_factory.mktemp("fleet")
    urls = [s.url for s in servers] + [dead, slow]
    args = ["check", "-b", "openai", "-m", "tiny", "--tier", "2", "--runs", "2", "--max-new-tokens", "8",
            "--opt", "cache_prompt=false", "--opt", "request_timeout=3", "--prompts", str(write_prompts(root / "p.jsonl", PROMPTS)),
            "--out", str(root / "fc"), "--junit", str(root / "fc.xml"), "--html", str(root / "fc.html"), "--json"]
    for u in urls:
        args += ["--base-url", u]
    r = CliRunner().invoke(app, args)
    return r, root


def test_fleet_check_names_the_fa_off_server(fleet_run):
    r, root = fleet_run
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    validate({k: v for k, v in doc.items() if k != "out_dir"}, "fleet")
    assert doc["category"] == "OUTLIER" and doc["outliers"] == [3]
    assert doc["majority"]["replicas"] == [0, 1, 2] and [g["replicas"] for g in doc["groups"]] == [[0, 1, 2], [3]]
    assert len(doc["identity"]["groups"]) == 1  # the servers report the same model, build and props: -fa is not among them
    by = {(p["left"], p["right"]): p for p in doc["pairs"]}
    assert sorted(by) == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]  # each with every member it could join
    assert by[(0, 1)]["status"] == by[(0, 2)]["status"] == by[(1, 2)]["status"] == "PASS"  # the three -fa on servers agree bit for bit
    off = by[(0, 3)]  # -fa off: the same tokens, logprobs a little apart
    assert off["status"] == "FAIL" and off["first_divergence"]["kind"] != "token" and off["magnitude"] == "tokens_equal_logprobs_differ"
    assert 0 < off["max_abs_logprob_diff"] < 1e-2
    assert [r["own_check"]["status"] for r in doc["replicas"][:4]] == ["PASS"] * 4  # each server repeats itself
    expl = doc["explanations"][0]
    assert expl["replicas"] == [3] and expl["causes"] == [] and "not visible to a client" in expl["note"]  # base_url is not a cause
    for i in range(4):
        assert (root / "fc" / f"replica_{i}" / "report.json").is_file()


def test_fleet_check_reports_dead_and_slow_endpoints(fleet_run):
    r, root = fleet_run
    doc = json.loads(r.stdout)
    errors = {e["replica"]: e for e in doc["errors"]}
    assert errors[4]["kind"] == "unreachable" and errors[4]["exit_code"] == 4
    assert errors[5]["kind"] == "timeout" and "within 3 s" in errors[5]["message"]
    assert all(4 not in g["replicas"] and 5 not in g["replicas"] for g in doc["groups"])
    cases = ET.parse(root / "fc.xml").getroot().findall(".//testcase")
    assert len(cases) == 6
    assert [("failure" if c.find("failure") is not None else "error" if c.find("error") is not None else "ok") for c in cases] \
        == ["ok", "ok", "ok", "failure", "error", "error"]
    text = (root / "fc" / "fleet.txt").read_text()
    assert "replica_3    B*   B*   B*" in text and "ERR" in text
    assert "OUTLIER" in (root / "fc.html").read_text()


def test_report_kld_of_each_replica_against_the_majority(fleet_run, cli):
    """`report --format kld FLEET`: llama-perplexity's block per replica against the majority group's
    first member; the -fa off replica's KLD is above the -fa on ones' (0: the same bits); the dead and
    the slow endpoint are listed as not compared. JUnit names carry each replica's URL."""
    _, root = fleet_run
    r = cli("report", root / "fc", "--format", "kld")
    assert r.exit_code == 0, r.output
    assert r.output.startswith("detllm fleet KLD: each replica against the reference, replica 0 replica_0 (http://127.0.0.1:")
    blocks = {b.split()[0]: b for b in r.output.split("== replica ")[1:]}
    assert sorted(blocks) == ["1", "2", "3", "4", "5"]

    def stats(block):  # the statistics, without the header naming the sides
        return block[block.index("Perplexity statistics"):]
    for i in ("1", "2"):  # the same bits as the reference
        assert "Maximum KLD:   0.000000" in blocks[i] and "Same top p: 100.000 ± 0.000 %" in blocks[i], blocks[i]
    assert stats(blocks["3"]) != stats(blocks["1"])  # -fa off: logprobs a little apart
    assert "not compared: it failed (unreachable" in blocks["4"] and "not compared: it failed (timeout" in blocks["5"]
    assert " cpu " not in r.output  # a served replica's device is the remote server's, not claimed
    names = [c.get("name") for c in ET.parse(root / "fc.xml").getroot().iter("testcase")]
    assert all(n.startswith(f"replica {i} replica_{i} http://127.0.0.1:") for i, n in enumerate(names)), names


def test_nway_diff_two_two_names_no_outlier(fleet_run):
    _, root = fleet_run
    fc = root / "fc"
    # two -fa on replicas and the -fa off replica twice (its run 1 repeats its run 0): 2-2 on every prompt
    doc = detllm_fleet_diff([fc / "replica_0", fc / "replica_1", fc / "replica_3", f"{fc / 'replica_3'}::run_1"])
    assert doc["category"] == "NO_MAJORITY" and doc["outliers"] == [] and doc["majority"] is None
    assert [g["replicas"] for g in doc["groups"]] == [[0, 1], [2, 3]]


def detllm_fleet_diff(sides):
    from detllm.fleet.nway import fleet_diff

    return fleet_diff(sides).report


def _check(urls, out, *extra, cache=("--opt", "cache_prompt=false")):
    from typer.testing import CliRunner

    from detllm.cli import app

    args = ["check", "-b", "openai", "-m", "tiny", "--tier", "2", "--runs", "2", "--max-new-tokens", "6", *cache,
            "--prompt", PROMPTS[0] + f" {out.name}", "--prompt", PROMPTS[1] + f" {out.name}", "--out", str(out), "--json", *extra]
    for u in urls:
        args += ["--base-url", u]
    r = CliRunner().invoke(app, args)
    return r.exit_code, json.loads(r.stdout)


def test_fleet_check_of_agreeing_servers_passes(fleet, tmp_path):
    servers, _, _ = fleet
    code, doc = _check([s.url for s in servers[:3]], tmp_path / "ok")
    assert (code, doc["status"], doc["category"]) == (0, "PASS", "AGREE")
    assert [g["replicas"] for g in doc["groups"]] == [[0, 1, 2]] and doc["outliers"] == [] and not doc["errors"]


def test_replicas_that_agree_but_move_with_their_cache(fleet, tmp_path):
    servers, _, _ = fleet
    code, doc = _check([s.url for s in servers[:2]], tmp_path / "cache", cache=("--cache-probe",))  # cold, warm, after a prefix
    assert code == 1 and doc["category"] == "AGREE_BUT_VARIANT" and doc["outliers"] == []
    assert [g["replicas"] for g in doc["groups"]] == [[0, 1]]  # the cold answers agree across replicas
    assert {v["category"] for v in doc["variance"]} == {"CACHE_VARIANCE"}  # each one's warm answers move


def test_identity_mismatch_from_server_props(fleet, tmp_path):
    servers, _, _ = fleet
    other = start_llama(llama_server_or_fail(), [], ctx=512)  # half the context per slot: /props n_ctx differs
    try:
        code, doc = _check([servers[0].url, servers[1].url, other.url], tmp_path / "id")
    finally:
        other.stop()
    assert code == 1 and doc["category"] == "IDENTITY_MISMATCH" and doc["identity"]["mismatched"] == [2]
    fields = {d["field"]: (d["reference"], d["value"]) for d in doc["identity"]["differences"]}
    assert fields["engine.props.n_ctx"] == (512, 256)
    assert doc["replicas"][2]["identity_mismatch"] and not doc["replicas"][0]["identity_mismatch"]


def test_servers_die_with_the_module(fleet):
    servers, _, _ = fleet
    pids = [s.pid for s in servers]
    for s in servers:
        s.stop()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_nway_diff_groups_dtypes_three_two(tmp_path, cli):
    sides = []
    for i, dtype in enumerate(["float32", "bfloat16", "float32", "bfloat16", "float32"]):
        detllm.run(model="tiny", prompts=PROMPTS[:2], tier=2, dtype=dtype, max_new_tokens=6, out=tmp_path / f"hf{i}")
        sides.append(tmp_path / f"hf{i}")
    r = cli("diff", *sides, "--out", tmp_path / "nway")
    assert r.exit_code == 1, r.output
    doc = json.loads((tmp_path / "nway" / "fleet.json").read_text())
    assert [g["replicas"] for g in doc["groups"]] == [[0, 2, 4], [1, 3]]
    assert doc["category"] == "IDENTITY_MISMATCH" and doc["identity"]["mismatched"] == [1, 3]
    assert any(d["field"] == "config.dtype" and d["value"] == "bfloat16" for d in doc["identity"]["differences"])
    assert doc["outliers"] == [1, 3]
