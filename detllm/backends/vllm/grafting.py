"""locate's graft on the in-process vLLM engine (modules, tensor_parallel_size=1): while the captured
forward runs, overwrite ONE Hugging Face-named module's output, for the prompt's rows only (every
position at the prefill, the one new position at a decode step), with the value the other side
captured there, through a forward hook on the vLLM module that computes it (names.py). The hook only;
where the rows are is the capture's root hook's (capture.py), what the grafted re-run shows is locate's.
"""

from __future__ import annotations

from typing import Any, Callable

from .names import find_piece, rules


def install(model: Any, state: Any) -> list[Any]:
    """Hook the module computing `state.spec.graft.name` (prepended: the capture's own hooks see the
    grafted output; a test-only output perturbation, prepended later, is overwritten by it). Returns
    the handles. Where it cannot be grafted, `state.notes` says why and nothing is installed."""
    graft = state.spec.graft
    head = f"grafted {graft.name}: written 0 time(s); not written: "
    found = None if "/" in graft.name else find_piece(rules(model), graft.name)
    if found is None:
        why = ("a vLLM-only op: vLLM is grafted at module level" if "/" in graft.name else
               "vLLM computes no module of that name separately")
        state.notes.add(head + why)
        return []
    rule, piece = found
    if piece.part == "logits":
        state.notes.add(head + "the logits are the end of the forward: grafting them proves nothing")
        return []
    done = {"n": 0, "why": ""}
    handle = model.get_submodule(rule.module).register_forward_hook(_hook(state, piece, graft.value, done), prepend=True)
    state.graft_done = done
    return [handle]


def note(state: Any) -> None:
    """The line locate reads: how many times the graft was written (and why not, if it was not)."""
    done = getattr(state, "graft_done", None)
    if done is not None:
        state.notes.add(f"grafted {state.spec.graft.name}: written {done['n']} time(s)" + (f"; not written: {done['why']}" if done["why"] else ""))


def _hook(state: Any, piece: Any, value: Any, done: dict) -> Callable:
    def hook(module: Any, args: tuple, output: Any) -> None:
        import torch

        r = state.row
        if not r.active:
            return None
        first = output[0] if isinstance(output, (tuple, list)) else output
        if piece.part == "linear" and isinstance(output, (tuple, list)) and len(output) > 1 and output[1] is not None:
            done["why"] = "its bias is added after the module (skip_bias_add): the HF output is not one tensor here"
            return None
        if first.dim() < 1 or first.shape[0] != r.total:
            done["why"] = f"its output {list(first.shape)} is not flattened over the forward's {r.total} tokens"
            return None
        rows = first[r.start:r.end]
        if piece.hi:
            rows = rows[..., piece.lo:piece.hi]
        v = torch.as_tensor(value).to(device=first.device, dtype=first.dtype)
        if tuple(rows.shape) != tuple(v.shape):
            done["why"] = f"this side's rows there are {list(rows.shape)}, the other side's {list(v.shape)}"
            return None
        rows.copy_(v)
        if piece.part == "layer":  # (hidden, residual), HF's output their sum: hidden := value, residual := 0 (exact)
            output[1][r.start:r.end].zero_()
        done["n"] += 1
        return None
    return hook


__all__ = ["install", "note"]
