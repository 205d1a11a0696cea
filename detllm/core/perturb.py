"""The TEST-ONLY perturbation of one module (`--opt perturb=MODULE:output:REL[@STEP]` or
`MODULE:weight:REL`): the spec, its parser (one-line UsageErrors) and the context that applies it to
a torch model and takes it back. It makes a known difference happen so `detllm locate` can be shown
to name it; never a determinism setting. The capture hooks are `detllm.taps`'.
"""

from __future__ import annotations

import difflib
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from .errors import UsageError

TARGETS = ("output", "weight")
FORMAT = "MODULE:output:REL[@STEP] or MODULE:weight:REL (REL in (0, 1], e.g. model.layers.1.mlp.down_proj:output:1e-3)"


@dataclass(frozen=True)
class Perturbation:
    """Add `rel` x RMS to ONE element of a module's output (at each row's last position, element 0)
    or of its weight (the element of largest magnitude, first in row-major order)."""

    module: str  # Hugging Face module path, e.g. "model.layers.1.mlp.down_proj"
    target: str  # output | weight
    rel: float  # the size, relative to the RMS of what is perturbed: (0, 1]
    step: int | None = None  # output only: the generated-token step to perturb at (None: every forward)

    def __str__(self) -> str:
        return f"{self.module}:{self.target}:{self.rel!r}" + (f"@{self.step}" if self.step is not None else "")


def parse(text: str) -> Perturbation:
    """`MODULE:output:REL[@STEP]` or `MODULE:weight:REL` -> Perturbation; bad input is one UsageError."""
    parts = text.strip().rsplit(":", 2)
    if len(parts) != 3 or not parts[0]:
        raise UsageError(f"perturb {text!r} is not {FORMAT}")
    module, target, size = parts
    if target not in TARGETS:
        raise UsageError(f"perturb target {target!r} is unknown: it is 'output' or 'weight' ({FORMAT})")
    step = None
    if "@" in size:
        size, _, at = size.partition("@")
        if target != "output":
            raise UsageError(f"perturb {text!r}: @STEP applies to an output perturbation only (a weight stays perturbed)")
        if not at.isdigit():
            raise UsageError(f"perturb step {at!r} is not a step number (0 is the prefill)")
        step = int(at)
    try:
        rel = float(size)
    except ValueError:
        raise UsageError(f"perturb size {size!r} is not a number ({FORMAT})") from None
    if not math.isfinite(rel) or rel <= 0 or rel > 1:
        raise UsageError(f"perturb size {size!r} must be a finite number in (0, 1], relative to the RMS of what is perturbed")
    return Perturbation(module, target, rel, step)


def resolve(model: Any, spec: Perturbation) -> Any:
    """The module `spec` names in `model`; an unknown path is a UsageError naming close matches."""
    names = [n for n, _ in model.named_modules() if n]
    if spec.module not in names:
        close = difflib.get_close_matches(spec.module, names, n=3, cutoff=0.6)
        example = names[min(3, len(names) - 1)] if names else "model.layers.0.mlp"
        hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else f"module paths look like {example!r}"
        raise UsageError(f"perturb: the model has no module {spec.module!r}", hint=hint)
    module = model.get_submodule(spec.module)
    weight = getattr(module, "weight", None)
    if spec.target == "weight" and (weight is None or not hasattr(weight, "dtype") or not weight.is_floating_point()):
        raise UsageError(f"perturb: module {spec.module!r} ({type(module).__name__}) has no floating-point weight to perturb")
    if spec.target == "weight":
        own = set(module.modules())  # batch_invariant's BlockLinear holds the Linear whose weight it shows
        tied = sorted(n for n, m in model.named_modules() if m not in own and n
                      and getattr(getattr(m, "weight", None), "data_ptr", lambda: None)() == weight.data_ptr())
        if tied:
            raise UsageError(f"perturb: the weight of {spec.module!r} is shared with {', '.join(map(repr, tied))} (tied): "
                             f"a change to it would start in more than one module",
                             hint="perturb one of these modules' output instead")
        _weight_point(module, spec)
    return module


def _weight_point(module: Any, spec: Perturbation) -> tuple[int, Any, Any]:
    """(flat index, value now, perturbed value) of the weight element a weight perturbation changes."""
    import torch

    with torch.no_grad():
        flat = module.weight.data.view(-1)
        i = int(flat.abs().argmax().item())
        old = flat[i].clone()
        new = old + spec.rel * _rms(module.weight.data)
    if bool(new == old):
        raise UsageError(f"perturb {spec}: {spec.rel} x RMS is below the rounding of the largest weight in "
                         f"{module.weight.dtype}; nothing would change", hint="pass a larger REL")
    return i, old, new


def _rms(t: Any) -> float:
    import torch

    value = float(t.detach().to(torch.float64).pow(2).mean().sqrt().item()) if t.numel() else 0.0
    return value if value > 0 and math.isfinite(value) else 1.0  # an all-zero slab: the size is absolute


def perturb_output(t: Any, rel: float, points: list[tuple[int, ...]] | None = None) -> Any:
    """A copy of `t` with rel x RMS(slab) added at each point (element 0 of the remaining axes);
    points default to each row's last position ([batch, position, ...]; left padding: a real one)."""
    if points is None:
        rows = range(t.shape[0]) if t.ndim else ()
        points = [(r, -1) for r in rows] if t.ndim >= 3 else [(r,) for r in rows] if t.ndim == 2 else [()]
    t = t.clone()
    for p in points:
        slab = t[p]
        idx = p + (0,) * (t.ndim - len(p))
        t[idx] = t[idx] + rel * _rms(slab)
    return t


class Applied:
    """A perturbation in effect: set `step` before each forward (output perturbations at a step)."""

    def __init__(self, spec: Perturbation) -> None:
        self.spec = spec
        self.step: int | None = None
        self.fired = 0  # forwards the output perturbation changed
        self.points: list[tuple[int, ...]] | None = None  # where in the output (None: each row's last position)

    @property
    def active(self) -> bool:
        return self.spec.step is None or self.step == self.spec.step

    def hook(self, module, args, output):
        if self.spec.target != "output" or not self.active:
            return None
        import torch

        if isinstance(output, torch.Tensor):
            self.fired += 1
            return perturb_output(output, self.spec.rel, self.points)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            self.fired += 1
            return (perturb_output(output[0], self.spec.rel, self.points),) + output[1:]
        if hasattr(output, "keys") and output.keys():  # transformers ModelOutput: its first field
            key = list(output.keys())[0]
            self.fired += 1
            output[key] = perturb_output(output[key], self.spec.rel, self.points)
            return output
        return None


def _quiet(fn, *args):
    """Run a hook with torch function modes off: a tap's op capture sees the module's output, not
    the arithmetic of the perturbation made on it."""
    import torch

    with torch._C.DisableTorchFunction():
        return fn(*args)


@contextmanager
def applied(model: Any, spec: Perturbation | None) -> Iterator[Applied | None]:
    """Apply `spec` to `model` for the block (None: nothing); the weight element or the hook is taken
    back after, bit for bit. Register capture hooks after entering, so they see the perturbed output."""
    if spec is None:
        yield None
        return
    import torch

    module = resolve(model, spec)
    state = Applied(spec)
    if spec.target == "output":
        # a closure, not the bound method: a deepcopy of the module (taps' float64 copy) shares it
        handle = module.register_forward_hook(lambda m, a, o: _quiet(state.hook, m, a, o))
        try:
            yield state
        finally:
            handle.remove()
        return
    i, old, new = _weight_point(module, spec)
    flat = module.weight.data.view(-1)
    with torch.no_grad():
        flat[i] = new
    try:
        yield state
    finally:
        with torch.no_grad():
            flat[i] = old
