"""The vllm backend's capture (`detllm locate`): forward hooks installed on the in-process model
through `LLM.apply_model`, fired while the recorded batch is re-run, keeping the prompt's rows of
the one forward pass that yields token `spec.step`, under Hugging Face names (names.py).

vLLM flattens every sequence of a step into `[num_tokens, ...]`; the prompt's rows are
`query_start_loc[i]:query_start_loc[i+1]` of the forward context's attention metadata, where i is
the request's index in the model runner's input batch. Owns the hooks and the engine facts of the
re-run; running the batch is backend.py's, comparing captures is locate's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ...core.errors import BackendError, UsageError
from ...taps import LAYER_KINDS
from ..capture import UNCAPTURED_PREFIX, Capture, CapturedTensor, CaptureSpec
from . import grafting
from .names import ATTENTION_OP, Piece, Rule, rules
from .rows import Span, runner_of, spans
from .weights import HFWeights


@dataclass
class _Row:
    """Where the prompt's rows are in the forward pass being run (set by the root pre-hook)."""

    active: bool = False  # this forward yields the captured step's token for the prompt
    start: int = 0
    end: int = 0
    index: int = 0  # the request's index in the runner's input batch (the logits row)
    total: int = 0  # tokens in the whole forward (the flattened dim 0)
    positions: list[int] | None = None  # set when the rows are not every position of the step (a prefill's last chunk)


@dataclass
class _State:
    target_id: str  # the vLLM request id prefix of the prompt under test ("<counter>")
    target_pos: int  # the position of the last query token of the captured forward
    spec: CaptureSpec
    row: _Row = field(default_factory=_Row)
    done: bool = False
    tensors: list[CapturedTensor] = field(default_factory=list)
    snapshots: dict[int, list[Any]] = field(default_factory=dict)  # id(module) -> its inputs' rows, cloned before it ran
    steps: list[dict[str, Any]] = field(default_factory=list)  # the engine's schedule, one entry per forward
    notes: set[str] = field(default_factory=set)
    weights: HFWeights | None = None  # the model's files: linear weights vLLM's CPU build packed away
    span: Span | None = None  # the prompt's rows in the forward being run (any step)
    written: dict[int, list[tuple[int, Any, Any]]] = field(default_factory=dict)  # attention op -> (step, keys, values) it wrote
    cached: dict[int, list[int]] = field(default_factory=dict)  # attention op -> the step that wrote each cached position read
    nbytes: int = 0  # bytes of the arrays kept
    cached_prefix: int | None = None  # positions 0..n-1 of the prompt were read from the prefix cache, not computed here
    bounded: bool = False  # past spec.max_bytes: layer boundaries only


def _root_pre_hook(state: _State, runner: Any) -> Callable:
    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        state.row, state.span = _Row(), None
        found = None if state.done else spans(runner, args, kwargs)
        if found is None:
            return
        rows, total = found
        entry: dict[str, Any] = {"tokens": total, "requests": len(rows)}
        state.steps.append(entry)
        mine = [r for r in rows if r.req_id.split("-", 1)[0] == state.target_id]
        if not mine:
            return
        span = state.span = mine[0]
        entry["row_positions"] = [span.first, span.last]
        if state.cached_prefix is None:  # the prompt's first forward: a start past 0 is a prefix-cache hit
            state.cached_prefix = span.first
            if span.first > 0:
                entry["cached_prefix"] = span.first
                state.notes.add(f"the prompt's positions 0-{span.first - 1} came from the prefix cache (written before this "
                                f"batch ran): its prefill computed positions {span.first}-{span.last} only; an attention's "
                                "inputs (which include those cached K/V, not captured) are not kept, so no attention is blamed")
        if span.last == state.target_pos:
            chunked = span.first > 0 and state.spec.step == 0
            state.row = _Row(True, span.start, span.end, span.index, total,
                             list(range(span.first, span.last + 1)) if chunked else None)
            if chunked and state.cached_prefix != span.first:
                state.notes.add(f"the prompt's prefill ran in chunks; the last chunk (positions {span.first}-{span.last}) was captured")
    return hook


def _rows(state: _State, t: Any) -> Any:
    """The prompt's rows of a flattened tensor, copied (vLLM's fused norms work in place)."""
    r = state.row
    if t.dim() >= 1 and t.shape[0] == r.total:
        t = t[r.start:r.end]
    return t.detach().clone()


def _kept_whole(state: _State, piece: Piece, output: Any) -> bool:
    """Whether `piece`'s kept output holds rows of other requests: `_rows` cuts a tensor whose first
    axis is the forward's flattened tokens, the logits are cut by row, and a forward that held only
    the prompt's request (a wave of one, a prefill scheduled alone) has no other rows to keep."""
    r = state.row
    cut = piece.part == "logits" or (output.dim() >= 1 and output.shape[0] == r.total)
    return not cut and r.total > r.end - r.start


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, (tuple, list)) else out


def _pre_hook(state: _State, rule: Rule) -> Callable:
    part = rule.pieces[0].part
    attention = rule.pieces[0].name.endswith("/" + ATTENTION_OP)

    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        if attention and state.span is not None:
            _kv(state, module, args, kwargs)
        if not state.row.active:
            return
        if part == "logits":
            h = args[1] if len(args) > 1 else kwargs["hidden_states"]
            snap = [h[state.row.index:state.row.index + 1].detach().clone()]
        elif part == "layer":
            hidden = args[1] if len(args) > 1 else kwargs["hidden_states"]
            residual = args[2] if len(args) > 2 else kwargs.get("residual")
            snap = [_rows(state, hidden if residual is None else hidden + residual)]
        else:
            tensors = [a for a in (*args, *kwargs.values()) if _is_tensor(a)]
            if part != "plain" or "Embedding" not in type(module).__name__:
                tensors = [t for t in tensors if t.is_floating_point()]
            snap = [_rows(state, t) for t in tensors]
        state.snapshots[id(module)] = snap
    return hook


def _kv(state: _State, module: Any, args: tuple, kwargs: dict) -> None:
    """Keep the keys/values the prompt's rows write at each step before the captured one: the
    cached K/V the attention op reads at the captured step (its inputs past_keys/past_values)."""
    span = state.span
    assert span is not None
    written = state.written.setdefault(id(module), [])
    if state.row.active:
        state.cached[id(module)] = [step for step, k, _ in written for _ in range(k.shape[0])]
        return
    key = args[1] if len(args) > 1 else kwargs["key"]
    value = args[2] if len(args) > 2 else kwargs["value"]
    written.append((span.step or 0, key[span.start:span.end].detach().clone(), value[span.start:span.end].detach().clone()))


def _is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def _post_hook(state: _State, rule: Rule) -> Callable:
    def hook(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if not state.row.active:
            return
        inputs = state.snapshots.pop(id(module), [])
        shapes = [tuple(a.shape) for a in (*args, *kwargs.values()) if _is_tensor(a)]
        whole = _first(output)
        cached, past = _past(state, module)
        if past:
            inputs = [*inputs, *past]
            shapes += [tuple(p.shape) for p in past]
        for piece in rule.pieces:
            out, ins = _piece_output(state, piece, output, inputs)
            uncaptured = bool(state.cached_prefix) and piece.kind == "attention"
            if uncaptured:
                ins = []  # it also read the cached prefix's K/V, which no capture here holds: inputs not compared
            ref = _ref_error(state, module, rule, piece, ins, out) if state.spec.reference else None
            if state.bounded and piece.kind not in LAYER_KINDS:
                continue
            _keep(state, CapturedTensor(
                name=piece.name, kind=piece.kind, order=len(state.tensors), output=_numpy(state, out),
                inputs=[_numpy(state, i) for i in ins], input_shapes=shapes,
                output_shape=tuple(whole.shape[:-1]) + ((piece.hi - piece.lo,) if piece.hi else tuple(whole.shape[-1:])),
                ref_error=ref, dtype=str(out.dtype).replace("torch.", ""),
                input_names=[UNCAPTURED_PREFIX] if uncaptured else _input_names(piece, len(ins)),
                positions=[state.target_pos] if piece.part == "logits" else state.row.positions,
                whole=_kept_whole(state, piece, whole),
                cached_steps=cached, cached_from_step=min(cached) if cached else None))
        if rule.pieces[0].part == "logits":
            state.done = True
            state.row = _Row()
    return hook


def _past(state: _State, module: Any) -> tuple[list[int], list[Any]]:
    """(the step that wrote each cached position, [past_keys, past_values]) an attention record reads:
    vLLM's attention op as its own key/value layout [positions, kv_heads * head_dim]; the attention
    block (whose op is its `attn` child) as transformers' cache holds them, [kv_heads, positions, head_dim]."""
    import torch

    op = getattr(module, "attn", None)
    block = op is not None and hasattr(op, "attn_backend")
    written = state.written.get(id(op if block else module), [])
    if not written or (not block and id(module) not in state.cached):
        return [], []
    state.cached.pop(id(module), None)
    steps = [step for step, k, _ in written for _ in range(k.shape[0])]
    past = [torch.cat([kv[i] for kv in written]) for i in (1, 2)]
    if block:
        heads, dim = op.num_kv_heads, op.head_size
        past = [p.reshape(p.shape[0], heads, dim).transpose(0, 1).contiguous() for p in past]
    return steps, past


def _keep(state: _State, t: CapturedTensor) -> None:
    """Record `t` under the memory bound: past it, layer boundaries only from then on (and the
    records kept so far thinned to them), so the capture never holds much more than the bound."""
    size = t.output.nbytes + sum(i.nbytes for i in t.inputs)
    if not state.bounded and state.nbytes + size > state.spec.max_bytes:
        state.bounded = True
        state.tensors = [x for x in state.tensors if x.kind in LAYER_KINDS]
        state.nbytes = sum(x.output.nbytes + sum(i.nbytes for i in x.inputs) for x in state.tensors)
        state.notes.add(f"captured tensors passed the bound of {state.spec.max_bytes} bytes at {t.name}: layer boundaries "
                        f"only ({', '.join(LAYER_KINDS)}), every other module dropped")
        if t.kind not in LAYER_KINDS:
            return
    state.tensors.append(t)
    state.nbytes += size


def _input_names(piece: Piece, n: int) -> list[str]:
    """As transformers' modules are called: one positional input, HF's attention block by keyword."""
    if piece.name.endswith("/" + ATTENTION_OP):
        return ["query", "key", "value", "past_keys", "past_values"][:n]
    if piece.kind == "attention":
        return ["hidden_states", "past_keys", "past_values"][:n]
    return [f"arg{i}" for i in range(n)]


def _piece_output(state: _State, piece: Piece, output: Any, inputs: list[Any]) -> tuple[Any, list[Any]]:
    """The HF-named tensor `piece` of a module's output, and the HF module's inputs."""
    if piece.part == "logits":
        return output[state.row.index:state.row.index + 1].detach().clone(), inputs
    if piece.part == "layer":  # (hidden, residual): the residual add is deferred to the next norm
        hidden, residual = output
        return _rows(state, hidden + residual), inputs
    if piece.part == "norm" and isinstance(output, (tuple, list)):  # fused add-RMSNorm: (normed, x + residual)
        summed = _rows(state, output[1])
        return _rows(state, output[0]), [summed]
    out = _rows(state, _first(output))
    if piece.part == "linear":
        if isinstance(output, (tuple, list)) and output[1] is not None:  # skip_bias_add: HF's output has the bias
            out = out + output[1]
        if piece.hi:
            out = out[..., piece.lo:piece.hi].clone()
        return out, inputs[:1]
    return out, inputs


def _numpy(state: _State, t: Any) -> Any:
    import torch

    t = t.detach().cpu()
    if not t.is_floating_point():
        t = t.long()  # token ids as transformers holds them (int64), so the two sides' inputs compare bitwise
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: float32 holds every bf16 value exactly
        state.notes.add("bfloat16 tensors are kept as float32 (exact)")
        t = t.float()
    return t.numpy()


def _weight_of(state: _State, module: Any, piece: Piece) -> Any | None:
    """The weight rows `piece` computes with, as the engine holds them (its dtype): the module's
    own where vLLM kept it, else the HF tensor of that name from the model's files."""
    import torch

    own = getattr(module, "weight", None)
    if isinstance(own, torch.Tensor) and own.numel():
        return own.detach()[piece.lo:piece.hi] if piece.hi else own.detach()
    found = state.weights.get(piece.name + ".weight") if state.weights else None
    return found.to(own.dtype) if found is not None and isinstance(own, torch.Tensor) else found


def _ref_error(state: _State, module: Any, rule: Rule, piece: Piece, inputs: list[Any], out: Any) -> float | None:
    """max |out - the same computation in float64 on the captured inputs|, where it is one op."""
    import torch

    if not inputs:
        return None
    x, cls = inputs[0], type(module).__name__
    try:
        if piece.kind == "embedding" and not x.is_floating_point():
            ref = module.weight.detach()[x.long()].double()
        elif piece.part == "linear" and (w := _weight_of(state, module, piece)) is not None and w.is_floating_point():
            bias = getattr(module, "bias", None)
            if piece.hi and bias is not None:
                bias = bias[piece.lo:piece.hi]
            ref = x.double() @ w.double().T + (bias.detach().double() if bias is not None else 0)
        elif piece.part == "norm" and cls == "RMSNorm" and getattr(module, "has_weight", True):
            x = x.double()
            ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon) * module.weight.detach().double()
        elif cls == "SiluAndMul":
            g, u = x.double().chunk(2, dim=-1)
            ref = torch.nn.functional.silu(g) * u
        else:
            return None
    except (RuntimeError, IndexError):
        return None
    if tuple(ref.shape) != tuple(out.shape):
        return None
    return float((out.double() - ref).abs().max()) if out.numel() else 0.0


@dataclass
class Hooks:
    """Hooks installed on the engine's model; `remove()` restores the clean engine."""

    handles: list[Any] = field(default_factory=list)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def install(llm: Any, state: _State) -> Hooks:
    runner = runner_of(llm)

    def fn(model: Any) -> Hooks:
        hooks = Hooks()
        try:
            hooks.handles.append(model.register_forward_pre_hook(_root_pre_hook(state, runner), with_kwargs=True))
            for rule in rules(model):
                if state.spec.level == "layers" and rule.pieces[0].kind not in LAYER_KINDS:
                    continue
                module = model.get_submodule(rule.module)
                hooks.handles.append(module.register_forward_pre_hook(_pre_hook(state, rule), with_kwargs=True))
                hooks.handles.append(module.register_forward_hook(_post_hook(state, rule), with_kwargs=True))
            if state.spec.graft is not None:  # locate's graft (grafting.py): before the capture's own hooks
                hooks.handles += grafting.install(model, state)
        except Exception:
            hooks.remove()
            raise
        return hooks

    return llm.apply_model(fn)[0]


def check_spec(requests: Sequence[Any], spec: CaptureSpec, engine_facts: dict[str, Any]) -> None:
    """UsageError for a capture this batch and engine cannot give (row, filler, step, a compiled engine);
    shared by capture_batch and tpcapture.capture_batch_tp."""
    if not 0 <= spec.row < len(requests):
        raise UsageError(f"capture row {spec.row} is outside the batch of {len(requests)}")
    if requests[spec.row].is_filler:
        raise UsageError(f"capture row {spec.row} is a batch filler, not a prompt under test")
    if spec.step < 0:
        raise UsageError(f"capture step must be >= 0, got {spec.step}")
    if not engine_facts.get("enforce_eager", True):
        raise UsageError("vLLM capture needs an eager engine (compiled graphs and CUDA graphs skip module hooks)",
                         hint="--opt enforce_eager=true")


def capture_batch(llm: Any, requests: Sequence[Any], spec: CaptureSpec, run: Callable[[], list[Any]],
                  engine_facts: dict[str, Any]) -> Capture:
    """Re-run `requests` through `run` (the backend's one-batch generate, max_tokens = step + 1)
    with capture hooks on, keeping row `spec.row`'s tensors at step `spec.step`."""
    check_spec(requests, spec, engine_facts)
    prompt_len = len(requests[spec.row].input_ids)
    state = _State(target_id=str(llm.request_counter.counter + spec.row), target_pos=prompt_len + spec.step - 1, spec=spec,
                   weights=HFWeights(llm.llm_engine.vllm_config.model_config.model) if spec.reference else None)
    hooks = install(llm, state)
    try:
        generations = run()
    finally:
        hooks.remove()
    if not state.done:
        made = len(generations[spec.row].token_ids)
        raise BackendError(f"vLLM never ran step {spec.step} for prompt row {spec.row} (it generated {made} tokens)")
    grafting.note(state)
    tensors, level, notes = _bounded(state, spec)
    engine = dict(engine_facts, schedule=state.steps, captured_forward_tokens=state.steps[-1]["tokens"] if state.steps else None)
    return Capture(generations=generations, tensors=tensors, level=level, notes=sorted(state.notes) + notes, engine=engine)


def engine_facts(llm: Any, attention: str | None, perturbation: Any) -> dict[str, Any]:
    """How the engine runs a batch: what decides the rows and the kernels of the captured step."""
    vc = llm.llm_engine.vllm_config
    sched = vc.scheduler_config
    return {
        "dtype": str(vc.model_config.dtype).replace("torch.", ""),
        "enforce_eager": bool(vc.model_config.enforce_eager),
        "chunked_prefill": bool(sched.enable_chunked_prefill),
        "max_num_batched_tokens": int(sched.max_num_batched_tokens),  # tokens one step may hold (longer prefills chunk)
        "max_num_seqs": int(sched.max_num_seqs),
        "prefix_caching": bool(vc.cache_config.enable_prefix_caching),
        "async_scheduling": bool(sched.async_scheduling),
        "tensor_parallel_size": int(vc.parallel_config.tensor_parallel_size),
        "attention_backend": attention,
        "layout": "flattened [num_tokens, ...] across sequences; rows from query_start_loc",
        "kv_cache_dtype": str(vc.cache_config.cache_dtype),
        "perturb": str(perturbation) if perturbation is not None else None,
    }


def _bounded(state: _State, spec: CaptureSpec) -> tuple[list[CapturedTensor], str, list[str]]:
    notes = [
        "q_proj/k_proj/v_proj are column slices of vLLM's fused qkv_proj; gate_proj/up_proj of its gate_up_proj",
        "model.layers.N is vLLM's hidden + residual (the residual add vLLM defers into the next layer's fused add-RMSNorm)",
        "not captured: HF's mlp.act_fn (silu(gate) alone): vLLM fuses it with the multiply by up ('mlp/silu_and_mul')",
        "not captured: rotary embedding as a module (vLLM applies it per layer; its rotated q/k are the inputs of 'self_attn/attention')",
        "self_attn/attention's past_keys/past_values are the keys/values the prompt's rows wrote at the earlier steps of "
        "this re-run ([positions, kv_heads * head_dim], as computed, before the KV cache's own layout); self_attn's are "
        "the same in transformers' cache layout [kv_heads, positions, head_dim]",
        "lm_head is the logits of the captured step's last token only (vLLM computes no logits for other positions)",
    ]
    tensors, level = state.tensors, "layers" if spec.level == "layers" else "modules"
    if spec.level == "layers":
        notes.append("layer boundaries and logits only, as asked")
    elif spec.level == "ops":
        notes.append("ops were asked for: vLLM is captured at module level (its fused kernels as 'module/op' records), "
                     "not aten op by op")
    if state.bounded:
        level = "layers"
    if spec.backward:
        notes.append("backward hooks: vLLM runs inference only, no gradients were captured")
    for i, t in enumerate(tensors):
        t.order = i
    return tensors, level, notes


__all__ = ["Hooks", "capture_batch", "check_spec", "engine_facts", "install"]
