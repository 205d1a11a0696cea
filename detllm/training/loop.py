"""One training run: steps [start, stop) from genesis or from a checkpoint, every record written to
a steps file as it is made, checkpoints at the configured boundaries, the caller's global RNG state
and thread count put back afterwards. A run is described by a JSON-able RunRequest, so the same
function runs in this process or in a fresh one (child.py). Does not own comparing runs
(verdict.py) or the pack (check.py).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from ..runfolder import schema_io
from ..core.errors import ArtifactError
from . import rng
from .digest import chain_of
from .checkpoint import apply_checkpoint, load_checkpoint, optimizer_digest, optimizer_state, save_checkpoint
from .steps import Tamper, genesis_record, named_params, train_step
from .task import Task, build_task
from .verdict import differing_parameters, step_differs

KEEP_LIMIT = 256 << 20  # bytes of tensors the reference run keeps in memory for max |Δ|


@dataclass
class RunRequest:
    """Everything a run needs, JSON-able (a fresh process reads it from a file)."""

    config: dict[str, Any]  # train_config.json's document
    model_path: str
    run: int
    seed: int
    stop: int  # steps [start, stop) run; start is 0, or the boundary of `resume`
    steps_file: str  # the records, written as they are made (line 1 the genesis when starting from it)
    resume: dict[str, Any] | None = None  # {"dir": ..., "descriptor_sha256": ...}: start from this checkpoint
    checkpoints: str | None = None  # write checkpoints under this folder (the reference run)
    keep_tensors: bool = False  # keep every step's gradients and values in memory (up to KEEP_LIMIT)
    reference: str | None = None  # a steps file to compare with as the run goes
    dump: str | None = None  # a fresh process writes the first divergent step's differing tensors here (safetensors)
    end_state: bool = False  # digest the state the run stops on (R_stop, the optimizer's O): replay compares it

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunResult:
    records: list[dict[str, Any]]  # genesis (when from genesis) then steps
    checkpoints: list[dict[str, Any]] = field(default_factory=list)  # checkpoints.json entries
    kept: dict[int, dict[str, tuple[Any, Any]]] = field(default_factory=dict)  # step -> name -> (grad, value)
    divergent: dict[str, tuple[Any, Any]] | None = None  # name -> (grad, value) at the first step differing from `reference`
    divergent_step: int | None = None
    end_state: dict[str, str] | None = None  # {"rng_sha256", "optimizer_sha256", "params_sha256"} at `stop` (end_state)
    seconds: float = 0.0


def tamper_of(config: dict[str, Any], run: int) -> Tamper | None:
    opt = config.get("test_options", {}).get("grad_add")
    return Tamper(opt["step"], opt["parameter"], opt["value"]) if opt and opt["run"] == run else None


def boundaries(config: dict[str, Any]) -> set[int]:
    every, k = config["checkpoint_every"], config["steps"]
    return set(range(0, k, every)) | {k} if every else {0, k}


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class StepsWriter:
    """Appends validated records to `<file>.partial`, renamed into place when the run ends."""

    def __init__(self, path: Path) -> None:
        self.final, self.partial = path, path.with_name(path.name + ".partial")
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.partial, "w", encoding="utf-8")

    def write(self, rec: dict[str, Any]) -> None:
        schema_io.validate(rec, rec["artifact_type"], where=self.final.name)
        self._f.write(json.dumps(rec, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n")
        self._f.flush()

    def finish(self) -> None:
        self._f.close()
        os.replace(self.partial, self.final)

    def abort(self) -> None:
        self._f.close()


def read_steps(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def run_steps(req: RunRequest, make_task: Callable[[dict[str, Any], Path], Task] = build_task) -> RunResult:
    """Run `req` in this process: the caller's RNG state and torch thread count are put back after."""
    with rng.Saved(), torch_threads(req.config["threads"]):
        return _run(req, make_task)


def _run(req: RunRequest, make_task: Callable[[dict[str, Any], Path], Task]) -> RunResult:
    started = time.perf_counter()
    config = req.config
    task = make_task(config, Path(req.model_path))
    data = rng.seed_all(req.seed)
    result = RunResult([])
    writer = StepsWriter(Path(req.steps_file))
    try:
        if req.resume is not None:
            ckpt = load_checkpoint(req.resume["dir"], req.resume.get("descriptor_sha256"))
            if ckpt.descriptor["seed"] != req.seed:
                raise ArtifactError(f"checkpoint {ckpt.path.name} is of seed {ckpt.descriptor['seed']}, not {req.seed}")
            apply_checkpoint(task, ckpt, data)
            start, h = ckpt.boundary, bytes.fromhex(ckpt.descriptor["commitment"])
            last_params = ckpt.descriptor["params_sha256"]
        else:
            g, h = genesis_record(task, config, run=req.run, seed=req.seed)
            writer.write(g)
            result.records.append(g)
            start, last_params = 0, g["params_sha256"]
        ref = {r["step"]: r for r in read_steps(Path(req.reference))[1:]} if req.reference else {}
        marks = boundaries(config) if req.checkpoints else set()
        tamper = tamper_of(config, req.run)
        budget = KEEP_LIMIT
        for t in range(start, req.stop):
            state = rng.capture(data)
            if t in marks:
                result.checkpoints.append(_checkpoint(req, t, task, state, last_params, h))
            step = train_step(task, data, t, rng_state=state, h_prev=h, run=req.run, tamper=tamper, chain=chain_of(req.config))
            rec, h, last_params = step.record, step.h, step.record["params_sha256"]
            writer.write(rec)
            result.records.append(rec)
            size = 2 * sum(v.numel() * v.element_size() for _, v in named_params(task.model)) if req.keep_tensors else 0
            if req.keep_tensors and size <= budget:  # the steps that fit in KEEP_LIMIT, from the first
                result.kept[t] = _tensors(task, None)
                budget -= size
            if result.divergent is None and t in ref and step_differs(ref[t], rec):
                names = set(differing_parameters(ref[t], rec, "grad_sha256")) | set(differing_parameters(ref[t], rec, "value_sha256"))
                result.divergent, result.divergent_step = _tensors(task, names), t
        if req.stop in marks:
            result.checkpoints.append(_checkpoint(req, req.stop, task, rng.capture(data), last_params, h))
        if req.end_state:
            result.end_state = _end_state(task, rng.capture(data), last_params)
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    if req.dump and result.divergent:
        _dump(Path(req.dump), result.divergent, result.divergent_step)
    result.seconds = round(time.perf_counter() - started, 3)
    return result


def _checkpoint(req: RunRequest, b: int, task: Task, state: dict[str, Any], params_sha256: str, h: bytes) -> dict[str, Any]:
    from .digest import config_digest

    return save_checkpoint(Path(req.checkpoints), b, task, state, seed=req.seed, config_sha256=config_digest(req.config).hex(),
                           params_sha256=params_sha256, commitment=h.hex(), chain=chain_of(req.config))


def _end_state(task: Task, state: dict[str, Any], params_sha256: str) -> dict[str, str]:
    from .digest import rng_digest

    return {"rng_sha256": rng_digest(state).hex(), "optimizer_sha256": optimizer_digest(*optimizer_state(task)),
            "params_sha256": params_sha256}


def _tensors(task: Task, names: set[str] | None) -> dict[str, tuple[Any, Any]]:
    """name -> (gradient, value) clones as they are now (after the step: the gradient digested, θ_t)."""
    return {n: (None if p.grad is None else p.grad.detach().clone(), p.detach().clone())
            for n, p in named_params(task.model) if names is None or n in names}


def _dump(path: Path, tensors: dict[str, tuple[Any, Any]], step: int | None) -> None:
    from safetensors.torch import save_file

    flat = {f"grad/{n}": g.contiguous() for n, (g, _) in tensors.items() if g is not None}
    flat.update({f"value/{n}": v.contiguous() for n, (_, v) in tensors.items()})
    save_file(flat, str(path), metadata={"step": str(step)})


def load_dump(path: Path) -> tuple[dict[str, tuple[Any, Any]], int | None]:
    """What _dump wrote: name -> (gradient or None, value), and the step."""
    from safetensors import safe_open

    out: dict[str, list[Any]] = {}
    with safe_open(str(path), framework="pt") as f:
        step = f.metadata().get("step")
        for key in f.keys():
            kind, name = key.split("/", 1)
            out.setdefault(name, [None, None])[0 if kind == "grad" else 1] = f.get_tensor(key)
    return {n: (g, v) for n, (g, v) in out.items()}, None if step in (None, "None") else int(step)


__all__ = ["KEEP_LIMIT", "RunRequest", "RunResult", "StepsWriter", "boundaries", "load_dump", "read_steps", "run_steps",
           "tamper_of", "torch_threads"]
