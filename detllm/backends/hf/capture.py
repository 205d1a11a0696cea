"""The hf backend's capture (`detllm locate`): re-run a recorded batch through the backend's own
decode loop (same left padding, positions and cache) for steps 0..s, with `detllm.taps` hooks
active at the forward of step s only, cut to the row under test and its real positions. Comparing
captures is locate's; the hooks are taps'; the loop is backend.py's, never a copy of it.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Sequence

from ...core import perturb
from ...core.clock import add, clock, since
from ...core.collector import heap_frozen
from ... import taps
from ...core.config import Decoding
from ...core.errors import BackendError, UsageError
from ..base import Capture, CapturedTensor, CaptureSpec, Request
from ..capture import CAPTURE_LEVELS


def check_spec(requests: Sequence[Request], decoding: Decoding, spec: CaptureSpec) -> None:
    """A spec this batch cannot honour is a UsageError (before anything runs)."""
    if spec.level not in CAPTURE_LEVELS[1:]:
        raise UsageError(f"capture level {spec.level!r} is unknown: one of {', '.join(CAPTURE_LEVELS[1:])}")
    if not 0 <= spec.row < len(requests):
        raise UsageError(f"capture row {spec.row} is not in a batch of {len(requests)}")
    if not 0 <= spec.step <= max(spec.step, spec.run_to or 0) < decoding.max_new_tokens:
        raise UsageError(f"capture step {spec.step} is past the {decoding.max_new_tokens} tokens the run generates")
    if spec.max_bytes <= 0:
        raise UsageError(f"capture bound {spec.max_bytes} bytes must be positive")


def window(model: Any, requests: Sequence[Request], spec: CaptureSpec) -> taps.Window:
    """The row under test at step s: left padding puts its real positions last; at a decode step
    the keys are the width so far (real: prompt + s) and the cache one shorter."""
    width = max(len(r.input_ids) for r in requests)
    real = len(requests[spec.row].input_ids)
    s = spec.step
    cuts = {width: real} if s == 0 else {width + s: real + s, width + s - 1: real + s - 1}
    cfg = model.config
    fixed = {int(d) for p in model.parameters() for d in p.shape}
    heads = {int(v) for k in ("num_attention_heads", "num_key_value_heads") if isinstance(v := getattr(cfg, k, None), int)}
    head_dim = getattr(cfg, "head_dim", None)
    fixed |= heads | ({head_dim} if isinstance(head_dim, int) else set())
    return taps.Window(row=spec.row, batch=len(requests), cuts=cuts, fixed=frozenset(fixed), heads=frozenset(heads),
                       in_pass_kv=spec.in_pass_kv and s == 0)


def capture(backend: Any, requests: Sequence[Request], decoding: Decoding, *, seed: int, n_logprobs: int,
            spec: CaptureSpec) -> Capture:
    """Backend.capture for hf. Run it inside `backend.determinism(...)` as the run was (seed, threads)."""
    check_spec(requests, decoding, spec)
    with heap_frozen():  # its records are long-lived: no full collection walks the model's objects meanwhile
        return _capture(backend, requests, decoding, seed=seed, n_logprobs=n_logprobs, spec=spec)


def _capture(backend: Any, requests: Sequence[Request], decoding: Decoding, *, seed: int, n_logprobs: int,
             spec: CaptureSpec) -> Capture:
    import torch

    notes: list[str] = []
    found: dict[str, taps.Tap] = {}
    cut = window(backend.model, requests, spec)

    timed: dict[str, Any] = {}

    def at(step: int):
        if step != spec.step or timed.get("bare"):
            return nullcontext()
        tap = _tap_into(found, taps.tap(backend.model, window=cut, ops=spec.level == "ops", reference=spec.reference,
                                        max_bytes=spec.max_bytes, layers_only=spec.level == "layers", lazy_reference=True,
                                        ops_through=spec.ops_through if spec.level == "ops" else None,
                                        inside_layers=not (spec.guide and spec.level == "modules"),
                                        ref_rows=not backend.options.batch_invariant))  # its attention reads every row's start
        return tap if spec.graft is None else _grafting(found, backend.model, cut, spec.graft, tap)

    if spec.time_bare:
        _primed(backend, torch)
    start = clock()
    try:
        with torch.inference_mode(), perturb.applied(backend.model, backend.perturbation) as moved:
            gens = backend._generate(torch, requests, decoding, seed, n_logprobs, True,
                                     at_step=backend.stepper(moved, at), steps=max(spec.step, spec.run_to or 0) + 1,
                                     timed=timed if spec.time_bare else None)
    except RuntimeError as exc:
        raise BackendError(f"transformers failed while capturing: {str(exc).splitlines()[0][:300]}") from exc
    tap = found.get("tap")
    seconds = {"reference": [0.0, 0.0]}  # float64 evaluated later, on demand (each record's reeval adds to it)
    if tap is None:
        notes.append(f"every sequence stopped before step {spec.step}: nothing was captured")
        tensors: list[CapturedTensor] = []
    else:
        post = clock()
        tensors = [_captured(t, len(requests[spec.row].input_ids), spec.step) for t in tap.tensors]
        for tapped, t in zip(tap.tensors, tensors):
            t.reeval = tapped.reeval and _on_demand(backend, spec.step, tapped, t, seconds["reference"])
        notes.extend(tap.notes)
        if spec.reference:
            notes.append("float64 reference evaluated on demand: for the ops the root-cause rule and the graft judge")
        timed["post"] = since(post)
    bare = timed.pop("bare_forward", None)
    seconds["captured"] = add(since(start), [-v for v in bare] if bare else None)
    if bare and "forward" in timed:  # the re-run less what the capture added at step s: its forward's hooks, the records
        seconds["bare"] = add(add(seconds["captured"], [-v for v in add(timed["forward"], timed.get("post"))]), bare)
    row_gen = gens[spec.row]
    if len(row_gen.token_ids) <= spec.step and tap is not None:
        notes.append(f"row {spec.row} stopped (end of sequence) at step {len(row_gen.token_ids) - 1}: at step "
                     f"{spec.step} it is fed padding, and what was captured is that")
    if "graft" in found:
        g = found["graft"]
        notes.append(f"grafted {spec.graft.name}: written {g['done']} time(s)" + (f"; not written: {g['why']}" if g["why"] else "")
                     + (f"; into {g['trimmed']}" if g.get("trimmed") else ""))
    if spec.warm_up:
        notes.append("hf keeps no cache across batches: the warm-up batches were not run (nothing to warm)")
    if spec.backward:
        notes.append("gradients not captured: capture re-runs inference; detllm.taps.tap(backward=True) serves training")
    level = spec.level
    if tap is not None and (tap.bounded or spec.level == "layers"):
        level = "layers"
    if spec.level == "ops" and backend.options.batch_invariant:
        notes.append("batch_invariant runs attention one sequence at a time: how many attention ops a step has depends "
                     "on the batch, so compare attention at the module level")
    if spec.guide and spec.level == "modules":
        notes.append("a guide: inside each decoder layer only its attentions were captured (an ops capture follows)")
    if spec.level != "ops":
        notes.append("ops (torch functions) not captured (level 'ops' asks for them)")
    elif spec.ops_through is not None and tap is not None:
        notes.append(f"ops captured until {spec.ops_through} completed" + ("" if tap.ops_ended else " (it never did: every op)")
                     + "; after it, modules only")
    return Capture(generations=gens, tensors=tensors, level=level, notes=notes, engine=_facts(backend, torch), seconds=seconds)


def _primed(backend: Any, torch: Any) -> None:
    """Before the first timed capture of a loaded model: one token through it, untimed and dropped. A
    process's first forward pays a one-time set-up (~30 ms on smollm2-135m here: thread pools, the
    allocator, kernel choice) that is neither the capture's cost nor the re-run's; unprimed, it fell
    on the captured forward, which runs before the bare one. No cache, no perturbation: nothing of it
    reaches a later forward's numbers (tests/test_hf_capture.py::test_the_prime_before_a_timed_capture_changes_no_bit)."""
    if getattr(backend, "_primed", False):
        return
    with torch.inference_mode():
        backend.model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=backend.device), use_cache=False)
    backend._primed = True


def _on_demand(backend: Any, step: int, tapped: taps.Tapped, t: CapturedTensor, spent: list[float]) -> Any:
    """A record's float64 reference, evaluated when locate asks: with the run's perturbation applied
    again as at `step` (a weight edited, an output hook: the float64 copy sees what the run saw),
    its time added to `spent` ([wall, cpu])."""
    def run() -> None:
        import torch

        start, t.reeval = clock(), None
        with heap_frozen(), torch.inference_mode(), perturb.applied(backend.model, backend.perturbation) as moved:
            if moved is not None:
                moved.step = step
            tapped.reeval()
        t.ref_error = tapped.ref_error
        spent[:] = add(spent, since(start))
    return run


@contextmanager
def _grafting(found: dict, model: Any, cut: taps.Window, graft: Any, tap: Any):
    """The graft and the tap at step s: a module's graft before the tap (the tap sees the grafted
    output), an op's inside it (the op's record keeps what this side computed; its consumers read
    the graft)."""
    from ..grafthook import grafted

    if "/" in graft.name:
        with tap, grafted(model, cut, graft) as found["graft"]:
            yield
    else:
        with grafted(model, cut, graft) as found["graft"], tap:
            yield


class _tap_into:
    """Enter a tap and keep what it yields in `found` (the loop sees only a context manager)."""

    def __init__(self, found: dict, cm: Any) -> None:
        self.found, self.cm = found, cm

    def __enter__(self):
        self.found["tap"] = self.cm.__enter__()
        return self.found["tap"]

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc)


def _captured(t: taps.Tapped, prompt_len: int, step: int) -> CapturedTensor:
    rec = CapturedTensor(name=t.name, kind=t.kind, order=t.order, output=t.output, inputs=t.inputs,
                         input_shapes=t.input_shapes, output_shape=t.output_shape, ref_error=t.ref_error,
                         input_names=t.input_names, dtype=t.dtype, phase=t.phase)
    if "past_keys" in t.input_names:
        rec.cached_from_step = 0  # the prefill wrote the prompt's positions; decode step j wrote position prompt + j - 1
        rec.cached_steps = [0] * prompt_len + list(range(1, step))
    return rec


def _facts(backend: Any, torch: Any) -> dict[str, Any]:
    from importlib import metadata

    return {
        "name": "hf", "transformers": metadata.version("transformers"), "torch": torch.__version__,
        "dtype": str(backend.model.dtype).replace("torch.", ""), "device": backend.device,
        "threads": torch.get_num_threads(), "attn_implementation": backend.options.attn_implementation,
        "padding_side": backend.tokenizer.padding_side, "batch_invariant": backend.options.batch_invariant,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "perturb": backend.options.perturb,  # as given (--opt perturb=...); None: none
    }
