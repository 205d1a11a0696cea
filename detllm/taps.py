"""Hooks on a torch module tree: capture each module's (and, optionally, each torch op's) inputs and
outputs, forward and backward, under Hugging Face module names, with a float64 re-evaluation of each
as the tolerance. Used by the torch backends' capture (locate) and by the training loop. The
test-only perturbation of one module lives in `detllm.perturb`; which part of a batched tensor is
kept, in `Window`. torch is imported lazily, inside the functions that need it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from .core.float64 import cache_of, cache_snapshot, first_tensor, module_output, one_row, op_output, op_row
from .core.opkinds import _SKIP_OPS, module_kind, op_kind, op_name  # noqa: F401 (grafthook names ops as taps do)

LAYER_KINDS = ("embedding", "layer", "logits")  # the layer boundaries kept past the memory bound


@dataclass
class Tapped:
    """One module's (or op's) captured tensors. Field names match backends.capture.CapturedTensor's."""

    name: str  # "model.layers.1.mlp.down_proj"; an op adds "/torch.linear#0"; a parameter's gradient is its parameter name
    kind: str  # one of backends.capture.CAPTURE_KINDS
    order: int  # completion order within the tap (a module after its children)
    output: Any  # numpy array, cut to the window; bfloat16 widened to float32 (exact), see dtype
    inputs: list[Any] = field(default_factory=list)  # numpy arrays, cut to the window (attention: + cached K/V)
    input_names: list[str] = field(default_factory=list)  # "arg0", keyword names, "past_keys"/"past_values"
    input_shapes: list[tuple[int, ...]] = field(default_factory=list)  # as the module saw them (whole batch)
    output_shape: tuple[int, ...] = ()  # as the module produced it (whole batch)
    dtype: str = ""  # the engine's dtype of the output ("bfloat16" even where `output` holds it as float32)
    ref_error: float | None = None  # max |output - float64 re-evaluation on the same inputs|; None: not evaluated
    phase: str = "forward"  # forward | backward (module grads: output = grad wrt output) | param_grad
    reeval: Any = None  # lazy_reference: a call that sets ref_error (float64 on the inputs kept), None once run


@dataclass(frozen=True)
class Window:
    """Which part of each batched tensor a tap keeps: batch row `row` (None: all), and along each
    position axis the last `cuts[width]` entries of an axis `width` long (left padding: the real
    positions are the last ones), so batch 1 and batch N captures of one prompt align."""

    row: int | None = None
    batch: int | None = None  # rows in the forward (None: dim 0 of a module's tensors is the batch)
    cuts: dict[int, int] = field(default_factory=dict)  # padded width -> real positions kept
    fixed: frozenset[int] = frozenset()  # feature sizes (hidden, heads...): an op's axis this long is never cut
    heads: frozenset[int] = frozenset()  # attention head counts: an op's dim 0 of batch x heads is unfolded
    in_pass_kv: bool = False  # an attention that read no cached K/V keeps those it wrote in the pass (in_pass_keys/values)

    def module(self, t: Any) -> Any:
        """A module's tensor in the Hugging Face layout [batch, position, ...]."""
        if self.row is None or t.ndim == 0:
            return t
        if self.batch is None or t.shape[0] == self.batch:
            t = t[self.row]
            if t.ndim >= 1 and t.shape[0] in self.cuts and (t.ndim >= 2 or not t.is_floating_point()):
                t = t[t.shape[0] - self.cuts[t.shape[0]]:]
        return t

    def axis(self, t: Any, dim: int) -> Any:
        """Cut axis `dim` of a tensor whose batch row was taken already (cached K/V: [heads, position, dim])."""
        if t.ndim > dim and t.shape[dim] in self.cuts:
            return t.narrow(dim, t.shape[dim] - self.cuts[t.shape[dim]], self.cuts[t.shape[dim]])
        return t

    def everywhere(self, t: Any) -> tuple[Any, bool]:
        """An op's or a mask's tensor, layout unknown: (the row of it, every axis of a padded width cut;
        False where an axis could be a position or a feature axis and was left whole)."""
        if self.row is None or t.ndim == 0:
            return t, True
        n = self.batch or 1
        if t.shape[0] == n:
            t = t[self.row]
        elif n > 1 and t.shape[0] % n == 0 and (t.shape[0] // n in self.cuts or t.shape[0] // n in self.heads):
            t = t.reshape(n, t.shape[0] // n, *t.shape[1:])[self.row]  # batch folded with heads or positions
        else:
            return t, False
        clean = True
        for dim in range(t.ndim):
            width = t.shape[dim]
            if width in self.cuts and width in self.fixed:
                clean = False
            elif width in self.cuts:
                t = t.narrow(dim, width - self.cuts[width], self.cuts[width])
        return t, clean


@dataclass
class Tap:
    """What a `tap` collected: the records in completion order and what was left out, in words."""

    tensors: list[Tapped] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    nbytes: int = 0  # bytes of the numpy arrays kept
    bounded: bool = False  # past max_bytes: layer boundaries only from then on
    skipped_ref: Counter = field(default_factory=Counter)  # why a float64 re-evaluation was skipped -> modules

    def by_name(self) -> dict[str, Tapped]:
        return {t.name: t for t in self.tensors}


def _numpy(t: Any) -> tuple[Any, str]:
    import torch

    dtype = str(t.dtype).replace("torch.", "")
    src = t.detach()
    t = (src.float() if src.dtype == torch.bfloat16 else src).cpu()  # numpy has no bfloat16: float32 holds each value exactly
    # one copy: the float() or cpu() above made one already, else copy the engine's memory once (never both)
    return (t.numpy().copy() if t.data_ptr() == src.data_ptr() else t.numpy()), dtype


class _Tapper:
    """The hooks of one `tap`: a module stack for op names, the records, the bound."""

    def __init__(self, model, *, window: Window, ops: bool, reference: bool, max_bytes: int | None,
                 layers_only: bool, keep_inputs: bool, skip: tuple[str, ...], ref_rows: bool = True,
                 lazy_reference: bool = False) -> None:
        self.model, self.window, self.ops, self.reference, self.ref_rows = model, window, ops, reference, ref_rows
        self.lazy = lazy_reference
        self.max_bytes, self.layers_only, self.keep_inputs = max_bytes, layers_only, keep_inputs
        self.names = {m: n for n, m in model.named_modules() if n not in skip}
        self.weights = {id(p) for p in model.parameters()} | {id(b) for b in model.buffers()}  # never an op's recorded input
        self.kinds = {m: module_kind(n, m) for m, n in self.names.items()}
        above = {".".join(n.split(".")[:i]) for m, n in self.names.items() if self.kinds[m] == "layer" for i in range(n.count(".") + 1)}
        self.holders = {m for m, n in self.names.items() if n in above}  # a decoder layer's ancestors (by name: one pass)
        self.result = Tap()
        self.stack: list[Any] = []  # modules entered and not yet left (innermost last)
        self.snaps: dict[int, dict] = {}  # id(module) -> cache snapshot taken as it was entered
        self.op_counts: Counter = Counter()
        self.busy = False  # inside a float64 re-evaluation: record nothing
        self.whole: list[str] = []  # ops whose row or positions could not be told apart: kept whole
        self.order = 0

    # -- forward -------------------------------------------------------------------------------
    def pre(self, module, args, kwargs):
        if self.busy:
            return None
        self.stack.append(module)
        cache = cache_of(args, kwargs)
        if cache is not None:
            self.snaps[id(module)] = cache_snapshot(cache)
        return None

    def post(self, module, args, kwargs, output):
        if self.busy:
            return None
        if self.stack and self.stack[-1] is module:
            self.stack.pop()
        snap = self.snaps.pop(id(module), {})
        name, kind = self.names[module], self.kinds[module]
        if self.layers_only and kind not in LAYER_KINDS:
            return None
        out = first_tensor(output)
        if out is None:
            return None
        tensors, names, shapes = self._inputs(module, args, kwargs, snap, kind)
        if self.window.in_pass_kv and kind == "attention":
            self._in_pass(module, args, kwargs, snap, tensors, names, shapes)
        rec = self._record(name, kind, out, tensors, names, shapes)
        if self.reference and rec is not None:
            if self.lazy and module in self.holders:  # never evaluated: holds nothing of the batch
                rec.reeval = self._later(rec, [], lambda: self._reference(module, (), {}, {}, None, rec))
            elif self.lazy and (kept := self._rows_kept((args, kwargs, snap))) is not None:  # the row's copy, not the batch
                rec.reeval = self._later(rec, [], lambda: self._reference(module, *kept, None, rec, rowed=True))
            elif self.lazy:
                rec.reeval = self._later(rec, tensors, lambda: self._reference(module, args, kwargs, snap, None, rec))
            else:
                self._reference(module, args, kwargs, snap, out, rec)
        return None

    def _inputs(self, module, args, kwargs, snap, kind) -> tuple[list, list, list]:
        import torch

        tensors, names, shapes = [], [], []
        named = [(f"arg{i}", a) for i, a in enumerate(args)] + list(kwargs.items())
        for key, value in named:
            parts = [(key, value)] if isinstance(value, torch.Tensor) else (
                [(f"{key}.{i}", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
                if isinstance(value, (tuple, list)) else [])
            for label, t in parts:
                shapes.append(tuple(t.shape))
                names.append(label)
                tensors.append(self.window.everywhere(t)[0] if "mask" in label else self.window.module(t))
        layer_idx = getattr(module, "layer_idx", None)
        if kind == "attention" and layer_idx in snap:
            for label, t in zip(("past_keys", "past_values"), snap[layer_idx]):
                shapes.append(tuple(t.shape))
                names.append(label)
                cut = t[self.window.row] if self.window.row is not None else t
                tensors.append(self.window.axis(cut, 1) if self.window.row is not None else cut)
        return tensors, names, shapes

    def _in_pass(self, module, args, kwargs, snap, tensors, names, shapes) -> None:
        """A prefill's attention (no cached K/V before it): the keys/values it wrote to the cache in
        this pass, as `in_pass_keys`/`in_pass_values`, to compare with a decode's cached ones."""
        layer_idx = getattr(module, "layer_idx", None)
        cache = cache_of(args, kwargs)
        after = cache_snapshot(cache) if cache is not None and layer_idx not in snap else {}
        for label, t in zip(("in_pass_keys", "in_pass_values"), after.get(layer_idx, ())):
            shapes.append(tuple(t.shape))
            names.append(label)
            cut = t[self.window.row] if self.window.row is not None else t
            tensors.append(self.window.axis(cut, 1) if self.window.row is not None else cut)

    def _record(self, name, kind, out, inputs, input_names, input_shapes, *, cut=None) -> Tapped | None:
        kept = cut if cut is not None else self.window.module(out)
        arr, dtype = _numpy(kept)
        arrays = [_numpy(t)[0] for t in inputs] if self.keep_inputs else []
        size = arr.nbytes + sum(a.nbytes for a in arrays)
        if self.max_bytes is not None and self.result.nbytes + size > self.max_bytes and not self.result.bounded:
            self._bound(name)
        if self.result.bounded and kind not in LAYER_KINDS:
            return None
        rec = Tapped(name, kind, self.order, arr, arrays, list(input_names) if self.keep_inputs else [],
                     list(input_shapes), tuple(out.shape), dtype)
        self.order += 1
        self.result.nbytes += size
        self.result.tensors.append(rec)
        return rec

    def _bound(self, at: str) -> None:
        kept = [t for t in self.result.tensors if t.kind in LAYER_KINDS]
        self.result.tensors = kept
        self.result.nbytes = sum(t.output.nbytes + sum(a.nbytes for a in t.inputs) for t in kept)
        self.result.bounded = True
        self.result.notes.append(f"captured tensors passed the bound of {self.max_bytes} bytes at {at}: layer "
                                 f"boundaries only ({', '.join(LAYER_KINDS)}), every other module and op dropped")

    def _rows_kept(self, vals: tuple, op_rank: int | None = None) -> tuple | None:
        """What a lazy float64 reference holds until asked: `vals` cut to the window's row and copied
        (the batch's activations are let go), weights by reference; None: the row is not cut (ref_rows
        off, one row, or an op whose arguments' dim 0 is not the batch): the caller keeps the batch."""
        import torch

        w, n = self.window, self.window.batch
        if not (self.lazy and self.ref_rows and w.row is not None and n and n > 1):
            return None
        if op_rank is None:
            vals = one_row(vals, n, w.row)
        elif (vals := op_row(vals[0], vals[1], op_rank, n, w.row, self.weights)) is None:
            return None

        def own(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                return v if id(v) in self.weights else v.clone()
            if isinstance(v, (tuple, list)):
                return type(v)(own(x) for x in v)
            return {k: own(x) for k, x in v.items()} if isinstance(v, dict) else v
        return tuple(own(v) for v in vals)

    def _reference(self, module, args, kwargs, snap, out, rec: Tapped, rowed: bool = False) -> None:
        import numpy as np
        import torch

        if module in self.holders:
            self.result.skipped_ref["holds the decoder layers (each layer is re-evaluated instead)"] += 1
            return
        self.busy = True  # the copy carries these hooks too: they record nothing meanwhile
        try:
            w, n = self.window, self.window.batch
            if rowed:  # cut to the row already (_rows_kept)
                w = dataclasses.replace(w, row=0, batch=1)
            elif self.ref_rows and w.row is not None and n and n > 1:  # the row alone (each row is computed on its own)
                args, kwargs, snap = (one_row(v, n, w.row) for v in (args, kwargs, snap))
                w = dataclasses.replace(w, row=0, batch=1)
            ref = module_output(module, args, kwargs, snap)
            shape = tuple(rec.output_shape)
            want = shape if w is self.window else (1, *shape[1:])
            if ref is None or tuple(ref.shape) != want:
                self.result.skipped_ref["its float64 copy returned another shape"] += 1
                return
            got = (self.window.module(out).detach() if out is not None else torch.from_numpy(rec.output)).to(torch.float64)
            rec.ref_error = float((got - w.module(ref)).abs().max().item()) if got.numel() else 0.0
            if not np.isfinite(rec.ref_error):
                rec.ref_error = None
                self.result.skipped_ref["its float64 re-evaluation is not finite"] += 1
        except Exception as exc:  # a module that cannot run in float64 or outside its engine: noted, not fatal
            self.result.skipped_ref[f"its float64 copy failed ({type(exc).__name__}: {str(exc)[:80]})"] += 1
        finally:
            self.busy = False

    # -- ops ---------------------------------------------------------------------------------------
    def on_op(self, func, args, kwargs, out) -> None:
        import torch

        if self.busy or self.layers_only or self.result.bounded:
            return
        op = op_name(func)
        tensor = first_tensor(out)
        if op in _SKIP_OPS or tensor is None or not tensor.is_floating_point() or not tensor.numel():
            return
        owner = self.stack[-1] if self.stack else self.model
        path = self.names.get(owner, "")
        key = f"{path}/torch.{op}"
        name = f"{key}#{self.op_counts[key]}"
        self.op_counts[key] += 1
        ins = [a for a in args if isinstance(a, torch.Tensor) and id(a) not in self.weights]
        cut, clean = self.window.everywhere(tensor)
        views = [self.window.everywhere(a)[0] for a in ins]
        rec = self._record(name, op_kind(op, self.kinds.get(owner, "other")), tensor, views,
                           [f"arg{i}" for i in range(len(ins))], [tuple(a.shape) for a in ins], cut=cut)
        if rec is None:
            return
        if not clean:
            self.whole.append(name)
        shape = tuple(tensor.shape)
        if self.reference and self.lazy and len(shape) and shape[0] == self.window.batch and \
                (kept := self._rows_kept((args, kwargs), len(shape))) is not None:  # the row's copy, not the batch
            rec.reeval = self._later(rec, [], lambda: self._op_reference(func, *kept, shape, None, rec, rowed=True))
        elif self.reference and self.lazy:
            rec.reeval = self._later(rec, views, lambda: self._op_reference(func, args, kwargs, shape, None, rec))
        elif self.reference:
            self._op_reference(func, args, kwargs, tensor.shape, cut, rec)

    def _later(self, rec: Tapped, views: list, fn) -> Any:
        """A call that evaluates rec's float64 reference when asked (locate asks for the ops its rule
        judges): the inputs are read then, so it first checks that the row of each still holds what
        was captured (nothing wrote into it in place since); else ref_error stays None."""
        def run() -> None:
            import torch

            rec.reeval = None
            with torch._C.DisableTorchFunction():
                if any(_numpy(v)[0].tobytes() != a.tobytes() for v, a in zip(views, rec.inputs)):
                    return
                fn()
        return run

    def _op_reference(self, func, args, kwargs, shape, cut, rec, rowed: bool = False) -> None:
        import numpy as np
        import torch

        w, n = self.window, self.window.batch
        if not rowed and self.ref_rows and w.row is not None and n and n > 1 and len(shape) and shape[0] == n:
            rowed_args = op_row(args, kwargs, len(shape), n, w.row, self.weights)
            if rowed_args is not None:
                args, kwargs, rowed = *rowed_args, True
        if rowed:  # the row alone: 1/n of the batch's float64 work (rows are computed independently)
            w = dataclasses.replace(w, row=0, batch=1)
        try:
            ref = op_output(func, args, kwargs)
        except Exception:  # an op whose float64 form does not exist (dtype-bound kernels): noted by its None
            self.result.skipped_ref["an op without a float64 form"] += 1
            return
        if ref is not None and tuple(ref.shape) == (tuple(shape) if w is self.window else (1, *shape[1:])):
            got = cut.to(torch.float64) if cut is not None else torch.from_numpy(rec.output).to(torch.float64)
            diff = (w.everywhere(ref.to(torch.float64))[0] - got).abs()
            rec.ref_error = float(diff.max().item()) if diff.numel() else 0.0
            if not np.isfinite(rec.ref_error):
                rec.ref_error = None

    # -- backward ----------------------------------------------------------------------------------
    def on_grad(self, module, grad_input, grad_output) -> None:
        out = first_tensor(grad_output)
        if out is None or self.busy:
            return
        ins = [g for g in grad_input if g is not None]
        rec = self._record(self.names[module], self.kinds[module], out, [self.window.module(g) for g in ins],
                           [f"grad_input{i}" for i in range(len(ins))], [tuple(g.shape) for g in ins])
        if rec is not None:
            rec.phase = "backward"

    def on_param_grad(self, name: str, kind: str, grad) -> None:
        rec = self._record(name, kind, grad, [], [], [], cut=grad)
        if rec is not None:
            rec.phase = "param_grad"


def _quietly(fn):
    """`fn` with torch function modes off: a hook's own tensor work (copies, the float64 copy's
    forward) is never taken for the model's ops."""
    def run(*args, **kwargs):
        import torch

        with torch._C.DisableTorchFunction():
            return fn(*args, **kwargs)
    return run


def _function_mode(tapper: _Tapper):
    """Ops seen at the torch function level (F.linear, Tensor.__add__, softmax...). Not a
    TorchDispatchMode: under one, aten.linear on a strided input took another kernel on CPU (torch
    2.13; the logits moved by 1e-5), and a capture must compute what the run computed, bit for bit."""
    import torch
    from torch.overrides import TorchFunctionMode

    class _Ops(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = op_name(func)
            inplace = name.endswith("_") and not tapper.busy and args and isinstance(args[0], torch.Tensor)
            before = args[0].detach().clone() if inplace else None  # what an in-place op read
            out = func(*args, **kwargs)
            tapper.on_op(func, (before,) + tuple(args[1:]) if inplace else args, kwargs, out)
            return out

    return _Ops()


@contextmanager
def tap(model: Any, *, forward: bool = True, backward: bool = False, ops: bool = False, row: int | None = None,
        window: Window | None = None, reference: bool = False, max_bytes: int | None = None,
        layers_only: bool = False, keep_inputs: bool = True, params: bool = True,
        skip: tuple[str, ...] = ("",), ref_rows: bool = True, lazy_reference: bool = False) -> Iterator[Tap]:
    """Capture while the block runs: every named submodule's inputs and output (forward), each torch
    function's output (ops, forward only: F.linear, Tensor.__add__...), module and parameter
    gradients (backward), cut to `window` (or batch `row`). `reference`: each module and op
    re-evaluated in float64 on its own inputs (Tapped.ref_error; `ref_rows`: on the window's row
    only, where rows are computed independently). Past `max_bytes`, layer boundaries only (noted);
    `keep_inputs=False` keeps outputs only; `lazy_reference`: each record's `reeval` evaluates its
    float64 reference when called (the inputs stay referenced until then). The hooks are gone after the block.

        with taps.tap(model, forward=True, backward=True, row=None) as t:
            model(**batch).loss.backward()
        t.tensors  # Tapped records: phase "forward", "backward" (grad wrt output), "param_grad"
    """
    window = window or Window(row=row)
    tapper = _Tapper(model, window=window, ops=ops, reference=reference, max_bytes=max_bytes,
                     layers_only=layers_only, keep_inputs=keep_inputs, skip=skip, ref_rows=ref_rows,
                     lazy_reference=lazy_reference)
    with ExitStack() as stack:
        if backward:  # an embedding's integer input has no gradient: torch warns, nothing is wrong
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
        for module in tapper.names:
            if forward:
                stack.callback(module.register_forward_pre_hook(_quietly(tapper.pre), with_kwargs=True).remove)
                stack.callback(module.register_forward_hook(_quietly(tapper.post), with_kwargs=True).remove)
            if backward:
                stack.callback(module.register_full_backward_hook(_quietly(tapper.on_grad)).remove)
        if backward and params:
            for pname, p in model.named_parameters():
                if p.requires_grad:
                    owner = model.get_submodule(pname.rsplit(".", 1)[0]) if "." in pname else model
                    kind = tapper.kinds.get(owner, "other")
                    stack.callback(p.register_hook(_quietly(lambda g, n=pname, k=kind: tapper.on_param_grad(n, k, g))).remove)
        if ops and forward:
            stack.enter_context(_function_mode(tapper))
        yield tapper.result
    if tapper.whole:
        tapper.result.notes.append(f"{len(tapper.whole)} op(s) kept whole, not cut to the row's real positions (no axis "
                                   f"of the batch, or a padded width equal to a feature size), e.g. {', '.join(tapper.whole[:3])}")
    for why, count in sorted(tapper.result.skipped_ref.items()):
        tapper.result.notes.append(f"float64 reference not evaluated for {count} module(s)/op(s): {why}")
