"""Hooks on a torch module tree: capture each module's (and, optionally, each torch op's) inputs and
outputs, forward and backward, under Hugging Face module names, with a float64 re-evaluation of each
as the tolerance. Used by the torch backends' capture (locate) and by the training loop. How the
hooks attach (global or per module, the ops' function mode) is core/taphooks'. The
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

from .core.taphooks import forward_hooks, ops_mode, quietly, takes_cache
from .core.float64 import cache_of, cache_snapshot, first_tensor, module_output, one_row, op_output, op_row
from .core.opkinds import _SKIP_OPS, module_kind, op_kind, op_name  # noqa: F401 (grafthook names ops as taps do)
from .core.window import Window  # noqa: F401 (re-exported: taps.Window)
from .core.window import numpy_copy as _numpy, numpy_view as _view

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


@dataclass
class Tap:
    """What a `tap` collected: the records in completion order and what was left out, in words."""

    tensors: list[Tapped] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    nbytes: int = 0  # bytes of the numpy arrays kept
    bounded: bool = False  # past max_bytes: layer boundaries only from then on
    skipped_ref: Counter = field(default_factory=Counter)  # why a float64 re-evaluation was skipped -> modules
    ops_ended: bool = False  # `ops_through` completed: no op recorded after it

    def by_name(self) -> dict[str, Tapped]:
        return {t.name: t for t in self.tensors}


class _Tapper:
    """The hooks of one `tap`: a module stack for op names, the records, the bound."""

    def __init__(self, model, *, window: Window, ops: bool, reference: bool, max_bytes: int | None,
                 layers_only: bool, keep_inputs: bool, skip: tuple[str, ...], ref_rows: bool = True,
                 lazy_reference: bool = False, ops_through: str | None = None, inside_layers: bool = True) -> None:
        self.ops_through, self.inside_layers = ops_through, inside_layers
        self.model, self.window, self.ops, self.reference, self.ref_rows = model, window, ops, reference, ref_rows
        self.lazy = lazy_reference
        self.max_bytes, self.layers_only, self.keep_inputs = max_bytes, layers_only, keep_inputs
        self.names = {m: n for n, m in model.named_modules() if n not in skip}
        self.cache_hooks = {m: takes_cache(type(m)) for m in self.names}  # whose input hook snapshots the cache
        self.weights = {id(p) for p in model.parameters()} | {id(b) for b in model.buffers()}  # never an op's recorded input
        self.kinds = {m: module_kind(n, m) for m, n in self.names.items()}
        above = {".".join(n.split(".")[:i]) for m, n in self.names.items() if self.kinds[m] == "layer" for i in range(n.count(".") + 1)}
        self.holders = {m for m, n in self.names.items() if n in above}  # a decoder layer's ancestors (by name: one pass)
        # the cache layers a module's subtree reads (its attentions' layer_idx): all a lazy reference copies of the cache
        reads: dict[str, set[int]] = {}
        for m, n in self.names.items():
            if isinstance(i := vars(m).get("layer_idx"), int):
                for k in range(n.count(".") + 2):
                    reads.setdefault(".".join(n.split(".")[:k]), set()).add(i)
        self.reads = {m: reads.get(n, set()) for m, n in self.names.items()}
        self.result = Tap()
        self.stack: list[Any] = []  # modules entered and not yet left (innermost last)
        self.snaps: dict[int, dict] = {}  # id(module) -> cache snapshot taken as it was entered
        self.op_counts: Counter = Counter()
        self.busy = False  # inside a float64 re-evaluation: record nothing
        self.whole: list[str] = []  # ops whose row or positions could not be told apart: kept whole
        self.order = 0
        self.mode_on = False  # the ops' function mode is on the stack (hooks then run with modes off)
        self.end_ops: Any = None  # takes that mode off once ops_through has completed (core/taphooks.ops_mode)

    def recorded(self) -> set:
        """The modules whose completion a hook must see: all, except at layers_only without ops (the
        layer boundaries and `ops_through`) and without `inside_layers` (none inside a decoder layer
        but its attentions)."""
        if self.layers_only and not self.ops:
            return {m for m, n in self.names.items() if self.kinds[m] in LAYER_KINDS or n == self.ops_through}
        if not self.inside_layers and not self.ops:
            layers = {n for m, n in self.names.items() if self.kinds[m] == "layer"}
            return {m for m, n in self.names.items() if self.kinds[m] == "attention" or n == self.ops_through
                    or not any(".".join(n.split(".")[:i]) in layers for i in range(1, n.count(".") + 1))}
        return set(self.names)

    # -- forward -------------------------------------------------------------------------------
    def enter(self, module, args):
        """Every module's start (a global hook: modules outside the tree are not ours): the op names' stack."""
        if not self.busy and not self.result.ops_ended and module in self.names:
            self.stack.append(module)
        return None

    def pre(self, module, args, kwargs):
        """A module that may be handed the cache (`cache_hooks`): the K/V it holds as the module starts."""
        if self.busy:
            return None
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
        if name == self.ops_through:  # what follows it cannot hold the first op that differs (docs/locate.md)
            self.result.ops_ended = True
            if self.end_ops is not None:
                self.end_ops()
        if self.layers_only and kind not in LAYER_KINDS:
            return None
        out = first_tensor(output)
        if out is None:
            return None
        lazy = self.reference and self.lazy and module not in self.holders
        if lazy and self.reads[module]:  # the K/V of the layers its attentions read: not every layer's
            snap = {i: kv for i, kv in snap.items() if i in self.reads[module]}
        own = self._own((args, kwargs, snap)) if lazy else None  # each input copied once: its reference and its bytes
        tensors, names, shapes = self._inputs(module, args, kwargs, snap, kind, own)
        if self.window.in_pass_kv and kind == "attention":
            self._in_pass(module, args, kwargs, snap, tensors, names, shapes)
        rec = self._record(name, kind, out, tensors, names, shapes)
        if self.reference and rec is not None:
            if self.lazy and module in self.holders:  # never evaluated: holds nothing of the batch
                rec.reeval = self._later(rec, lambda: self._reference(module, (), {}, {}, None, rec))
            elif own is not None:
                rec.reeval = self._later(rec, lambda: self._reference(module, *own[0], None, rec, rowed=self._rowed()))
            else:
                self._reference(module, args, kwargs, snap, out, rec)
        return None

    def _inputs(self, module, args, kwargs, snap, kind, own: tuple | None = None) -> tuple[list, list, list]:
        """Each tensor input's name, shape (as the module saw it) and kept part: cut from the input
        itself, or, with `own` (_own's copies), from its copy, made numpy without a second copy."""
        import torch

        tensors, names, shapes = [], [], []
        (cargs, ckwargs, csnap), taken = own if own is not None else ((args, kwargs, snap), ())
        named = [(f"arg{i}", a, c) for i, (a, c) in enumerate(zip(args, cargs))] + [(k, v, ckwargs[k]) for k, v in kwargs.items()]
        for key, value, copy in named:
            parts = [(key, value, copy)] if isinstance(value, torch.Tensor) else (
                [(f"{key}.{i}", v, c) for i, (v, c) in enumerate(zip(value, copy)) if isinstance(v, torch.Tensor)]
                if isinstance(value, (tuple, list)) else [])
            for label, t, c in parts:
                shapes.append(tuple(t.shape))
                names.append(label)
                got = self.window.everywhere(c, id(c) in taken)[0] if "mask" in label else self.window.module(c, id(c) in taken)
                tensors.append(_view(got) if own is not None else got)
        layer_idx = getattr(module, "layer_idx", None)
        if kind == "attention" and layer_idx in snap:
            for label, t, c in zip(("past_keys", "past_values"), snap[layer_idx], csnap[layer_idx]):
                shapes.append(tuple(t.shape))
                names.append(label)
                cut = c[0 if id(c) in taken else self.window.row] if self.window.row is not None else c
                got = self.window.axis(cut, 1) if self.window.row is not None else cut
                tensors.append(_view(got) if own is not None else got)
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
        import numpy as np

        kept = cut if cut is not None else self.window.module(out)
        arr, dtype = _numpy(kept)
        arrays = [t if isinstance(t, np.ndarray) else _numpy(t)[0] for t in inputs] if self.keep_inputs else []
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

    def _rowed(self) -> bool:
        """Whether a lazy float64 reference keeps the window's row alone (rows are computed independently,
        and the batch has several): else the whole batch's inputs (ref_rows off: batch_invariant)."""
        w = self.window
        return self.lazy and self.ref_rows and w.row is not None and bool(w.batch) and w.batch > 1

    def _own(self, vals: tuple, op_rank: int | None = None) -> tuple[tuple, set[int]]:
        """What a lazy float64 reference holds until asked, copied now (nothing the model writes later
        reaches it) and once (the kept bytes are views of it): `vals`' tensors, weights by reference.
        Where `_rowed`, a tensor is cut to the window's row first (kept as a batch of one): a module's
        where its dim 0 is the batch (float64.one_row); an op's (`op_rank`: its output's rank, 0 when
        its dim 0 is not the batch) where float64.op_row cuts them. Returns (copies, ids of the cut ones)."""
        import torch

        w, n, taken = self.window, self.window.batch, set()
        if not self._rowed():
            cut = None
        elif op_rank is None:
            def cut(v):
                return v.ndim and v.shape[0] == n
        elif op_rank and op_row(vals[0], vals[1], op_rank, n, w.row, self.weights) is not None:
            def cut(v):
                return id(v) not in self.weights and v.ndim == op_rank and v.shape[0] == n
        else:
            cut = None

        def own(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                if cut is not None and cut(v):
                    c = v[w.row:w.row + 1].clone()
                    taken.add(id(c))
                    return c
                return v if id(v) in self.weights else v.clone()
            if isinstance(v, tuple):
                return tuple(own(x) for x in v)
            if isinstance(v, list):
                return [own(x) for x in v]
            return {k: own(x) for k, x in v.items()} if isinstance(v, dict) else v
        return tuple(own(v) for v in vals), taken

    def _reference(self, module, args, kwargs, snap, out, rec: Tapped, rowed: bool = False) -> None:
        import numpy as np
        import torch

        if module in self.holders:
            self.result.skipped_ref["holds the decoder layers (each layer is re-evaluated instead)"] += 1
            return
        self.busy = True  # the copy carries these hooks too: they record nothing meanwhile
        try:
            w, n = self.window, self.window.batch
            if rowed:  # cut to the row already (_own)
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
    def on_op(self, func, args, kwargs, out, op: str | None = None) -> None:
        import torch

        if self.busy or self.layers_only or self.result.bounded or self.result.ops_ended:
            return
        op = op or op_name(func)
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
        shape = tuple(tensor.shape)
        own = None
        if self.reference and self.lazy:  # each input copied once: its float64 reference and its bytes
            own = self._own((args, kwargs), len(shape) if shape and shape[0] == self.window.batch else 0)
            taken = own[1]
            views = [_view(self.window.everywhere(c, id(c) in taken)[0]) for a, c in zip(args, own[0][0])
                     if isinstance(a, torch.Tensor) and id(a) not in self.weights]
        else:
            views = [self.window.everywhere(a)[0] for a in ins]
        rec = self._record(name, op_kind(op, self.kinds.get(owner, "other")), tensor, views,
                           [f"arg{i}" for i in range(len(ins))], [tuple(a.shape) for a in ins], cut=cut)
        if rec is None:
            return
        if not clean:
            self.whole.append(name)
        if own is not None:  # rowed: op_row cut the row (the row's copy, not the batch)
            rec.reeval = self._later(rec, lambda: self._op_reference(func, *own[0], shape, None, rec, rowed=bool(own[1])))
        elif self.reference:
            self._op_reference(func, args, kwargs, tensor.shape, cut, rec)

    def _later(self, rec: Tapped, fn) -> Any:
        """A call that evaluates rec's float64 reference when asked (locate asks for the ops its rule
        judges), on the inputs `_own` copied while the forward ran."""
        def run() -> None:
            import torch

            rec.reeval = None
            with torch._C.DisableTorchFunction():
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


@contextmanager
def tap(model: Any, *, forward: bool = True, backward: bool = False, ops: bool = False, row: int | None = None,
        window: Window | None = None, reference: bool = False, max_bytes: int | None = None,
        layers_only: bool = False, keep_inputs: bool = True, params: bool = True,
        skip: tuple[str, ...] = ("",), ref_rows: bool = True, lazy_reference: bool = False,
        ops_through: str | None = None, inside_layers: bool = True) -> Iterator[Tap]:
    """Capture while the block runs: every named submodule's inputs and output (forward), each torch
    function's output (ops, forward only: F.linear, Tensor.__add__...), module and parameter
    gradients (backward), cut to `window` (or batch `row`). `reference`: each module and op
    re-evaluated in float64 on its own inputs (Tapped.ref_error; `ref_rows`: on the window's row
    only, where rows are computed independently). Past `max_bytes`, layer boundaries only (noted);
    `keep_inputs=False` keeps outputs only; `lazy_reference`: each record's `reeval` evaluates its
    float64 reference when called (on the inputs copied as the hooks ran); `ops_through`: no op recorded once the
    module of that name has completed (modules still are); `inside_layers=False` (without ops): of the
    modules inside a decoder layer, its attentions only (their cached K/V). The hooks are gone after the block.

        with taps.tap(model, forward=True, backward=True, row=None) as t:
            model(**batch).loss.backward()
        t.tensors  # Tapped records: phase "forward", "backward" (grad wrt output), "param_grad"
    """
    window = window or Window(row=row)
    tapper = _Tapper(model, window=window, ops=ops, reference=reference, max_bytes=max_bytes,
                     layers_only=layers_only, keep_inputs=keep_inputs, skip=skip, ref_rows=ref_rows,
                     lazy_reference=lazy_reference, ops_through=ops_through, inside_layers=inside_layers)
    with ExitStack() as stack:
        if backward:  # an embedding's integer input has no gradient: torch warns, nothing is wrong
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
        if forward:
            forward_hooks(stack, tapper, ops)
        if backward:
            for module in tapper.names:
                stack.callback(module.register_full_backward_hook(quietly(tapper.on_grad)).remove)
        if backward and params:
            for pname, p in model.named_parameters():
                if p.requires_grad:
                    owner = model.get_submodule(pname.rsplit(".", 1)[0]) if "." in pname else model
                    kind = tapper.kinds.get(owner, "other")
                    stack.callback(p.register_hook(quietly(lambda g, n=pname, k=kind: tapper.on_param_grad(n, k, g))).remove)
        if ops and forward:
            stack.enter_context(ops_mode(tapper))
        yield tapper.result
    if tapper.whole:
        tapper.result.notes.append(f"{len(tapper.whole)} op(s) kept whole, not cut to the row's real positions (no axis "
                                   f"of the batch, or a padded width equal to a feature size), e.g. {', '.join(tapper.whole[:3])}")
    for why, count in sorted(tapper.result.skipped_ref.items()):
        tapper.result.notes.append(f"float64 reference not evaluated for {count} module(s)/op(s): {why}")
