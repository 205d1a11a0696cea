"""`sweep --ray ADDRESS`: every cell of the grid as a Ray task at once (max_retries=0, num_cpus 1,
num_gpus = TP x PP on cuda), all pinned to one node, so that what differs between cells is the
axis and never the node; each cell's sealed folder comes back packed and is unpacked and verified
where the sweep expects it. The grid and its judging stay diagnose/sweep.py's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..core.config import RunConfig
from ..core.errors import ArtifactError, IntegrityError, UsageError
from .connect import connect, disconnect, resolve_address
from .driver import NUM_CPUS, task_gpus, unpack, wait_all
from .task import local_build, run_cell

Cells = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


def pick_node(nodes: list[dict[str, Any]], cpus: float, gpus: float) -> str:
    """The alive node with the most CPUs (then GPUs) that can hold one cell; ties by node id."""
    fit = [n for n in nodes if n.get("Alive") and n["Resources"].get("CPU", 0) >= cpus and n["Resources"].get("GPU", 0) >= gpus]
    if not fit:
        raise UsageError(f"no alive node of the cluster has {cpus:g} CPU and {gpus:g} GPU for a cell")
    return min(fit, key=lambda n: (-n["Resources"].get("CPU", 0), -n["Resources"].get("GPU", 0), n["NodeID"]))["NodeID"]


@contextlib.contextmanager
def ray_cells(address: str) -> Iterator[Cells]:
    """Connected to the cluster (exit 4 when unreachable, before the sweep writes anything), a
    runner for diagnose.sweep(run_cells=...); disconnects on exit."""
    ray, owned = connect(resolve_address(address))
    try:
        yield lambda jobs: _run(ray, jobs)
    finally:
        disconnect(ray, owned)


def _run(ray: Any, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    gpus = [task_gpus(RunConfig.from_json(j["config"])) for j in jobs]
    node = pick_node(ray.nodes(), NUM_CPUS, max(gpus))
    remote = ray.remote(max_retries=0, max_calls=1)(run_cell)
    build = local_build()
    prompts = {j["prompts"]: Path(j["prompts"]).read_text(encoding="utf-8") for j in jobs}
    refs = [remote.options(num_cpus=NUM_CPUS, num_gpus=g, name=f"detllm-cell-{i}",
                           scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(j, prompts[j["prompts"]], build)
            for i, (j, g) in enumerate(zip(jobs, gpus))]
    answers = wait_all(ray, refs)
    results = []
    for job, ans in zip(jobs, answers):
        if "ray_error" in ans:  # Ray failed the task: its node died, its worker crashed
            ans = {"ok": False, "error": ans["ray_error"]["message"], "exit_code": ans["ray_error"]["exit_code"], "seconds": 0.0}
        elif ans.get("pack") is not None:
            try:
                unpack(ans.pop("pack"), Path(job["out"]))
            except (ArtifactError, IntegrityError) as exc:
                ans = {"ok": False, "error": f"its packed folder did not verify: {exc.one_line()}", "exit_code": exc.exit_code, "seconds": 0.0}
        results.append(ans)
    return results


__all__ = ["Cells", "pick_node", "ray_cells"]
