"""How a `detllm.taps` tap attaches to a module tree: which forward hooks it registers (one global
hook for the outputs, a module's own only where another hook there rewrites its output, the input
hook only where a cache can be handed), the torch function mode that names ops and when it leaves
the mode stack, and hooks that run with function modes off. What a hook records is taps'
(`_Tapper`, passed in and used by its methods only). torch is imported lazily.
"""

from __future__ import annotations

import functools
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

from .opkinds import _SKIP_OPS, op_name


@functools.lru_cache(maxsize=None)
def takes_cache(cls: type) -> bool:
    """Whether a module class's forward may be handed a transformers cache: it takes *args/**kwargs,
    or a parameter whose name says past, cache or kv (`past_key_values`, `layer_past`, `cache_position`)."""
    import inspect

    try:
        params = inspect.signature(cls.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read: assume it may
        return True
    return any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or any(w in p.name.lower() for w in ("past", "cache", "kv"))
               for p in params)


def quietly(fn, tapper: Any = None):
    """`fn` with torch function modes off: a hook's own tensor work (copies, the float64 copy's
    forward) is never taken for the model's ops. With `tapper`: only while its ops mode is on."""
    import torch

    disabled = torch._C.DisableTorchFunction

    def run(*args, **kwargs):
        if tapper is not None and not tapper.mode_on:
            return fn(*args, **kwargs)
        with disabled():
            return fn(*args, **kwargs)
    return run


def forward_hooks(stack: ExitStack, tapper: Any, ops: bool) -> None:
    """The forward hooks, as few as what is recorded needs (each costs the forward a Python call per
    module): the output of every module recorded, through one global hook, or, on a module that holds
    an output hook of its own as the tap is entered (a perturbation's, a graft's: global hooks run
    first), through a hook registered after it, so the record holds what it wrote; the input hook only
    where the input is needed before the module runs: the op names' module stack (ops, one hook for
    every module) and the cached K/V a module may be handed (`takes_cache`). With ops, each hook runs
    with torch function modes off (`quietly`); without, there is no mode to turn off."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    wrap = (lambda fn: quietly(fn, tapper)) if ops else (lambda fn: fn)
    post = wrap(tapper.post)
    cached = wrap(tapper.pre)
    recorded = tapper.recorded()
    plain = set()  # recorded modules with no output hook of their own: one global hook records them
    for module in recorded:
        if module._forward_hooks:  # a perturbation's or a graft's hook: ours runs after it (global hooks run first)
            stack.callback(module.register_forward_hook(post, with_kwargs=True).remove)
        else:
            plain.add(module)
        if tapper.cache_hooks.get(module):
            stack.callback(module.register_forward_pre_hook(cached, with_kwargs=True).remove)
    if plain:
        stack.callback(register_module_forward_hook(
            lambda module, args, kwargs, out: post(module, args, kwargs, out) if module in plain else None,
            with_kwargs=True).remove)
    if ops:  # the stack alone: a global hook (no kwargs) is a cheaper call than one per module
        stack.callback(register_module_forward_pre_hook(tapper.enter).remove)


@contextmanager
def ops_mode(tapper: Any) -> Iterator[None]:
    """The ops' function mode for the block, taken off the mode stack once `ops_through` has completed
    where it is the innermost mode: no op after it is recorded, and each torch function the rest of
    the forward calls would still pass through its Python. Balanced on exit either way."""
    import torch.overrides as overrides

    mode = _function_mode(tapper)
    with mode:
        tapper.mode_on = True

        def end() -> None:
            if overrides._get_current_function_mode() is mode:
                overrides._pop_mode()
                tapper.mode_on = False
        tapper.end_ops = end
        try:
            yield
        finally:
            tapper.end_ops = None
            if not tapper.mode_on:
                overrides._push_mode(mode)  # for `with mode` to take it off
            tapper.mode_on = False


def _function_mode(tapper: Any):
    """Ops seen at the torch function level (F.linear, Tensor.__add__, softmax...). Not a
    TorchDispatchMode: under one, aten.linear on a strided input took another kernel on CPU (torch
    2.13; the logits moved by 1e-5), and a capture must compute what the run computed, bit for bit."""
    import torch
    from torch.overrides import TorchFunctionMode

    known: dict[Any, tuple[str, bool]] = {}  # func -> (its name, whether it is recorded at all)

    class _Ops(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            seen = known.get(func)
            if seen is None:
                seen = known[func] = (op_name(func), op_name(func) not in _SKIP_OPS)
            if not seen[1] or tapper.result.ops_ended or tapper.busy:  # nothing to record: just run it
                return func(*args, **kwargs)
            inplace = seen[0].endswith("_") and args and isinstance(args[0], torch.Tensor)
            before = args[0].detach().clone() if inplace else None  # what an in-place op read
            out = func(*args, **kwargs)
            tapper.on_op(func, (before,) + tuple(args[1:]) if inplace else args, kwargs, out, seen[0])
            return out

    return _Ops()
