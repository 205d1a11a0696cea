"""The graft of `detllm locate` on a torch module tree: while the captured step runs, overwrite ONE
module's or ONE torch op's output, for the row under test and its real positions only, with the
value the other side computed there (the causal test: does the divergence go away?). The hooks
only, in place; which op to graft and what the grafted re-run shows are locate's (locate/graft.py).
Ops are named as `detllm.taps` names them ("path/torch.linear#0"). torch is imported lazily.
"""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

from ..core.errors import UsageError
from ..core.float64 import first_tensor
from ..taps import _SKIP_OPS, Window, op_name
from .capture import Graft


@contextmanager
def grafted(model: Any, window: Window, graft: Graft) -> Iterator[dict[str, Any]]:
    """Overwrite `graft.name`'s output at `window` with `graft.value` (numpy, the window's shape) for
    the block. Yields a dict: `done` (times written), `why` (why it could not be, if so), `trimmed`
    (where the two differ in positions, a prefill against a decode: the trailing ones written). Enter it
    before a tap of modules (the tap then sees the grafted output) and after a tap of ops (an op's
    record keeps what this side computed; its consumers read the grafted value)."""
    import torch

    path, _, op = graft.name.partition("/")
    names = {m: n for n, m in model.named_modules() if n}
    target = next((m for m, n in names.items() if n == path), None)
    if target is None:
        raise UsageError(f"graft: the model has no module {path!r}")
    state: dict[str, Any] = {"done": 0, "why": None, "trimmed": None}

    def write(out: Any) -> None:
        with torch._C.DisableTorchFunction():  # the write is not one of the model's ops
            t = first_tensor(out)
            if t is None:
                state["why"] = "its output holds no tensor"
                return
            view, clean = (window.module(t), True) if not op else window.everywhere(t)
            value = torch.as_tensor(graft.value).to(t.dtype)
            whole = list(view.shape)
            if clean and tuple(view.shape) != tuple(value.shape):  # prefill vs decode: the positions compared (align.trailing)
                view, value = _trailing(view, value)
            if not clean or tuple(view.shape) != tuple(value.shape):
                state["why"] = (f"this side's row there is {list(view.shape)}, the other side's {list(value.shape)}"
                                if clean else "its row and positions cannot be told apart (kept whole)")
                return
            if list(view.shape) != whole:
                state["trimmed"] = f"{list(view.shape)} of this side's {whole} (the trailing positions both sides computed)"
            view.copy_(value)
            again = window.module(t) if not op else window.everywhere(t)[0]
            if state["trimmed"]:
                again = _trailing(again, value)[0]
            if not torch.equal(again, value):  # the cut was a copy, not a view: nothing reached the tensor
                state["why"] = "its row is not a view of the tensor (a reshape copied it)"
                return
            state["done"] += 1

    with ExitStack() as stack:
        if not op:
            def hook(module, args, out):
                if module is target:  # taps' float64 copy carries the hook too: never graft into it
                    write(out)
            stack.callback(target.register_forward_hook(hook).remove)
        else:
            stack.enter_context(_op_graft(torch, names, target, op, write))
        yield state


def _trailing(view: Any, value: Any) -> tuple[Any, Any]:
    """Both over their common trailing extent in each axis (as locate's align.trailing compares them:
    a decode's one position against a prefill's last), or unchanged where their ranks differ."""
    while value.ndim > view.ndim and value.shape[0] == 1:
        value = value[0]
    if value.ndim != view.ndim:
        return view, value
    for dim, (n, m) in enumerate(zip(view.shape, value.shape)):
        k = min(n, m)
        view, value = view.narrow(dim, n - k, k), value.narrow(dim, m - k, k)
    return view, value


def _op_graft(torch: Any, names: dict, target: Any, op: str, write) -> Any:
    """A torch function mode that counts `op` while `target` is the innermost named module (taps'
    naming) and writes the graft into its k-th output."""
    from torch.overrides import TorchFunctionMode

    fn, _, k = op.rpartition("#")
    fn = fn.removeprefix("torch.")
    stack: list[Any] = []
    counts: Counter = Counter()

    def pre(module, args):
        stack.append(module)

    def post(module, args, out):
        if stack and stack[-1] is module:
            stack.pop()

    class _Graft(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = op_name(func)
            t = first_tensor(out)
            if (name == fn and stack and stack[-1] is target and name not in _SKIP_OPS and t is not None
                    and t.is_floating_point() and t.numel()):
                counts[name] += 1
                if counts[name] - 1 == int(k):
                    write(out)
            return out

    es = ExitStack()
    for m in names:
        es.callback(m.register_forward_pre_hook(pre).remove)
        es.callback(m.register_forward_hook(post).remove)
    es.enter_context(_Graft())
    return es
