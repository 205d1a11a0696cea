"""The vllm backend's capture at tensor_parallel_size > 1: capture.py's hooks installed in every
worker process through `LLM.collective_rpc`, each rank keeping its shard of the prompt's rows, handed
back after the re-run and put together by unshard.py. Owns what runs in the workers (install,
collect) and what each rank says of its layout (column- or row-parallel, per-rank cuts, K/V head
replicas, the row-parallel partial products before the all-reduce). Comparing captures is locate's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from ...core.errors import BackendError, BackendUnavailableError
from ...taps import LAYER_KINDS
from ..capture import Capture, CaptureSpec
from . import capture as single
from .names import Piece, Rule, rules
from .unshard import unshard

_LIVE: dict[str, Any] = {}  # in a worker process: the capture in progress ("state", "hooks", "partials", "layout")


def _layout(rule: Rule, module: Any) -> dict[str, Any]:
    """How `module`'s call is split across the ranks (the same on every rank): 'column' (each rank
    computes some output columns from the whole input), 'row' (each rank reads some input columns,
    its partial products are summed by an all-reduce), 'heads' (attention over this rank's heads),
    'act' (SiluAndMul over this rank's gate|up columns), else 'replicated'."""
    cls = type(module).__name__
    out: dict[str, Any] = {"class": cls, "pieces": [p.name for p in rule.pieces]}
    if cls == "RowParallelLinear" or (hasattr(module, "input_is_parallel") and hasattr(module, "reduce_results")):
        out.update(split="row", reduced=bool(getattr(module, "reduce_results", True)))
    elif hasattr(module, "output_partition_sizes") and hasattr(module, "gather_output"):
        out.update(split="column", kv_replicas=int(getattr(module, "num_kv_head_replicas", 1)))
    elif cls == "SiluAndMul":
        out.update(split="act")
    elif rule.pieces[0].name.endswith("/" + single.ATTENTION_OP):
        out.update(split="heads", kv_heads=int(module.num_kv_heads), head_size=int(module.head_size))
    elif rule.pieces[0].kind == "attention" and hasattr(getattr(module, "attn", None), "attn_backend"):
        out.update(split="block")  # the attention block: hidden in, o_proj's reduced output out; its cache is per rank
    else:
        out.update(split="replicated")
    return out


def _rank_rules(model: Any) -> list[Rule]:
    """names.rules with each fused linear cut by this rank's partition sizes (names.py cuts by the
    full output_sizes, which at TP > 1 is every rank's columns together)."""
    out = []
    for rule in rules(model):
        module = model.get_submodule(rule.module)
        parts = getattr(module, "output_partition_sizes", None)
        if len(rule.pieces) > 1 and parts and len(parts) == len(rule.pieces):
            lo, pieces = 0, []
            for piece, size in zip(rule.pieces, parts):
                pieces.append(dataclasses.replace(piece, lo=lo, hi=lo + int(size)))
                lo += int(size)
            rule = dataclasses.replace(rule, pieces=tuple(pieces))
        out.append(rule)
    return out


def _partial_hooks(module: Any, name: str) -> list[Any]:
    """On a row-parallel linear: keep this rank's partial product (its input columns times its
    weight rows, plus the bias on the rank that adds it), computed again by the module's own kernel
    on the whole input it was called with, before the all-reduce sums the ranks' partials."""
    held: dict[str, Any] = {}

    def pre(mod: Any, args: tuple, kwargs: dict) -> None:
        if _LIVE["state"].row.active:
            held["x"] = (args[0] if args else kwargs["input_"]).detach().clone()

    def post(mod: Any, args: tuple, kwargs: dict, output: Any) -> None:
        x = held.pop("x", None)
        if x is None:
            return
        bias = None if (mod.tp_rank > 0 or mod.skip_bias_add) else mod.bias
        partial = mod.quant_method.apply(mod, x, bias)
        _LIVE["partials"][name] = single._rows(_LIVE["state"], partial).cpu().numpy()

    return [module.register_forward_pre_hook(pre, with_kwargs=True), module.register_forward_hook(post, with_kwargs=True)]


def install_in_worker(worker: Any, target_id: str, target_pos: int, spec: CaptureSpec) -> dict[str, Any]:
    """Runs in each worker (collective_rpc passes it): capture.py's hooks on this rank's model."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    runner = worker.model_runner
    model = runner.get_model()
    state = single._State(target_id=target_id, target_pos=target_pos, spec=spec)
    hooks = single.Hooks()
    layout: dict[str, dict[str, Any]] = {}
    if _LIVE:  # an earlier capture that never collected (its install failed on another rank): its hooks go first
        _LIVE["hooks"].remove()
    _LIVE.clear()
    _LIVE.update(state=state, hooks=hooks, partials={}, layout=layout)
    try:
        hooks.handles.append(model.register_forward_pre_hook(single._root_pre_hook(state, runner), with_kwargs=True))
        for rule in _rank_rules(model):
            if spec.level == "layers" and rule.pieces[0].kind not in LAYER_KINDS:
                continue
            module = model.get_submodule(rule.module)
            hooks.handles.append(module.register_forward_pre_hook(single._pre_hook(state, rule), with_kwargs=True))
            hooks.handles.append(module.register_forward_hook(single._post_hook(state, rule), with_kwargs=True))
            layout[rule.module] = _layout(rule, module)
            if layout[rule.module]["split"] == "row":
                hooks.handles.extend(_partial_hooks(module, rule.pieces[0].name))
    except Exception:
        hooks.remove()
        _LIVE.clear()
        raise
    return {"rank": get_tensor_model_parallel_rank(), "world": get_tensor_model_parallel_world_size()}


def collect_in_worker(worker: Any) -> dict[str, Any]:
    """Runs in each worker: remove the hooks and hand back this rank's capture (empty when none)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    if not _LIVE:
        return {"rank": get_tensor_model_parallel_rank(), "done": False, "tensors": [], "notes": [], "steps": [],
                "layout": {}, "partials": {}}
    state, hooks = _LIVE["state"], _LIVE["hooks"]
    hooks.remove()
    found = {"rank": get_tensor_model_parallel_rank(), "done": state.done, "tensors": state.tensors, "notes": sorted(state.notes),
             "steps": state.steps, "layout": _LIVE["layout"], "partials": _LIVE["partials"], "bounded": state.bounded}
    _LIVE.clear()
    return found


def capture_batch_tp(llm: Any, requests: Sequence[Any], spec: CaptureSpec, run: Callable[[], list[Any]],
                     engine_facts: dict[str, Any]) -> Capture:
    """capture.capture_batch for an engine whose layers run in tensor_parallel_size worker processes:
    hooks on every rank, the ranks' shards put back together into full tensors under HF names."""
    single.check_spec(requests, spec, engine_facts)
    if spec.graft is not None:
        raise BackendUnavailableError("grafting under tensor parallelism is not supported (each rank holds a shard)",
                                      hint="locate with --graft off")
    tp = int(engine_facts["tensor_parallel_size"])
    target_id = str(llm.request_counter.counter + spec.row)
    target_pos = len(requests[spec.row].input_ids) + spec.step - 1
    # each rank keeps its shard; the float64 reference is evaluated on the full tensors, after unsharding
    rank_spec = dataclasses.replace(spec, reference=False, max_bytes=max(1, spec.max_bytes // tp), warm_up=())
    try:
        llm.collective_rpc(install_in_worker, args=(target_id, target_pos, rank_spec))
        generations = run()
    finally:
        ranks = sorted(llm.collective_rpc(collect_in_worker), key=lambda r: r["rank"])
    if not all(r["done"] for r in ranks):
        made = len(generations[spec.row].token_ids)
        raise BackendError(f"vLLM never ran step {spec.step} for prompt row {spec.row} on every rank (it generated {made} tokens)")
    folder = llm.llm_engine.vllm_config.model_config.model
    tensors, notes, facts = unshard(ranks, folder if spec.reference else None)
    state = single._State(target_id=target_id, target_pos=target_pos, spec=spec, tensors=tensors,
                          bounded=any(r["bounded"] for r in ranks))
    tensors, level, base = single._bounded(state, spec)
    steps = ranks[0]["steps"]
    engine = dict(engine_facts, schedule=steps, captured_forward_tokens=steps[-1]["tokens"] if steps else None,
                  tensor_parallel=facts)
    rank_notes = sorted({n for r in ranks for n in r["notes"]})
    return Capture(generations=generations, tensors=tensors, level=level, notes=rank_notes + base + notes, engine=engine)


__all__ = ["capture_batch_tp", "collect_in_worker", "install_in_worker"]
