"""The TEST-ONLY perturbation (`--opt perturb=MODULE:output|weight:REL[@STEP]`, parsed by
`detllm.perturb`) applied to the running vLLM engine through hooks installed with
`LLM.apply_model`: no engine restart, and taking the hooks (and the weight element) back restores
the clean engine bit for bit. Same rule as the hf backend's: REL x RMS added to element 0 of each
request's last query token (output), or to the weight's largest-magnitude element (weight);
MODULE in Hugging Face naming, mapped onto vLLM's fused modules by names.py.
"""

from __future__ import annotations

import difflib
import math
from contextlib import contextmanager
from typing import Any, Iterator

from ...core.errors import UsageError
from ...core.perturb import Perturbation, perturb_output
from .names import Piece, Rule, find_piece, rules
from .rows import runner_of, spans
from .weights import HFWeights, module_weight, rebuild_gemm


def _target(model: Any, spec: Perturbation) -> tuple[Any, Rule | None, Piece]:
    """The vLLM module computing HF module `spec.module`, and which piece of it."""
    table = rules(model)
    if spec.target == "weight" and spec.module == "lm_head":  # vLLM never calls lm_head: logits_processor reads its weight
        return model.lm_head, None, Piece("lm_head", "logits", "logits")
    found = find_piece(table, spec.module)
    if found is None:
        names = [p.name for r in table for p in r.pieces if "/" not in p.name]
        close = difflib.get_close_matches(spec.module, names, n=3, cutoff=0.6)
        hint = (f"did you mean {', '.join(repr(c) for c in close)}? " if close else "") + \
            "Names are HF's; vLLM fuses act_fn with the multiply by up and applies rotary inside attention"
        raise UsageError(f"perturb: vLLM computes no module {spec.module!r} separately", hint=hint)
    rule, piece = found
    if "/" in piece.name:
        raise UsageError(f"perturb: {spec.module!r} is a vLLM-only op; name a Hugging Face module")
    return model.get_submodule(rule.module), rule, piece


def _rms(t: Any) -> float:
    import torch

    value = float(t.detach().to(torch.float64).pow(2).mean().sqrt()) if t.numel() else 0.0
    return value if value > 0 and math.isfinite(value) else 1.0


class _Output:
    """Output perturbation state: which rows of the current forward to perturb (root pre-hook)."""

    def __init__(self, spec: Perturbation, piece: Piece, runner: Any) -> None:
        self.spec, self.piece, self.runner = spec, piece, runner
        self.rows: list[int] = []  # flattened rows (each request's last query token)
        self.logit_rows: list[int] = []  # logits rows (input-batch indices)
        self.fired = 0

    def root(self, module: Any, args: tuple, kwargs: dict) -> None:
        found = spans(self.runner, args, kwargs)
        chosen = [] if found is None else [s for s in found[0] if s.step is not None
                                           and (self.spec.step is None or s.step == self.spec.step)]
        self.rows = [s.end - 1 for s in chosen]
        self.logit_rows = [s.index for s in chosen]

    def hook(self, module: Any, args: tuple, output: Any) -> Any:
        part = self.piece.part
        if part == "logits":
            if not self.logit_rows:
                return None
            self.fired += 1
            return perturb_output(output, self.spec.rel, [(i,) for i in self.logit_rows])
        if not self.rows:
            return None
        points = [(r,) for r in self.rows]
        self.fired += 1
        if part == "layer":  # (hidden, residual): the HF layer output is their sum
            hidden, residual = output
            total = hidden + residual
            return (hidden + (perturb_output(total, self.spec.rel, points) - total), residual)
        first = output[0] if isinstance(output, tuple) else output
        if self.piece.hi:
            new = first.clone()
            new[:, self.piece.lo:self.piece.hi] = perturb_output(first[:, self.piece.lo:self.piece.hi], self.spec.rel, points)
        else:
            new = perturb_output(first, self.spec.rel, points)
        return (new, *output[1:]) if isinstance(output, tuple) else new


def check_target(llm: Any, spec: Perturbation) -> None:
    """UsageError now, when `spec` names nothing vLLM can perturb (at engine start, before a run writes)."""
    def probe(model: Any) -> None:
        module, rule, piece = _target(model, spec)
        if spec.target == "weight":
            _weight(module, rule, piece, spec, HFWeights(llm.llm_engine.vllm_config.model_config.model)).remove()

    llm.apply_model(probe)


@contextmanager
def perturbed(llm: Any, spec: Perturbation | None) -> Iterator[Any]:
    """Apply `spec` to the engine's model for the block; everything is taken back after."""
    if spec is None:
        yield None
        return
    runner = runner_of(llm)

    def install(model: Any) -> tuple[list[Any], Any]:
        module, rule, piece = _target(model, spec)
        if spec.target == "output":
            state = _Output(spec, piece, runner)
            # prepended: capture hooks registered before still see the perturbed output
            handles = [model.register_forward_pre_hook(state.root, with_kwargs=True, prepend=True),
                       module.register_forward_hook(state.hook, prepend=True)]
            return handles, state
        return [_weight(module, rule, piece, spec, HFWeights(llm.llm_engine.vllm_config.model_config.model))], None

    handles, state = llm.apply_model(install)[0]
    try:
        yield state
    finally:
        for h in handles:
            h.remove()


class _WeightHandle:
    """Takes a weight perturbation back: the element (where vLLM kept the weight) and the GEMM handle."""

    def __init__(self, module: Any, flat: Any | None, index: int, old: Any, gemm: Any | None) -> None:
        self.module, self.flat, self.index, self.old, self.gemm = module, flat, index, old, gemm

    def remove(self) -> None:
        import torch

        if self.flat is not None:
            with torch.no_grad():
                self.flat[self.index] = self.old
        if self.gemm is not None:
            self.module.cpu_linear = self.gemm


def _weight(module: Any, rule: Rule | None, piece: Piece, spec: Perturbation, weights: HFWeights) -> _WeightHandle:
    """Perturb the HF module's weight: its rows of a fused weight, its real rows of a padded
    vocabulary; a weight vLLM packed into a GEMM handle gets a handle built from the perturbed copy."""
    import torch

    names = [p.name for p in rule.pieces] if rule is not None else [piece.name]
    full = module_weight(module, names, weights)
    if full is None or not full.is_floating_point():
        raise UsageError(f"perturb: {spec.module!r} has no floating-point weight in vLLM")
    lo, hi = (piece.lo, piece.hi) if piece.hi else (0, getattr(module, "org_vocab_size", full.shape[0]))
    slab = full[lo:hi]
    index = lo * (full[0].numel() if full.ndim > 1 else 1) + int(slab.abs().reshape(-1).argmax())
    own = getattr(module, "weight", None)
    kept = isinstance(own, torch.Tensor) and own.numel() > 0 and own.data_ptr() == full.data_ptr()  # vLLM computes with it
    target = full if kept else full.clone()
    flat = target.view(-1)
    with torch.no_grad():
        old = flat[index].clone()
        new = old + spec.rel * _rms(slab)
        if bool(new == old):
            raise UsageError(f"perturb {spec}: {spec.rel} x RMS is below the rounding of the largest weight in "
                             f"{full.dtype}; nothing would change", hint="pass a larger REL")
        flat[index] = new
    gemm = rebuild_gemm(module, target)
    return _WeightHandle(module, flat if kept else None, index, old, gemm)


__all__ = ["check_target", "perturbed"]
