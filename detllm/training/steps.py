"""One training step with its capture: zero the gradients, draw the batch, forward and backward
per micro-batch, the test-only gradient tamper when recorded, the gradients' digests and figures
(after backward, before optimizer.step()), the update, the parameters' digests and figures, and
the step's record with h_t (docs/training.md). Does not own the per-tensor pass (capture.py), the
loop, checkpoints or files (loop.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from ..runfolder import schema_io
from .capture import digests_with_figures
from .chain import genesis, link
from .digest import CHAIN, chain_of, config_digest, rng_digest, tensors_digest, torch_batch_digest
from .task import Task


@dataclass(frozen=True)
class Tamper:
    """test_options.grad_add: `value` added to every element of `parameter`'s gradient at `step`,
    between backward and its digest. A test option, recorded in train_config.json, never hidden."""

    step: int
    parameter: str
    value: float


@dataclass
class StepResult:
    record: dict[str, Any]  # the train_step record
    h: bytes  # h_t


def named_params(model: Any) -> list[tuple[str, Any]]:
    """Every parameter by name (trainable or frozen; shared ones once), as H(θ) takes them."""
    return list(model.named_parameters())


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def genesis_record(task: Task, config: dict[str, Any], *, run: int, seed: int) -> tuple[dict[str, Any], bytes]:
    """The train_genesis record of θ_init (the model as it is now) and h_genesis."""
    params = named_params(task.model)
    per, figs = digests_with_figures(params, chain_of(config))
    h_params = tensors_digest(per.items())
    h = genesis(h_params, config_digest(config), seed)
    tensors = {name: {"value_sha256": per[name].hex(), "value_l2": f[0], "value_max_abs": f[1]} for (name, _), f in zip(params, figs)}
    return schema_io.stamp("train_genesis", {"run": run, "seed": seed, "config_sha256": config_digest(config).hex(),
                                             "params_sha256": h_params.hex(), "h": h.hex(), "tensors": tensors}), h


def train_step(task: Task, data: Any, t: int, *, capture: bool = True, rng_state: dict[str, Any] | None = None,
               h_prev: bytes = b"", run: int = 0, tamper: Tamper | None = None, chain: str = CHAIN) -> StepResult:
    """Step t. With capture off only the training happens (the benchmark's baseline): no digest,
    no figure, no record. `rng_state` is the RNG state taken at the start of the step (R_t).
    After it, each parameter's .grad still holds the gradient that was digested (AdamW reads it,
    never writes it): the loop reads the tensors of a divergent step from the model. `chain` is
    the pack's chain version (digest.chain_of of its train_config.json)."""
    import torch

    started = time.perf_counter()
    task.optimizer.zero_grad(set_to_none=True)
    batch = task.next_batch(data)
    losses = []
    for micro in batch.micro:
        loss = task.loss(micro)
        (loss / len(batch.micro) if len(batch.micro) > 1 else loss).backward()
        losses.append(loss.detach())
    params = named_params(task.model)
    if tamper is not None and tamper.step == t:
        with torch.no_grad():
            dict(params)[tamper.parameter].grad.add_(tamper.value)
    if capture:
        grads = [p.grad for _, p in params]
        grad_per, grad_figs = digests_with_figures([(name, g) for (name, _), g in zip(params, grads)], chain)
    task.optimizer.step()
    if task.scheduler is not None:
        task.scheduler.step()
    if not capture:
        return StepResult({}, b"")
    loss_value = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
    value_per, value_figs = digests_with_figures(params, chain)
    h_params = tensors_digest(value_per.items())
    h_batch = torch_batch_digest(batch.micro)
    h = link(h_prev, h_params, h_batch, t)
    tensors = {name: {"grad_sha256": None if grads[i] is None else grad_per[name].hex(), "value_sha256": value_per[name].hex(),
                      "grad_l2": grad_figs[i][0], "grad_max_abs": grad_figs[i][1],
                      "value_l2": value_figs[i][0], "value_max_abs": value_figs[i][1]}
               for i, (name, _) in enumerate(params)}
    norm = [f[0] for f in grad_figs if f[0] is not None]
    record = schema_io.stamp("train_step", {
        "run": run, "step": t, "batch_sha256": h_batch.hex(), "samples": batch.samples,
        "rng_sha256": rng_digest(rng_state).hex() if rng_state is not None else "0" * 64,
        "loss": _finite(float(loss_value.float().item())), "grad_norm": _finite(math.sqrt(math.fsum(x * x for x in norm))),
        "grads_sha256": tensors_digest(grad_per.items()).hex(), "params_sha256": h_params.hex(), "h": h.hex(),
        "tensors": tensors, "seconds": round(time.perf_counter() - started, 6),
    })
    return StepResult(record, h)


__all__ = ["StepResult", "Tamper", "digests_with_figures", "genesis_record", "named_params", "train_step"]
