"""`diagnose --ray ADDRESS`: diagnose's probe jobs (diagnose/worker.py) as Ray tasks instead of local
worker processes. A `RayPool` stands in for diagnose/pool.Pool: every job is a task (max_retries=0,
num_cpus 1, its own worker process) pinned to one node, so only the probe's knob differs between
probes; what a job reads (the prompts, an earlier folder) travels packed with it, what it writes comes
back packed and is unpacked and seal-verified where the local job would have written it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..core.config import RunConfig
from ..core.errors import ArtifactError, DetllmError, IntegrityError
from .cells import pick_node
from .connect import connect, disconnect, resolve_address
from .driver import NUM_CPUS, task_gpus, unpack, wait_all

PATHS = ("out", "folder")  # the result fields that name the folder a job wrote (check/run: out; layers: folder)


class RayPool:
    """diagnose/pool.Pool's interface (shared().run(job), fresh(job, env), close) on a Ray cluster.
    The local shared worker keeps the engine loaded between jobs; here every job is a fresh process on
    the pinned node (a task of its own), so shared and fresh jobs differ only in cost."""

    def __init__(self, ray: Any, scratch: Path | None = None, hold: tuple[str, str] | None = None) -> None:
        """`hold` is test-only (task._hold): each job on that node waits on the marker folder."""
        from .task import local_build

        self.ray, self.hold = ray, hold
        self.node: str | None = None
        self.build = local_build()
        # max_calls=1: each job in a fresh worker process (torch's thread and kernel state are per process)
        self.remote = ray.remote(max_retries=0, max_calls=1)(run_probe_job)
        self.jobs = 0

    def shared(self) -> "RayPool":
        return self

    def run(self, job: dict[str, Any]) -> dict[str, Any]:
        return self._submit(job, None)

    def fresh(self, job: dict[str, Any], env: dict[str, str | None] | None = None) -> dict[str, Any]:
        return self._submit(job, env)

    def close(self, kill: bool = False) -> None:
        """Nothing stays running between jobs; a job still running at Ctrl-C was cancelled by wait_all."""

    def __enter__(self) -> "RayPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, job: dict[str, Any], env: dict[str, str | None] | None) -> dict[str, Any]:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        gpus = task_gpus(RunConfig.from_json(job["config"]))
        if self.node is None:  # chosen once: every probe on the node the baseline ran on
            self.node = pick_node(self.ray.nodes(), NUM_CPUS, gpus)
        prompts = Path(job["prompts"]).read_text(encoding="utf-8") if job.get("prompts") else None
        try:
            folder = _packed(Path(job["folder"])) if job.get("folder") else None
        except DetllmError as exc:  # the earlier folder does not verify: the probe fails, the diagnosis goes on
            return {"ok": False, "error": f"cannot send {job['folder']} to the node: {exc.one_line()}", "exit_code": exc.exit_code,
                    "seconds": 0.0}
        self.jobs += 1
        ref = self.remote.options(num_cpus=NUM_CPUS, num_gpus=gpus, name=f"detllm-probe-{self.jobs}-{job['kind']}",
                                  scheduling_strategy=NodeAffinitySchedulingStrategy(self.node, soft=False)
                                  ).remote(job, prompts, folder, env, self.build, self.hold)
        (ans,) = wait_all(self.ray, [ref])
        if "ray_error" in ans:  # Ray failed the task (its node died, its worker crashed): Ray's reason
            return {"ok": False, "error": ans["ray_error"]["message"], "exit_code": ans["ray_error"]["exit_code"], "seconds": 0.0}
        pack = ans.pop("pack", None)
        if pack is not None:
            try:
                unpack(pack, Path(job["out"]))
            except (ArtifactError, IntegrityError) as exc:
                return {"ok": False, "error": f"its packed folder did not verify: {exc.one_line()}", "exit_code": exc.exit_code,
                        "seconds": 0.0}
            for key in PATHS:  # the node's private folder → where the driver unpacked it
                if key in ans:
                    ans[key] = job["out"]
        return ans


def _packed(folder: Path) -> bytes:
    """An earlier sealed folder (layers: the failing check), packed to travel with the job."""
    from ..commands.pack import create_pack

    with tempfile.TemporaryDirectory(prefix="detllm-ray-") as tmp:
        return create_pack(folder, Path(tmp) / "in.tar.gz").read_bytes()


@contextlib.contextmanager
def ray_pools(address: str, hold: tuple[str, str] | None = None) -> Iterator[Callable[[Path], RayPool]]:
    """Connected to the cluster (exit 4 when unreachable, before diagnose writes anything), a pool
    factory for diagnose(pool_factory=...); disconnects on exit."""
    ray, owned = connect(resolve_address(address))
    try:
        yield lambda scratch: RayPool(ray, scratch, hold)
    finally:
        disconnect(ray, owned)


def run_probe_job(job: dict[str, Any], prompts_jsonl: str | None, folder_pack: bytes | None, env: dict[str, str | None] | None,
                  driver_build: dict[str, str], hold: tuple[str, str] | None = None) -> dict[str, Any]:
    """The task body: the probe worker's job (diagnose/worker.run_job) run here in a private folder,
    with `env` applied before the engine is imported; its result with "pack" (the written folder's
    .tar.gz bytes, or None) and "placement" added."""
    import ray

    from ..commands.pack import create_pack
    from ..diagnose.worker import run_job
    from ..runfolder.archive import extract
    from ..runfolder.env import record_placement
    from .task import _hold, build_mismatch, local_build, placement_here

    placement = placement_here(ray)
    failed = {"ok": False, "pack": None, "placement": placement, "seconds": 0.0}
    if (why := build_mismatch(local_build(), driver_build)) is not None:
        return {**failed, "error": why, "exit_code": 2}
    if env:
        if "torch" in sys.modules:  # a variable read at import would not take effect: say so, do not run
            return {**failed, "error": "the Ray worker had imported torch before the probe's environment could be set", "exit_code": 8}
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    _hold(hold, placement["node_id"])
    record_placement(placement)
    tmp = Path(tempfile.mkdtemp(prefix="detllm-ray-"))
    try:
        job = dict(job)
        if prompts_jsonl is not None:
            (tmp / "prompts.jsonl").write_text(prompts_jsonl, encoding="utf-8")
            job["prompts"] = str(tmp / "prompts.jsonl")
        if folder_pack is not None:
            (tmp / "in.tar.gz").write_bytes(folder_pack)
            (tmp / "in").mkdir()
            job["folder"] = str(extract(tmp / "in.tar.gz", tmp / "in"))
        if "out" in job:
            job["out"] = str(tmp / "out")
        body = run_job(job)
        wrote = body.get("ok") and "out" in job and (tmp / "out").is_dir()
        body["pack"] = create_pack(tmp / "out", tmp / "out.tar.gz").read_bytes() if wrote else None
        return {**body, "placement": placement}
    except DetllmError as exc:
        return {**failed, "error": exc.one_line(), "exit_code": exc.exit_code}
    finally:
        record_placement(None)
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["RayPool", "ray_pools", "run_probe_job"]
