"""The driver of `check --ray ADDRESS --per …`: one Ray task per target (targets.py), each with a fixed
num_cpus, max_retries=0 and pinned by node id (hard) or by resource; waits for them (Ctrl-C cancels
every task), unpacks each returned pack into OUT/replica_<i>/, verifies its seal, and writes the
fleet folder with the fleet's N-way verdict. A task that Ray fails (node died, worker crashed) is a
replica marked failed with Ray's reason; the others are judged.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..commands.diff import Selection, load_sides
from ..commands.fleetverdict import Replica, fleet_verdict, own_check, prompt_keys
from ..commands.verify import verify_folder
from ..core.config import RunConfig
from ..core.errors import ArtifactError, BackendError, IntegrityError, UsageError
from ..core.prompts import PromptSet, resolve_prompts
from ..fleet.folder import REPLICA, FleetOutcome, check_fleet_out, prepare_fleet_out, write_fleet
from ..runfolder.archive import extract
from ..runfolder.artifacts import default_out_dir, read_json
from ..runfolder.env import Redaction
from ..runfolder.fleetseal import begin_fleet, seal_fleet
from .connect import connect, disconnect, resolve_address
from .shipping import read_model
from .targets import Target, parse_per, plan
from .task import local_build, run_replica

NUM_CPUS = 1.0  # what each task requests, so every replica gets the same OMP_NUM_THREADS from Ray


def task_gpus(config: RunConfig) -> float:
    """GPUs a replica's task requests: TP x PP for an engine on cuda, else none."""
    if config.device != "cuda":
        return 0
    opts = dict(config.options)
    return float(int(opts.get("tensor_parallel_size", 1)) * int(opts.get("pipeline_parallel_size", 1)))


def ray_check(config: RunConfig, address: str, *, per: str = "node", prompts: Any = None, prompt_set: PromptSet | None = None,
              out: str | Path | None = None, atol: float | None = None, tier: int | None = None, redact: bool = False,
              redact_env_vars: Sequence[str] | None = None, num_cpus: float = NUM_CPUS,
              hold: tuple[str, str] | None = None, ship_model: bool = False) -> FleetOutcome:
    """The same check once per target of `per` on the Ray cluster at `address`, one N-way verdict in
    `out` (a fleet folder). Bad input is refused (exit 2) and an unreachable cluster is exit 4, both
    before anything is written. `ship_model`: send the model folder to every node by content hash
    (shipping.py) instead of each node reading its own path or hub id. `hold` is test-only (task._hold)."""
    if config.backend == "openai":
        raise UsageError("--ray runs the engine on the cluster's nodes; --backend openai checks endpoints",
                         hint="for running servers give several --base-url (docs/fleet.md)")
    parse_per(per)
    config.validate(command="check")
    prompt_set = prompt_set or resolve_prompts(prompts)
    out = Path(out) if out is not None else default_out_dir("fleet")
    check_fleet_out(out)
    names = tuple(redact_env_vars or ())
    redaction = Redaction(all_vars=bool(redact), names=names) if redact or names else None
    files = read_model(config.model) if ship_model else None
    ray, owned = connect(resolve_address(address))
    try:
        targets = plan(ray.nodes(), per, num_cpus, task_gpus(config))
        shipped = None if files is None else (ray.put(files[0]), files[1])  # one copy in the object store, fetched by each node
        results = _run(ray, targets, config, prompt_set, redaction, num_cpus, hold, shipped)
        return _write(out, targets, results, config, atol, tier)
    finally:
        disconnect(ray, owned)


def _run(ray: Any, targets: list[Target], config: RunConfig, prompt_set: PromptSet, redaction: Redaction | None,
         num_cpus: float, hold: tuple[str, str] | None, shipped: tuple[Any, str] | None = None) -> list[dict[str, Any]]:
    """Submit one task per target and wait for all; each task's answer, or its Ray failure as an error."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # max_calls=1: each task in a fresh worker process (torch's thread and kernel state are per process)
    remote = ray.remote(max_retries=0, max_calls=1)(run_replica)
    build = local_build()
    refs = [remote.options(num_cpus=num_cpus, num_gpus=task_gpus(config), resources=dict(t.resources),
                           scheduling_strategy=NodeAffinitySchedulingStrategy(t.node_id, soft=False) if t.node_id else "DEFAULT",
                           name=f"detllm-check-{i}").remote(config, prompt_set, build, redaction, hold,
                                                                   shipped[0] if shipped else None, shipped[1] if shipped else None)
            for i, t in enumerate(targets)]
    return [ans if "ray_error" not in ans else {"pack": None, "placement": None, "error": ans["ray_error"]}
            for ans in wait_all(ray, refs)]


def wait_all(ray: Any, refs: list[Any]) -> list[dict[str, Any]]:
    """Every task's answer, in order; a task Ray failed is {"ray_error": its error record}. Ctrl-C
    cancels every task (force: its worker is killed) and goes on to the caller."""
    pending = list(refs)
    try:
        while pending:  # a timed wait, so Ctrl-C is seen at once
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
    except KeyboardInterrupt:
        for ref in refs:
            ray.cancel(ref, force=True)
        raise
    results = []
    for ref in refs:
        try:
            results.append(ray.get(ref))
        except ray.exceptions.RayError as exc:
            results.append({"ray_error": ray_error(exc)})
    return results


def ray_error(exc: BaseException) -> dict[str, Any]:
    """A task Ray failed (its node died, its worker crashed, it could not be scheduled): Ray's reason."""
    text = " ".join(str(exc).split())
    return {"kind": "error", "exit_code": BackendError.exit_code, "message": f"ray: {type(exc).__name__}: {text[:400]}"}


def _source(target: Target, placement: dict[str, Any] | None) -> str:
    if placement is None or target.node_id is not None:
        return f"ray {target.label}"
    return f"ray {target.label} on node {placement['node_id'][:12]} {placement['node_ip']}"


def unpack(pack: bytes, dest: Path) -> None:
    """The replica's pack into `dest` (a new folder), its seal verified there."""
    with tempfile.TemporaryDirectory(prefix="detllm-ray-") as tmp:
        archive = Path(tmp) / "replica.tar.gz"
        archive.write_bytes(pack)
        (Path(tmp) / "x").mkdir()
        shutil.move(str(extract(archive, Path(tmp) / "x")), str(dest))
    verify_folder(dest)


def _write(out: Path, targets: list[Target], results: list[dict[str, Any]], config: RunConfig, atol: float | None,
           tier: int | None) -> FleetOutcome:
    prepare_fleet_out(out)
    begin_fleet(out)
    replicas = []
    for i, (target, res) in enumerate(zip(targets, results)):
        folder, err = out / REPLICA.format(i), res["error"]
        if res["pack"] is not None:
            try:
                unpack(res["pack"], folder)
            except (ArtifactError, IntegrityError) as exc:
                shutil.rmtree(folder, ignore_errors=True)
                err = {"kind": "error", "exit_code": exc.exit_code, "message": f"its packed run folder did not verify: {exc.one_line()}"}
        rep = Replica(index=i, name=REPLICA.format(i), source=_source(target, res["placement"]),
                      folder=folder.name if folder.exists() else None, error=err)
        if err is None:
            rep.own = own_check(read_json(folder / "report.json", "report"))
            (rep.side,) = load_sides(Selection(folder))
            rep.keys = prompt_keys(rep.side.records or [])
        replicas.append(rep)
    report = fleet_verdict(replicas, command="check", atol=config.atol if atol is None else atol, tier=tier)
    write_fleet(out, report)
    seal_fleet(out)
    return FleetOutcome(out, report)


__all__ = ["NUM_CPUS", "ray_check", "ray_error", "task_gpus", "unpack", "wait_all"]
