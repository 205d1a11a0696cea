"""detllm.taps and detllm.core.perturb on the built-in tiny model through real transformers: what a tap
captures (names, kinds, shapes, order, ops, float64 references, the bound, gradients) and the
test-only perturbation (its parser, and that the perturbed module is where the capture first moves)."""

from __future__ import annotations

import numpy as np
import pytest

from detllm import taps
from detllm.core import perturb
from detllm.core.errors import UsageError

pytestmark = pytest.mark.engine

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tiny():
    from detllm.backends.hf import HFBackend

    b = HFBackend("tiny")
    return b.model, b.tokenize(PROMPT)


def _forward(model, ids, **kw):
    import torch

    with torch.inference_mode():
        with taps.tap(model, row=0, **kw) as t:
            logits = model(input_ids=torch.tensor([ids])).logits
    return t, logits


@pytest.fixture(scope="module")
def plain(tiny):
    model, ids = tiny
    return _forward(model, ids, reference=True)


def test_every_module_is_captured_in_execution_order_with_its_kind_and_shapes(tiny, plain):
    model, ids = tiny
    t, _ = plain
    names = [r.name for r in t.tensors]
    assert set(names) == {n for n, m in model.named_modules() if n and n != "model.layers"}  # the ModuleList never runs
    assert [r.order for r in t.tensors] == list(range(len(names)))
    assert names.index("model.layers.0.mlp.down_proj") < names.index("model.layers.0.mlp") < names.index("model.layers.0")
    assert names.index("model.layers.0") < names.index("model.layers.1.input_layernorm") and names[-1] == "lm_head"
    kinds = {r.name: r.kind for r in t.tensors}
    assert kinds["model.embed_tokens"] == "embedding" and kinds["model.rotary_emb"] == "rotary"
    assert kinds["model.layers.1.input_layernorm"] == "norm" and kinds["model.norm"] == "norm"
    assert kinds["model.layers.0.self_attn.q_proj"] == "gemm" and kinds["lm_head"] == "logits"
    assert kinds["model.layers.0.self_attn"] == "attention" and kinds["model.layers.0.mlp.act_fn"] == "activation"
    assert kinds["model.layers.1"] == "layer" and kinds["model.layers.0.mlp"] == "other"
    rec = t.by_name()["model.layers.1.mlp.down_proj"]
    L = len(ids)
    assert rec.output_shape == (1, L, 128) and rec.output.shape == (L, 128) and rec.output.dtype == np.float32
    assert rec.input_shapes == [(1, L, 256)] and rec.inputs[0].shape == (L, 256) and rec.dtype == "float32"
    attn = t.by_name()["model.layers.0.self_attn"]
    assert attn.input_names[0] == "hidden_states" and "attention_mask" in attn.input_names


def test_the_capture_is_the_forward_itself(tiny, plain):
    t, logits = plain
    assert np.array_equal(t.by_name()["lm_head"].output, logits[0].numpy())  # bitwise the logits returned


def test_float64_reference_is_small_finite_and_present_for_each_module(plain):
    t, _ = plain
    for r in t.tensors:
        if r.name == "model":  # holds the decoder layers: its layers are evaluated instead (noted)
            assert r.ref_error is None
            continue
        assert r.ref_error is not None and np.isfinite(r.ref_error), r.name
        assert r.ref_error <= 1e-5 * max(1.0, float(np.abs(r.output).max())) * 10, (r.name, r.ref_error)
    # a float32 GEMM is not exact in float64 terms: the reference sees rounding, not zero
    assert t.by_name()["model.layers.0.mlp.down_proj"].ref_error > 0
    assert any("holds the decoder layers" in n for n in t.notes)


def test_ops_level_names_each_op_under_its_innermost_module_and_changes_no_bit(tiny, plain):
    model, ids = tiny
    t, logits = _forward(model, ids, ops=True, reference=True)
    assert np.array_equal(logits.numpy(), plain[1].numpy())  # observing the ops computes exactly what ran
    names = [r.name for r in t.tensors]
    assert "model.layers.0.mlp.down_proj/torch.linear#0" in names and "model.layers.0.input_layernorm/torch.rsqrt#0" in names
    assert names.index("model.layers.0.mlp.down_proj/torch.linear#0") < names.index("model.layers.0.mlp.down_proj")
    softmax = [r for r in t.tensors if r.name.startswith("model.layers.1.self_attn/torch.") and r.kind == "softmax"]
    assert softmax and softmax[0].output.shape == (2, len(ids), len(ids))  # heads x query x key, the row's
    residual = [r.name for r in t.tensors if r.kind == "residual"]
    assert residual[:2] == ["model.layers.0/torch.add#0", "model.layers.0/torch.add#1"]
    assert not [n for n in names if "/torch.to#" in n and n.startswith("model.layers.0.self_attn.")]  # the hooks' own work unseen
    for r in t.tensors:
        if "/torch." in r.name and r.kind in ("gemm", "softmax", "norm"):
            assert r.ref_error is not None and np.isfinite(r.ref_error), r.name
    assert t.by_name()["model.layers.0.mlp.down_proj/torch.linear#0"].ref_error == t.by_name()["model.layers.0.mlp.down_proj"].ref_error


def test_a_lazy_reference_is_the_eager_one_evaluated_when_asked(tiny):
    model, ids = tiny
    eager, logits = _forward(model, ids, ops=True, reference=True)
    lazy, again = _forward(model, ids, ops=True, reference=True, lazy_reference=True)
    assert np.array_equal(logits.numpy(), again.numpy())
    assert all(r.ref_error is None for r in lazy.tensors) and all(r.reeval is not None for r in lazy.tensors)
    for e, r in zip(eager.tensors, lazy.tensors):
        r.reeval()
        assert (r.name, r.ref_error, r.reeval) == (e.name, e.ref_error, None)  # the same float64 error, bit for bit
    assert lazy.by_name()["model.layers.0.mlp.down_proj/torch.linear#0"].ref_error > 0


def test_a_lazy_reference_reads_the_inputs_copied_during_the_forward(tiny):
    """The lazy reference holds its own copy of each input, taken as the hook ran: a write into the
    model's tensors afterwards reaches neither the compared bytes nor the float64 evaluated later."""
    import torch

    model, ids = tiny
    eager, _ = _forward(model, ids, ops=True, reference=True)
    seen: list = []
    layer = model.model.layers[0].mlp.down_proj
    grab = layer.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    try:
        lazy, _ = _forward(model, ids, ops=True, reference=True, lazy_reference=True)
    finally:
        grab.remove()
    name = "model.layers.0.mlp.down_proj"
    before = [a.copy() for a in lazy.by_name()[name].inputs]
    with torch.inference_mode():
        seen[0].mul_(3.0)  # the activation down_proj read, written after the capture
    assert all(np.array_equal(a, b) for a, b in zip(lazy.by_name()[name].inputs, before))
    for op in (name, name + "/torch.linear#0"):
        lazy.by_name()[op].reeval()
        assert lazy.by_name()[op].ref_error == eager.by_name()[op].ref_error, op  # evaluated on the copy, bit for bit


def test_past_the_memory_bound_only_layer_boundaries_are_kept(tiny, plain):
    model, ids = tiny
    full, _ = plain
    bound = full.nbytes // 3
    t, _ = _forward(model, ids, max_bytes=bound)
    assert t.bounded and {r.kind for r in t.tensors} <= set(taps.LAYER_KINDS)
    assert {"model.embed_tokens", "model.layers.0"} <= {r.name for r in t.tensors}
    assert any("bound" in n and str(bound) in n for n in t.notes)
    layers, _ = _forward(model, ids, layers_only=True)
    assert [r.name for r in layers.tensors] == ["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"]


def test_backward_hooks_capture_module_and_parameter_gradients():
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.SiLU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4, requires_grad=True)
    with taps.tap(net, forward=True, backward=True) as t:
        loss = net(x).pow(2).sum()
        loss.backward()
    grads = {r.name: r for r in t.tensors if r.phase == "param_grad"}
    assert set(grads) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert np.array_equal(grads["0.weight"].output, net[0].weight.grad.numpy())
    back = {r.name: r for r in t.tensors if r.phase == "backward"}
    assert set(back) == {"0", "1", "2"} and back["2"].output.shape == (3, 2)
    assert np.array_equal(back["0"].inputs[0], x.grad.numpy())  # grad wrt the first layer's input
    out = net(x)
    assert np.allclose(back["2"].output, 2 * out.detach().numpy())  # d(sum y^2)/dy
    assert [r.name for r in t.tensors if r.phase == "forward"] == ["0", "1", "2"]
    assert not net[0]._forward_hooks and not net[0]._backward_hooks  # gone after the block


@pytest.mark.parametrize("text, says", [
    ("model.norm:bias:1e-3", "target 'bias' is unknown"),
    ("model.norm:output:nan", "finite number in (0, 1]"),
    ("model.norm:output:inf", "finite number in (0, 1]"),
    ("model.norm:output:0", "finite number in (0, 1]"),
    ("model.norm:output:-1e-3", "finite number in (0, 1]"),
    ("model.norm:output:2", "finite number in (0, 1]"),
    ("model.norm:output:abc", "is not a number"),
    ("model.norm:weight:1e-3@2", "@STEP applies to an output"),
    ("model.norm:output:1e-3@x", "not a step number"),
    ("model.norm", "is not MODULE:output:REL"),
    (":output:1e-3", "is not MODULE:output:REL"),
])
def test_bad_perturbation_specs_are_one_line_usage_errors(text, says):
    with pytest.raises(UsageError) as err:
        perturb.parse(text)
    assert says in err.value.one_line() and "\n" not in err.value.one_line()


def test_perturbation_spec_parses_and_round_trips():
    p = perturb.parse("model.layers.1.mlp.down_proj:output:1e-3@2")
    assert (p.module, p.target, p.rel, p.step) == ("model.layers.1.mlp.down_proj", "output", 1e-3, 2)
    assert perturb.parse(str(p)) == p
    assert perturb.parse("lm_head:weight:0.5").step is None


def test_unknown_module_path_names_close_matches(tiny):
    model, _ = tiny
    with pytest.raises(UsageError) as err:
        perturb.resolve(model, perturb.parse("model.layer.1.mlp.down_proj:output:1e-3"))
    assert "model.layers.1.mlp.down_proj" in err.value.one_line()
    with pytest.raises(UsageError, match="no floating-point weight"):
        perturb.resolve(model, perturb.parse("model.layers.1.mlp:weight:1e-3"))


def test_a_tied_weight_is_refused_it_would_start_in_two_modules():
    import torch

    net = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    net[1].weight = net[0].weight  # tied, as smollm2-135m's lm_head and embed_tokens
    with pytest.raises(UsageError) as err:
        perturb.resolve(net, perturb.parse("1:weight:1e-3"))
    assert "shared with '0' (tied)" in err.value.one_line()
    assert perturb.resolve(net, perturb.parse("1:output:1e-3")) is net[1]


CASES = ["model.layers.1.self_attn.q_proj:output:1e-3", "model.layers.0.self_attn.o_proj:output:1e-3", "model.layers.1.mlp.down_proj:output:1e-3",
         "model.layers.0.post_attention_layernorm:output:1e-3", "model.layers.1.mlp.act_fn:output:1e-2",
         "model.layers.0.mlp.up_proj:weight:1e-3", "model.layers.1.self_attn.q_proj:weight:1e-2",
         "model.layers.0.input_layernorm:weight:1e-2"]


@pytest.mark.parametrize("text", CASES)
def test_the_perturbed_module_is_the_first_captured_tensor_that_moves(tiny, plain, text):
    import torch

    model, ids = tiny
    base, base_logits = plain
    spec = perturb.parse(text)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with perturb.applied(model, spec):
        moved, logits = _forward(model, ids)
    assert not torch.equal(logits, base_logits)  # the perturbed run differs at the logits
    first = next(r for r, b in zip(moved.tensors, base.tensors) if not np.array_equal(r.output, b.output))
    assert [r.name for r in moved.tensors] == [r.name for r in base.tensors]
    assert first.name == spec.module
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # weight taken back bit for bit


def test_a_rows_float64_reference_matches_the_whole_batchs(tiny):
    """The reference runs on the window's row alone (8x cheaper at batch 8): the same errors as
    evaluating the whole batch in float64, to float64 rounding."""
    import torch

    model, ids = tiny
    short = ids[:3]
    x = torch.tensor([ids, [0] * (len(ids) - 3) + short])  # row 1 left-padded
    mask = torch.tensor([[1] * len(ids), [0] * (len(ids) - 3) + [1] * 3])
    window = taps.Window(row=1, batch=2, cuts={len(ids): 3})
    errors = []
    for rows, lazy in ((True, False), (False, False), (True, True)):  # lazy: the row's inputs copied at capture
        with torch.inference_mode():
            with taps.tap(model, window=window, reference=True, ref_rows=rows, lazy_reference=lazy) as t:
                model(input_ids=x, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
            for r in t.tensors:
                if r.reeval is not None:
                    r.reeval()
        errors.append({r.name: r.ref_error for r in t.tensors})
    assert errors[2] == errors[0]  # bit for bit: the same float64 on the same row, evaluated later
    assert sum(e is not None for e in errors[2].values()) > 10
    assert errors[0].keys() == errors[1].keys()
    assert t.by_name()["model.layers.1.mlp.down_proj"].output.shape == (3, 128)
    for name, e in errors[0].items():
        assert (e is None) == (errors[1][name] is None), name
        if e is not None:
            assert abs(e - errors[1][name]) <= 1e-9 * max(1.0, e), (name, e, errors[1][name])


def test_an_ops_float64_reference_runs_on_the_row_alone_with_the_whole_batchs_errors(tiny, monkeypatch):
    """An op's float64 reference (lazy, as locate asks for it) is evaluated on the window's row only
    where every batch-ranked argument has the batch as dim 0; its errors are the whole batch's."""
    import torch

    model, ids = tiny
    x = torch.tensor([ids, [0] * (len(ids) - 3) + ids[:3]])
    mask = torch.tensor([[1] * len(ids), [0] * (len(ids) - 3) + [1] * 3])
    window = taps.Window(row=1, batch=2, cuts={len(ids): 3})
    seen: list[int] = []
    real = taps.op_output

    def counted(func, args, kwargs):
        seen.append(next(a.shape[0] for a in args if isinstance(a, torch.Tensor)))
        return real(func, args, kwargs)

    monkeypatch.setattr(taps, "op_output", counted)
    errors, rows_seen = [], []
    for rows in (True, False):
        seen.clear()
        with torch.inference_mode():
            with taps.tap(model, window=window, ops=True, reference=True, lazy_reference=True, ref_rows=rows) as t:
                model(input_ids=x, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
            ops = [r for r in t.tensors if "/torch." in r.name]
            for r in ops:
                r.reeval()
        errors.append({r.name: r.ref_error for r in ops})
        rows_seen.append(list(seen))
    linear = "model.layers.1.mlp.down_proj/torch.linear#0"
    assert errors[0][linear] is not None and errors[0][linear] > 0
    assert 1 in rows_seen[0] and 1 not in rows_seen[1][:1]  # engaged: row-only evaluations with ref_rows, none without
    assert rows_seen[0].count(2) < rows_seen[1].count(2)
    assert errors[0].keys() == errors[1].keys()
    for name, e in errors[0].items():
        assert (e is None) == (errors[1][name] is None), name
        if e is not None:
            assert abs(e - errors[1][name]) <= 1e-9 * max(1.0, e), (name, e, errors[1][name])


def test_input_hooks_only_where_a_cache_can_be_handed_and_none_left_after(tiny):
    """A tap's input hook reads the cache a module is handed: it is registered only on the classes whose
    forward can take one (the attention, the decoder layer, the model), not on every Linear or norm; the
    outputs and the ops' module stack are global hooks; and no hook of any kind outlives the block, even one
    that raised."""
    import torch
    from torch.nn.modules import module as torch_module

    from detllm.core.taphooks import takes_cache

    model, ids = tiny
    takes = {type(m).__name__ for m in model.modules() if takes_cache(type(m))}
    assert {"LlamaAttention", "LlamaDecoderLayer", "LlamaModel"} <= takes
    assert not takes & {"Linear", "LlamaRMSNorm", "Embedding", "LlamaMLP", "LlamaRotaryEmbedding", "SiLU"}
    def hooks():
        return (len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks),
                sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()))

    before = hooks()
    with pytest.raises(RuntimeError, match="inside"):
        with torch.inference_mode(), taps.tap(model, row=0, ops=True, reference=True, lazy_reference=True) as t:
            model(input_ids=torch.tensor([ids]))
            raise RuntimeError("inside the block")
    assert any("/torch." in r.name for r in t.tensors) and any(r.name == "model.layers.0" for r in t.tensors)
    assert hooks() == before


def test_the_ops_mode_leaves_once_ops_through_completes_and_the_stack_stays_balanced(tiny):
    """With `ops_through`, the ops' function mode is taken off the mode stack as that module completes
    (each later torch function would still pass through it, to record nothing); under a mode entered
    after it (an op graft's) it stays, and records nothing more. Either way the stack is as before after
    the block, and the records are those of a capture whose mode stayed on."""
    import contextlib

    import torch
    from torch.overrides import TorchFunctionMode, _get_current_function_mode, _len_torch_function_stack

    model, ids = tiny
    seen = {}
    hooks = [model.get_submodule(name).register_forward_pre_hook(
        lambda m, a, name=name: seen.__setitem__(name, type(_get_current_function_mode()).__name__))
        for name in ("model.layers.0.mlp", "model.layers.1.mlp")]

    class Outer(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def capture(outer: bool):
        seen.clear()
        with torch.inference_mode(), taps.tap(model, row=0, ops=True, ops_through="model.layers.0") as t:
            with Outer() if outer else contextlib.nullcontext():
                model(input_ids=torch.tensor([ids]))
        assert _len_torch_function_stack() == 0
        return t, dict(seen)

    try:
        alone, modes = capture(False)
        assert modes == {"model.layers.0.mlp": "_Ops", "model.layers.1.mlp": "NoneType"}
        under, modes = capture(True)
        assert modes == {"model.layers.0.mlp": "Outer", "model.layers.1.mlp": "Outer"}
    finally:
        for h in hooks:
            h.remove()
    assert alone.ops_ended and under.ops_ended
    assert [r.name for r in alone.tensors] == [r.name for r in under.tensors]
    assert not any("/torch." in r.name for r in alone.tensors if r.name.startswith("model.layers.1"))
    assert all(a.output.tobytes() == b.output.tobytes() for a, b in zip(alone.tensors, under.tensors))
