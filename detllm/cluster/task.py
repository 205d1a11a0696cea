"""What runs on a node: the Ray task of one replica. It checks that the node runs the driver's detllm
(version and a digest of its installed files), records where Ray placed it (node id, IP, accelerator
type, the variables Ray sets) as env.json's volatile placement, runs the ordinary check into a
private temporary folder and returns that sealed folder packed (bytes through the object store).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from ..commands.pack import create_pack
from ..core.config import RunConfig
from ..core.errors import DetllmError
from ..core.prompts import PromptSet
from ..pipeline.runner import execute
from ..runfolder.env import REDACTED, SECRET_NAME, SECRET_VALUE, Redaction, detllm_version, record_placement
from ..runfolder.schema_io import schema_dir
from .shipping import land
from .targets import accelerator_of

RAY_SET = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")  # set per task by Ray (num_gpus, num_cpus), with RAY_*
HOLD_LIMIT_S = 300.0  # the test-only hold gives up after this long and goes on


def local_build() -> dict[str, str]:
    """This installation's detllm: its version and a sha256 over its installed files (the package's
    .py files and the schemas it validates with), so two nodes with one version but other bits differ."""
    pkg = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for root in (pkg, schema_dir()):
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".json") and "__pycache__" not in p.parts):
            h.update(f"{path.relative_to(root).as_posix()}\0".encode())
            h.update(hashlib.sha256(path.read_bytes()).digest())
    return {"version": detllm_version(), "sha256": h.hexdigest()}


def build_mismatch(here: dict[str, str], driver: dict[str, str]) -> str | None:
    """The one line a replica fails with when this node's detllm is not the driver's; None when it is."""
    if here == driver:
        return None
    if here["version"] != driver["version"]:
        return f"node has detllm {here['version']}, driver {driver['version']}"
    return (f"node has detllm {here['version']} with other installed files (sha256 {here['sha256'][:12]}), "
            f"driver {driver['version']} (sha256 {driver['sha256'][:12]})")


def placement_here(ray: Any) -> dict[str, Any]:
    """Where Ray placed this task (env.json volatile.placement: recorded, never compared)."""
    ctx = ray.get_runtime_context()
    node_id = ctx.get_node_id()
    resources = next((n.get("Resources", {}) for n in ray.nodes() if n.get("NodeID") == node_id), {})
    env = {k: v for k, v in os.environ.items() if k in RAY_SET or k.startswith("RAY_")}
    env = {k: (REDACTED if SECRET_NAME.search(k) or SECRET_VALUE.search(v) else v) for k, v in sorted(env.items())}
    return {"scheduler": "ray", "node_id": node_id, "node_ip": ray.util.get_node_ip_address(),
            "accelerator_type": accelerator_of(resources), "resources": {k: float(v) for k, v in sorted(resources.items())},
            "env_vars": env}


def _hold(hold: tuple[str, str] | None, node_id: str) -> None:
    """Test-only (docs/ray.md): the task on the node whose id starts with hold[0] writes
    hold[1]/started (its pid) and waits until hold[1]/release exists, so a test can act on a task
    known to be running (remove its node, interrupt the driver) without timing luck."""
    if hold is None or not node_id.startswith(hold[0]):
        return
    folder = Path(hold[1])
    (folder / "started.tmp").write_text(str(os.getpid()))
    os.replace(folder / "started.tmp", folder / "started")
    end = time.monotonic() + HOLD_LIMIT_S
    while not (folder / "release").exists() and time.monotonic() < end:
        time.sleep(0.2)


def run_replica(config: RunConfig, prompt_set: PromptSet, driver_build: dict[str, str], redaction: Redaction | None = None,
                hold: tuple[str, str] | None = None, shipped_files: dict[str, bytes] | None = None,
                shipped_digest: str | None = None) -> dict[str, Any]:
    """The task body: {"pack": bytes of the sealed run folder's .tar.gz or None, "error": the fleet's
    error record or None, "placement": where it ran}. A failed check is an answer, not a Ray error.
    `shipped_files`, `shipped_digest`: the model folder (--ship-model), landed here and used as the model
    (two arguments: Ray resolves an object reference given as an argument of its own, not one in a tuple)."""
    import ray

    placement = placement_here(ray)
    if (why := build_mismatch(local_build(), driver_build)) is not None:
        return {"pack": None, "placement": placement, "error": {"kind": "error", "exit_code": 2, "message": why}}
    if shipped_files is not None and shipped_digest is not None:
        try:
            config = dataclasses.replace(config, model=str(land(shipped_files, shipped_digest)))
        except (OSError, ValueError) as exc:
            return {"pack": None, "placement": placement, "error": {"kind": "error", "exit_code": 7, "message": str(exc)}}
    _hold(hold, placement["node_id"])
    record_placement(placement)
    tmp = Path(tempfile.mkdtemp(prefix="detllm-ray-"))
    try:
        execute(config, command="check", out=tmp / "replica", prompt_set=prompt_set, redaction=redaction)
        pack = create_pack(tmp / "replica", tmp / "replica.tar.gz")
        return {"pack": pack.read_bytes(), "placement": placement, "error": None}
    except DetllmError as exc:
        return {"pack": None, "placement": placement, "error": {"kind": "error", "exit_code": exc.exit_code, "message": exc.one_line()}}
    finally:
        record_placement(None)
        shutil.rmtree(tmp, ignore_errors=True)





def run_cell(job: dict[str, Any], prompts_jsonl: str, driver_build: dict[str, str]) -> dict[str, Any]:
    """A sweep cell's task body: the probe worker's job (diagnose/worker.run_job) run here into a private
    folder, the prompts file written here from its text; its result with "pack" (the sealed folder's
    .tar.gz bytes, or None) and "placement" added."""
    import ray

    from ..diagnose.worker import run_job

    placement = placement_here(ray)
    if (why := build_mismatch(local_build(), driver_build)) is not None:
        return {"ok": False, "error": why, "exit_code": 2, "pack": None, "placement": placement, "seconds": 0.0}
    record_placement(placement)
    tmp = Path(tempfile.mkdtemp(prefix="detllm-ray-"))
    try:
        (tmp / "prompts.jsonl").write_text(prompts_jsonl, encoding="utf-8")
        body = run_job({**job, "prompts": str(tmp / "prompts.jsonl"), "out": str(tmp / "cell")})
        body["pack"] = create_pack(tmp / "cell", tmp / "cell.tar.gz").read_bytes() if body.get("ok") else None
        return {**body, "placement": placement}
    except DetllmError as exc:
        return {"ok": False, "error": exc.one_line(), "exit_code": exc.exit_code, "pack": None, "placement": placement, "seconds": 0.0}
    finally:
        record_placement(None)
        shutil.rmtree(tmp, ignore_errors=True)
__all__ = ["build_mismatch", "local_build", "placement_here", "run_cell", "run_replica"]
