"""`--script path.py:make`: the user's own training setup, loaded and checked.

Owns parsing the spec, running the file (runpy; a script is code, so it runs only from a path the
user gave, or from a pack's copy with `--allow-pack-option script`), checking what `make()` returns
(model, optimizer, batches, loss_fn, optional scheduler and scaler) and reading a batch's token ids.
DataLoaders with worker processes are refused: their seeds would not be recorded. The training
loop itself is loop.py's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..core.errors import IntegrityError, UsageError

SCRIPT_COPY = "script.py.txt"  # the script's bytes in a pack: text, never run from there unless allowed
PACK_OPTION = "script"  # --allow-pack-option script: run the pack's copy


@dataclass
class ScriptTask:
    """What `make()` returned, checked."""

    model: Any  # torch.nn.Module
    optimizer: Any  # torch.optim.Optimizer over the model's parameters
    batches: Any  # an iterable of batches, drawn in order (a list, a generator, a DataLoader with num_workers=0)
    loss_fn: Callable[[Any, Any], Any]  # loss_fn(model, batch) -> scalar tensor
    scheduler: Any = None  # its state_dict() belongs to the checkpoint
    scaler: Any = None  # a torch.amp.GradScaler; its state_dict() belongs to the checkpoint
    entry: str = ""  # path.py:function as given
    script_sha256: str = ""
    source: bytes = field(default=b"", repr=False)  # the script's bytes (copied into the pack)

    def config_task(self) -> dict[str, Any]:
        """train_config.json's `task` for this script."""
        return {"kind": "script", "entry": Path(self.entry.rpartition(":")[0]).name + ":" + self.function,
                "script_sha256": self.script_sha256}

    @property
    def function(self) -> str:
        return self.entry.rpartition(":")[2] or "make"


def parse_spec(spec: str) -> tuple[Path, str]:
    """`path.py:make` -> (path, function); `path.py` alone means `make`."""
    path, sep, func = spec.rpartition(":")
    if not sep:
        path, func = spec, "make"
    if not path.endswith(".py") or not func.isidentifier():
        raise UsageError(f"--script expects path.py:function (e.g. train.py:make), got {spec!r}")
    p = Path(path).expanduser()
    if not p.is_file():
        raise UsageError(f"--script {path!r} is not a file")
    return p, func


def load_script(spec: str, *, expect_sha256: str | None = None) -> ScriptTask:
    """Run the script at `spec`'s path, call its function, check what it returned. With
    `expect_sha256` (a replay), a script whose bytes differ from the recorded ones is refused
    before it runs (exit 6)."""
    path, func = parse_spec(spec)
    return _run(path, func, spec, expect_sha256)


def _run(path: Path, func: str, spec: str, expect_sha256: str | None) -> ScriptTask:
    import runpy

    source = path.read_bytes()
    sha = hashlib.sha256(source).hexdigest()
    if expect_sha256 is not None and sha != expect_sha256:
        raise IntegrityError(f"--script {str(path)!r} is not the script the pack was made with (sha256 {sha[:12]}…, "
                             f"recorded {expect_sha256[:12]}…)", hint="give the script the pack recorded")
    try:
        namespace = runpy.run_path(str(path), run_name="__detllm_script__")
    except Exception as exc:  # the user's code: one line, never a traceback
        raise UsageError(f"--script {str(path)!r} failed while loading: {exc.__class__.__name__}: {exc}") from exc
    make = namespace.get(func)
    if not callable(make):
        raise UsageError(f"--script {str(path)!r} has no function {func!r}")
    try:
        made = make()
    except Exception as exc:
        raise UsageError(f"--script {spec!r}: {func}() failed: {exc.__class__.__name__}: {exc}") from exc
    task = _unpack(made, spec)
    task.entry, task.script_sha256, task.source = f"{path}:{func}", sha, source
    return task


_FIELDS = ("model", "optimizer", "batches", "loss_fn", "scheduler", "scaler")


def _unpack(made: Any, spec: str) -> ScriptTask:
    """A dict with those keys, or a tuple/list of 4 to 6 values in that order."""
    if isinstance(made, dict):
        unknown = set(made) - set(_FIELDS)
        if unknown:
            raise UsageError(f"--script {spec!r} returned unknown key(s) {sorted(unknown)}", hint=f"keys: {', '.join(_FIELDS)}")
        parts = {k: made.get(k) for k in _FIELDS}
    elif isinstance(made, (tuple, list)) and 4 <= len(made) <= 6:
        parts = {**dict.fromkeys(_FIELDS), **dict(zip(_FIELDS, made))}
    else:
        raise UsageError(f"--script {spec!r} must return model, optimizer, batches, loss_fn[, scheduler[, scaler]] "
                         "(a tuple or a dict)")
    import torch

    if not isinstance(parts["model"], torch.nn.Module):
        raise UsageError(f"--script {spec!r}: model is a {type(parts['model']).__name__}, not a torch.nn.Module")
    if not isinstance(parts["optimizer"], torch.optim.Optimizer):
        raise UsageError(f"--script {spec!r}: optimizer is a {type(parts['optimizer']).__name__}, not a torch.optim.Optimizer")
    if not callable(parts["loss_fn"]):
        raise UsageError(f"--script {spec!r}: loss_fn is not callable")
    batches = parts["batches"]
    if batches is None or not hasattr(batches, "__iter__"):
        raise UsageError(f"--script {spec!r}: batches must be an iterable of batches")
    workers = getattr(batches, "num_workers", 0)
    if isinstance(batches, torch.utils.data.DataLoader) and workers > 0:
        raise UsageError(f"--script {spec!r}: a DataLoader with num_workers={workers} is refused: its worker seeds are not "
                         "recorded, so the data could not be replayed", hint="use num_workers=0")
    for name in ("scheduler", "scaler"):
        obj = parts[name]
        if obj is not None and not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise UsageError(f"--script {spec!r}: {name} has no state_dict()/load_state_dict(), so it cannot be checkpointed")
    own = {id(p) for p in parts["model"].parameters()}
    if any(id(p) not in own for g in parts["optimizer"].param_groups for p in g["params"]):
        raise UsageError(f"--script {spec!r}: the optimizer updates tensors that are not the model's parameters")
    return ScriptTask(**parts)


def token_ids(batch: Any) -> Any:
    """The 2-dim integer token-id tensor of a batch, the input of H(B_t): the batch itself, its
    'input_ids' (a dict), or its first element (a tuple or list)."""
    import torch

    ids = batch.get("input_ids") if isinstance(batch, dict) else batch[0] if isinstance(batch, (tuple, list)) else batch
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise UsageError("--script: each batch must be a 2-dim integer tensor of token ids, a dict with 'input_ids', "
                         "or a tuple whose first element is one")
    return ids


def split(batch: Any, parts: int) -> list[Any]:
    """A batch cut into `parts` micro-batches along its rows (dim 0 of every tensor in it)."""
    import torch

    if parts == 1:
        return [batch]
    rows = int(token_ids(batch).shape[0])
    if rows % parts:
        raise UsageError(f"--script: gradient accumulation {parts} must divide the batch's {rows} rows")
    if isinstance(batch, torch.Tensor):
        return list(batch.chunk(parts))
    if isinstance(batch, dict):
        cut = {k: (v.chunk(parts) if isinstance(v, torch.Tensor) else [v] * parts) for k, v in batch.items()}
        return [{k: v[i] for k, v in cut.items()} for i in range(parts)]
    cut = [v.chunk(parts) if isinstance(v, torch.Tensor) else [v] * parts for v in batch]
    return [type(batch)(v[i] for v in cut) if isinstance(batch, tuple) else [v[i] for v in cut] for i in range(parts)]


@dataclass
class ScriptBatch:
    """One step's data, as task.Batch: `samples` is the batch's ordinal in the script's stream."""

    samples: list[int]
    micro: list[Any]  # the micro-batches' token-id tensors, in order


class ScriptRun:
    """A checked script as the step loop's Task (task.Task's interface): `next_batch` takes the
    script's batches in their order (the data-order generator is not used: the order is the
    script's, bound by H(B_t)), `loss` calls its loss_fn on the micro-batch whose token ids the
    step hashes. `fast_forward(b)` draws b batches without training, for a resume at boundary b."""

    def __init__(self, parts: ScriptTask, grad_accumulation: int = 1) -> None:
        self.parts = parts
        self.model, self.optimizer, self.scheduler, self.scaler = parts.model, parts.optimizer, parts.scheduler, parts.scaler
        self.grad_accumulation = grad_accumulation
        self._it = iter(parts.batches)
        self._drawn = 0
        self._inputs: dict[int, Any] = {}  # id(token-id tensor) -> the user's micro-batch it came from

    def _draw(self) -> Any:
        try:
            batch = next(self._it)
        except StopIteration:
            raise UsageError(f"--script: batches ran out after {self._drawn} batches; give at least one per step") from None
        self._drawn += 1
        return batch

    def next_batch(self, data: Any) -> "ScriptBatch":
        micro = split(self._draw(), self.grad_accumulation)
        ids = [token_ids(m) for m in micro]
        self._inputs = {id(i): m for i, m in zip(ids, micro)}
        return ScriptBatch([self._drawn - 1], ids)

    def loss(self, micro_ids: Any) -> Any:
        return self.parts.loss_fn(self.model, self._inputs[id(micro_ids)])

    def fast_forward(self, boundary: int) -> None:
        for _ in range(boundary - self._drawn):
            self._draw()

    @property
    def extra(self) -> dict[str, Any]:
        """What checkpoint.json's `extra` holds beyond the scheduler (checkpoint.py saves that): the
        scaler's state_dict(), JSON values only."""
        return {"scaler": _jsonable(self.scaler.state_dict(), "scaler")} if self.scaler is not None else {}

    def load_extra(self, extra: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in extra:
            self.scaler.load_state_dict(extra["scaler"])


def script_task_maker(load: Callable[[], ScriptTask], *, fast_forward: int = 0) -> Callable[[dict[str, Any], Path], ScriptRun]:
    """loop.run_steps's make_task for a script: every source seeded from the config's seed before
    make() runs (its weights and data order are then the same in every process), the script's
    batches fast-forwarded to a resumed segment's start."""
    def make_task(config: dict[str, Any], _model_path: Path) -> ScriptRun:
        from .rng import seed_all

        seed_all(config["seed"])
        run = ScriptRun(load(), config["grad_accumulation"])
        run.fast_forward(fast_forward)
        return run

    return make_task


def build_script_task(config: dict[str, Any], script_path: Path) -> ScriptRun:
    """task.build_task for a --script config (a fresh process's run): the script at `script_path`,
    its bytes checked against the recorded sha256 before it runs."""
    func = config["task"]["entry"].rpartition(":")[2]
    return script_task_maker(lambda: _run(Path(script_path), func, f"{script_path}:{func}", config["task"]["script_sha256"]))(
        config, script_path)


def script_setup(spec: str) -> tuple[Path, dict[str, Any], dict[str, Any], list[tuple[str, int]]]:
    """train-check --script: (the script's path, standing for the model folder; the config's
    task and optimizer sections; the model's parameter names and bytes), from one run of make()."""
    from .rng import Saved, seed_all

    with Saved():  # the caller's random state is put back
        seed_all(0)
        parts = load_script(spec)
    opt = parts.optimizer
    settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in opt.defaults.items()
                if isinstance(v, (bool, int, str, type(None))) or (isinstance(v, float) and v == v and abs(v) != float("inf"))
                or (isinstance(v, tuple) and all(isinstance(x, (int, float)) for x in v))}
    optimizer = {"name": type(opt).__name__, **settings}
    if parts.scheduler is not None:
        optimizer["scheduler"] = type(parts.scheduler).__name__
    if parts.scaler is not None:
        optimizer["scaler"] = type(parts.scaler).__name__
    params = [(n, p.numel() * p.element_size()) for n, p in parts.model.named_parameters()]
    return Path(parts.entry.rpartition(":")[0]), parts.config_task(), optimizer, params


def copy_script(script_path: Path, folder: Path) -> None:
    """The script's bytes into the pack (SCRIPT_COPY), as text that nothing runs unless allowed."""
    from ..runfolder.schema_io import atomic_write_text

    atomic_write_text(folder / SCRIPT_COPY, script_path.read_bytes().decode("utf-8", "surrogateescape"))


def _jsonable(state: Any, name: str) -> Any:
    import json

    try:
        return json.loads(json.dumps(state, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--script: the {name}'s state_dict() is not plain JSON ({exc}); it cannot be checkpointed without pickling") from exc


def script_for_replay(pack: Path, config: dict[str, Any], script: str | None, allow_pack_options: tuple[str, ...]) -> ScriptTask:
    """The script a replay of a --script pack runs: the user's `--script PATH[:function]` (its bytes
    must be the recorded ones), or the pack's own copy only with `--allow-pack-option script`."""
    func = config["task"]["entry"].rpartition(":")[2]
    expect = config["task"]["script_sha256"]
    if script is not None:
        return load_script(script if not script.endswith(".py") else f"{script}:{func}", expect_sha256=expect)
    if PACK_OPTION not in allow_pack_options:
        raise UsageError("this training pack was made with --script: replay runs that code only from a path you give "
                         "(--script PATH) or, to run the pack's copy, --allow-pack-option script")
    copy = pack / SCRIPT_COPY
    if not copy.is_file():
        raise UsageError(f"the pack holds no copy of its script ({SCRIPT_COPY})", hint="give it with --script PATH")
    return _run(copy, func, f"{SCRIPT_COPY}:{func}", expect)


def side_script(folder: Path, config: dict[str, Any], scripts: list[str] | None, side: int) -> str | None:
    """`diff A B --script PATH[:make]` (once for both sides, or once per side): the script this side
    re-runs; None for a built-in pack, or a --script pack when none was given (then not re-run)."""
    if config["task"]["kind"] != "script" or not scripts:
        return None
    return scripts[side] if len(scripts) > 1 else scripts[0]


def script_runner(folder: Path, config: dict[str, Any], spec: str, fast_forward: int) -> tuple[Path, Callable[[dict[str, Any], Path], ScriptRun]]:
    """(the path standing for the model, loop.run_steps's make_task) to re-run a --script pack from the
    checkpoint at `fast_forward`: the given script, refused (exit 6) when its bytes are not the recorded ones."""
    return parse_spec(spec)[0], script_task_maker(lambda: script_for_replay(folder, config, spec, ()), fast_forward=fast_forward)
