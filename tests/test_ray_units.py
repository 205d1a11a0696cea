"""The parts of `check --ray` that need no cluster: what the targets of --per are over a node table,
the build check's one line, and the usage errors refused before anything is written (exit 2). The
cluster itself: tests/test_ray.py."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from detllm.cli import app
from detllm.cluster.connect import import_ray, resolve_address
from detllm.cluster.targets import plan
from detllm.cluster.task import build_mismatch, local_build
from detllm.core.errors import UsageError


def node(nid: str, **res: float) -> dict:
    return {"NodeID": nid, "Alive": True, "NodeManagerAddress": "10.0.0." + nid[-1], "Resources": {"CPU": 1.0, **res}}


NODES = [node("n1", **{"accelerator_type:A100": 0.001, "rack:r1": 1}), node("n2", **{"accelerator_type:A100": 0.001, "rack:r2": 1}),
         node("n3", **{"accelerator_type:H100": 0.001, "rack:r2": 1, "fast": 1}), {**node("n4"), "Alive": False}]


def test_targets_per_node_type_and_resource():
    assert [t.node_id for t in plan(NODES, "node", 1)] == ["n1", "n2", "n3"], "alive nodes only, pinned by id"
    assert [(t.label, t.node_id, t.resources) for t in plan(NODES, "accelerator_type", 1)] == [
        ("accelerator_type:A100", None, {"accelerator_type:A100": 0.001}), ("accelerator_type:H100", None, {"accelerator_type:H100": 0.001})]
    assert [t.label for t in plan(NODES, "resource:rack", 1)] == ["rack:r1", "rack:r2"]
    with pytest.raises(UsageError, match="finds 1 target"):
        plan(NODES, "resource:fast", 1)  # one node holds it: nothing to compare
    with pytest.raises(UsageError, match="finds 0 target"):
        plan(NODES, "node", 2)  # no node has 2 CPUs to give
    with pytest.raises(UsageError, match="0 target"):
        plan(NODES, "node", 1, 2)  # a TP=2 task on cuda: no node has 2 GPUs, none is left pending forever
    with pytest.raises(UsageError, match="--per must be"):
        plan(NODES, "gpu", 1)


def test_a_node_with_another_detllm_fails_with_one_line():
    here = local_build()
    assert here == local_build() and len(here["sha256"]) == 64
    assert build_mismatch(here, dict(here)) is None
    assert build_mismatch({**here, "version": "0.1.9"}, here) == f"node has detllm 0.1.9, driver {here['version']}"
    assert "with other installed files" in build_mismatch({**here, "sha256": "0" * 64}, here)


def test_addresses(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(UsageError, match="reads RAY_ADDRESS"):
        resolve_address("auto")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert resolve_address("auto") == "10.0.0.1:6379"
    with pytest.raises(UsageError, match="Ray Client address"):
        resolve_address("ray://h:10001")
    with pytest.raises(UsageError, match="HOST:PORT"):
        resolve_address("headnode")


def test_missing_ray_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(UsageError, match="not installed") as err:
        import_ray()
    assert "detllm[ray]" in err.value.one_line()


@pytest.mark.parametrize("args, text", [
    (["check", "--ray", "127.0.0.1:1", "--per", "gpu"], "--per must be node, accelerator_type or resource:NAME"),
    (["run", "--ray", "127.0.0.1:1"], "use `detllm check`"),
    (["check", "--backend", "openai", "--base-url", "http://h/v1", "--ray", "127.0.0.1:1"], "--base-url names endpoints"),
    (["check", "--ray", "ray://h:10001"], "Ray Client address"),
    (["check", "--per", "accelerator_type"], "give --ray ADDRESS too"),
    (["check", "--ship-model"], "give --ray ADDRESS too"),
    (["check", "--ray", "127.0.0.1:1", "--ship-model"], "--ship-model sends a model folder"),
])
def test_usage_errors_before_anything_is_written(args, text, tmp_path):
    res = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "o"), "--prompt", "hi"])
    assert res.exit_code == 2 and text in res.output and "Traceback" not in res.output
    assert not (tmp_path / "o").exists()


def test_a_shipped_model_lands_once_and_is_checked(tmp_path):
    from detllm.cluster.shipping import land, read_model

    (tmp_path / "m" / "sub").mkdir(parents=True)
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "m" / "sub" / "w.bin").write_bytes(b"\x00\x01")
    files, digest = read_model(str(tmp_path / "m"))
    dest = land(files, digest)
    assert dest.name == digest[:16] and (dest / "sub" / "w.bin").read_bytes() == b"\x00\x01"
    assert land(files, digest) == dest, "a second task of the node finds it landed"
    (dest / "config.json").write_text('{"changed": 1}')
    with pytest.raises(ValueError, match="arrived changed"):
        land(files, digest)
    import shutil

    shutil.rmtree(dest)


def test_a_probe_task_ray_failed_is_a_failed_job_with_rays_reason(monkeypatch, tmp_path):
    """diagnose --ray (cluster/probes.py): a task Ray fails comes back as the probe worker's failed result,
    which ProbeRunner records as the probe's error (the node-death itself: tests/test_ray.py, for check)."""
    pytest.importorskip("ray")
    from detllm.api import make_config
    from detllm.cluster import probes
    from detllm.cluster.driver import ray_error

    class Remote:
        def options(self, **kw):
            assert kw["num_cpus"] == 1.0 and kw["scheduling_strategy"].node_id == nid and not kw["scheduling_strategy"].soft
            return self

        def remote(self, *args):
            return "ref"

    class Ray:
        def nodes(self):
            return [node(nid), {**node("f" * 56), "Alive": False}]

        def remote(self, **kw):
            assert kw == {"max_retries": 0, "max_calls": 1}
            return lambda fn: Remote()

    nid = "a" * 56  # a real node id's length: Ray's strategy checks it
    died = RuntimeError("Task failed because the node it was running on is dead or unavailable.")
    monkeypatch.setattr(probes, "wait_all", lambda ray, refs: [{"ray_error": ray_error(died)}])
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    job = {"kind": "check", "config": make_config(backend="fake", model="fake").to_json(), "prompts": str(tmp_path / "p.jsonl"),
           "out": str(tmp_path / "o")}
    res = probes.RayPool(Ray()).shared().run(job)
    assert res["ok"] is False and res["error"] == "ray: RuntimeError: Task failed because the node it was running on is dead or unavailable."
    assert res["exit_code"] == 8 and not (tmp_path / "o").exists()
