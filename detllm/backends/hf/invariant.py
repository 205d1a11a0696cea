"""Batch-invariant inference for the `hf` backend (`--opt batch_invariant=true`, tier 3).

Owns the invariant versions of every op whose result for one sequence could depend on the
other sequences of a batch or on its padding, their installation on a loaded model for the
duration of a run (module swaps and a registered attention function, all undone afterwards),
and the probe that checks, on this machine, that each op really is invariant. Knows nothing
of runs, tiers or artifacts: backend.py asks `coverage()` and enters `installed()`.

How each op is made invariant (docs/backends/hf.md, "Batch-invariant mode"):
- linear (every nn.Linear, lm_head included): the rows are padded to a multiple of a fixed
  block and each block goes through the same GEMM call, so the BLAS sees one shape whatever the
  batch; one block size for prefill, one for decode (the loop tells which phase it is in).
- attention: per sequence, on its own unpadded keys, so the reduction lengths are the ones a
  batch of one would use.
- RMSNorm, activation, rotary embedding, log_softmax: row-wise ATen kernels, kept, and probed.
"""

from __future__ import annotations

from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Iterator

from ..base import Applied

DECODE_BLOCK = 8  # rows per GEMM call while decoding (one token per sequence): measured best at batch 8
PREFILL_BLOCK = 64  # rows per GEMM call for the prompt: fewer calls, the block is filled by long prompts
ATTENTION_NAME = "detllm_batch_invariant"  # registered with transformers' AttentionInterface during a run
MODEL_TYPES = ("llama",)  # architectures whose forward code we have read and whose every op is covered
ATTENTIONS = ("eager", "sdpa")  # the attention kernels our per-sequence attention reproduces
_LEAVES = ("Linear", "Embedding", "RMSNorm", "RotaryEmbedding", "SiLU", "SiLUActivation", "Dropout", "Identity")
_PROBE_SIZES = (1, 2, 3, 5, 8, 9, 16, 17, 33)  # batch sizes the probe compares (odd ones cross block edges)
_PROBED: dict[tuple, tuple[Op, ...]] = {}  # (model id, device, attention, threads) -> probe results


@dataclass(frozen=True)
class Op:
    """One op of the model and how the mode makes it batch invariant."""

    name: str
    covered: bool
    how: str  # what replaces it, or why it is invariant as it is; for an uncovered op: why not

    def applied(self, installed: bool) -> Applied:
        note = self.how if installed or not self.covered else f"{self.how} (not installed: another op is not covered)"
        return Applied(f"batch_invariant.{self.name}", True, installed and self.covered, self.how.split(":")[0], note)


# ------------------------------------------------------------------ the invariant ops


def block_linear(torch, x, weight, bias, block: int):
    """x @ weight.T (+ bias) with every GEMM call on exactly `block` rows: row i's result depends
    on row i only, never on how many rows the batch has (zero rows pad the last block)."""
    shape = x.shape
    k = shape[-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    padded = -(-m // block) * block
    buf = x.new_zeros((padded, k))  # a fresh, aligned allocation whatever x's layout
    buf[:m] = rows
    out = x.new_empty((padded, weight.shape[0]))
    wt = weight.t()
    for start in range(0, padded, block):
        if bias is None:
            torch.mm(buf[start:start + block], wt, out=out[start:start + block])
        else:
            torch.addmm(bias, buf[start:start + block], wt, out=out[start:start + block])
    return out[:m].reshape(*shape[:-1], weight.shape[0])


def _module_classes(torch):
    class BlockLinear(torch.nn.Module):
        """Stands in for one nn.Linear during a run; shares its parameters."""

        def __init__(self, inner, state) -> None:
            super().__init__()
            self.inner, self.state = inner, state

        @property
        def weight(self):  # the Linear's own (a perturbation or a tap finds it where a Linear keeps it)
            return self.inner.weight

        @property
        def bias(self):
            return self.inner.bias

        def forward(self, x):
            self.state.linear_calls += 1  # the live proof that the mode ran (recorded per batch by backend.py)
            real = self.state.real
            if real is not None and x.dim() == 3 and tuple(x.shape[:2]) == tuple(real.shape):
                # the prompt: only real tokens' rows are computed (padding rows stay zero, never read)
                out = x.new_zeros((*x.shape[:2], self.inner.out_features))
                out[real] = block_linear(torch, x[real], self.inner.weight, self.inner.bias, self.state.block)
                return out
            return block_linear(torch, x, self.inner.weight, self.inner.bias, self.state.block)

    return BlockLinear


@dataclass
class _State:
    """What the loop's current forward call looks like, set by a pre-hook on the model."""

    block: int = PREFILL_BLOCK
    starts: tuple[int, ...] = ()  # per row: index of its first real (unpadded) position
    real: Any = None  # prompt phase: (n, width) bool tensor of real positions; None while decoding
    kernel: str = "eager"
    linear_calls: int = 0  # BlockLinear forwards so far: the mode's live proof, read around each batch
    attention_calls: int = 0  # _attention calls so far


def _attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Attention of each sequence over its own real keys only: the same shapes, hence the same
    kernels and reduction order, as that sequence alone in a batch of one. (n, q, heads, d) out.
    Query heads sharing a key head are stacked as rows of one GEMM (no repeated keys)."""
    import torch

    state: _State = module._detllm_invariant
    state.attention_calls += 1
    n, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    out = query.new_zeros((n, q_len, heads, dim))
    for row in range(n):
        start = state.starts[row]
        q_from = max(0, start - (kv_len - q_len))  # queries are the last q_len key positions
        lq, lk = q_len - q_from, kv_len - start
        k = key[row, :, start:].contiguous()  # (kv_heads, lk, d), a fresh aligned copy
        v = value[row, :, start:].contiguous()
        if state.kernel == "sdpa":
            mask = torch.ones((lq, lk), dtype=torch.bool, device=query.device).tril(lk - lq) if lq > 1 else None
            o = torch.nn.functional.scaled_dot_product_attention(
                query[row:row + 1, :, q_from:].contiguous(), k[None], v[None], attn_mask=mask, scale=scaling,
                enable_gqa=groups > 1)[0]  # (heads, lq, d)
        else:
            q = query[row, :, q_from:].reshape(kv_heads, groups * lq, dim)  # head h uses key head h // groups
            w = torch.bmm(q, k.transpose(1, 2)).mul_(scaling)
            if lq > 1:  # causal: query i sits at key position lk - lq + i
                causal = torch.full((lq, lk), torch.finfo(w.dtype).min, device=w.device,  # float32 as ever; float64 in
                                    dtype=torch.promote_types(w.dtype, torch.float32)).triu(lk - lq + 1)  # taps' reference
                w = (w.view(kv_heads, groups, lq, lk) + causal).view(kv_heads, groups * lq, lk)
            w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
            o = torch.bmm(w, v).view(heads, lq, dim)
        out[row, q_from:] = o.transpose(0, 1)
    return out, None


# ------------------------------------------------------------------ coverage and probe


def coverage(model, attn_implementation: str, device: str) -> tuple[Op, ...]:
    """Every op class of the model with how it is covered; probed once per model, device, attention
    and thread count (the thread count can change how a kernel splits its work)."""
    import torch

    key = (id(model), device, attn_implementation, torch.get_num_threads())
    if key not in _PROBED:
        _PROBED[key] = _coverage(model, attn_implementation, device)
    return _PROBED[key]


def _coverage(model, attn_implementation: str, device: str) -> tuple[Op, ...]:
    import torch

    model_type = getattr(model.config, "model_type", "?")
    if model_type not in MODEL_TYPES:
        return (Op("architecture", False, f"not covered: model_type {model_type!r} (covered: {', '.join(MODEL_TYPES)})"),)
    unknown = sorted({type(m).__name__ for m in model.modules()
                      if not list(m.children()) and not type(m).__name__.endswith(_LEAVES)})
    if unknown:
        return (Op("module", False, f"not covered: {', '.join(unknown)}"),)
    if attn_implementation not in ATTENTIONS:
        return (Op("attention", False, f"not covered: attn_implementation {attn_implementation!r} (covered: {', '.join(ATTENTIONS)})"),)
    with torch.inference_mode():
        return (
            _probe_linears(torch, model, device),
            Op("attention", True, f"replaced: per-sequence {attn_implementation} attention on unpadded keys "
               "(the shapes of a batch of one, by construction)"),
            _probe_rows(torch, "rms_norm", _first(model, "RMSNorm"), model.config.hidden_size, device),
            _probe_rows(torch, "activation (silu)", _first(model, "MLP").act_fn, model.config.intermediate_size, device),
            _probe_rotary(torch, model, device),
            _probe_rows(torch, "log_softmax", lambda t: torch.log_softmax(t.float(), dim=-1), model.config.vocab_size, device),
            Op("embedding, residual add, elementwise mul, argmax, topk", True,
               "native: exact per element (a lookup, one rounding per element, or a comparison)"),
        )


def _first(model, suffix: str):
    return next(m for m in model.modules() if type(m).__name__.endswith(suffix))


def _same_row_everywhere(torch, fn, width: int, device: str, sizes=_PROBE_SIZES) -> str | None:
    """Run `fn` on one probe row alone and at several positions of batches of other rows;
    None if every result is bitwise the one of the batch of one, else where it differed."""
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn((1, width), generator=gen).to(device)
    alone = fn(probe)
    for size in sizes:
        batch = torch.randn((size, width), generator=gen).to(device)
        rows = sorted({0, size // 2, size - 1})  # first, middle and last block
        batch[rows] = probe[0]
        got = fn(batch)
        for pos in rows:
            if not torch.equal(got[pos], alone[0]):
                return f"batch {size}, row {pos}"
    return None


def _probe_rows(torch, name: str, fn, width: int, device: str) -> Op:
    where = _same_row_everywhere(torch, fn, width, device)
    if where:
        return Op(name, False, f"not covered: the probe row changed at {where}")
    return Op(name, True, f"native: each row computed on its own by ATen's row-wise kernel; probed bitwise at batch sizes {_sizes()}")


def _probe_linears(torch, model, device: str) -> Op:
    """Per weight shape and block size: the probe row at every offset of a block among random rows
    (a sequence's rows land at any offset: the prompt's real rows of all sequences are concatenated,
    a decode step has one row per sequence), then at the first, middle and last rows of batches that
    end in a zero-padded block or cross a block edge."""
    shapes = sorted({(m.in_features, m.out_features, m.bias is not None)
                     for m in model.modules() if isinstance(m, torch.nn.Linear)})
    for k, n, has_bias in shapes:
        gen = torch.Generator().manual_seed(1)
        weight = torch.randn((n, k), generator=gen).to(device)
        bias = torch.randn((n,), generator=gen).to(device) if has_bias else None
        for block in (DECODE_BLOCK, PREFILL_BLOCK):
            fn = lambda x, block=block: block_linear(torch, x, weight, bias, block)  # noqa: E731
            where = _every_offset(torch, fn, k, block, device)
            sizes = _PROBE_SIZES if block == DECODE_BLOCK else (1, 65)
            where = where or _same_row_everywhere(torch, fn, k, device, sizes)
            if where:
                return Op("linear", False, f"not covered: a {k}->{n} linear in {block}-row blocks changed at {where}")
    return Op("linear", True, f"replaced: fixed-shape row blocks ({DECODE_BLOCK} rows decoding, {PREFILL_BLOCK} for the "
              f"prompt) through one GEMM call each; probed bitwise for {len(shapes)} weight shapes at every row offset "
              f"of both blocks (among random rows) and in zero-padded and edge-crossing batches")


_OFFSET_BLOCKS = 8  # the every-offset probe's blocks per call: block j holds the probe at offsets j, j + 8, ...


def _every_offset(torch, fn, width: int, block: int, device: str) -> str | None:
    """One call on 8 blocks of random rows, block j holding the probe row at every offset o with
    o % 8 == j: every offset of the block is computed once, by the very GEMM shape a run uses, with
    random rows around it (8 GEMM calls, not one per offset: a 64-row block costs 512 rows, not
    4,096). None if every copy is bitwise the probe alone, else the first offset where it differed."""
    gen = torch.Generator().manual_seed(2)
    probe = torch.randn((1, width), generator=gen).to(device)
    alone = fn(probe)[0]
    stride = min(block, _OFFSET_BLOCKS)
    batch = torch.randn((stride * block, width), generator=gen).to(device)
    at = [j * block + o for j in range(stride) for o in range(j, block, stride)]  # (row, its offset o) per copy
    batch[at] = probe[0]
    got = fn(batch)
    for row in at:
        if not torch.equal(got[row], alone):
            return f"offset {row % block} of a {block}-row block"
    return None


def _probe_rotary(torch, model, device: str) -> Op:
    rotary = _first(model, "RotaryEmbedding")
    dummy = torch.zeros((1, 1, model.config.hidden_size), device=device)

    def fn(pos):  # one row of positions -> its cos and sin side by side
        cos, sin = rotary(dummy, pos.round().abs().long())
        return torch.cat([cos, sin], dim=-1).flatten(1)

    where = _same_row_everywhere(torch, lambda x: fn(x * 50), 24, device)
    if where:
        return Op("rotary", False, f"not covered: the probe row changed at {where}")
    return Op("rotary", True, f"native: per position (a product of two numbers, then cos and sin); probed bitwise at batch sizes {_sizes()}")


def _sizes() -> str:
    return ", ".join(map(str, _PROBE_SIZES))


# ------------------------------------------------------------------ installation


@contextmanager
def installed(model, attn_implementation: str) -> Iterator[None]:
    """Swap the invariant ops into `model` for the block's duration; everything is restored after,
    even on error: the Linear modules, the attention implementation, the hooks, the registration."""
    import torch
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    state = _State(kernel=attn_implementation)
    BlockLinear = _module_classes(torch)
    swapped = []  # (parent, child name, original module)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                swapped.append((parent, name, child))
    attn_modules = [m for m in model.modules() if hasattr(m, "num_key_value_groups")]
    saved_impl = model.config._attn_implementation
    hook = model.register_forward_pre_hook(lambda mod, args, kwargs: _observe(torch, state, kwargs), with_kwargs=True)
    try:
        ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME] = _attention
        ALL_MASK_ATTENTION_FUNCTIONS[ATTENTION_NAME] = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]  # unused by _attention
        for parent, name, child in swapped:
            setattr(parent, name, BlockLinear(child, state))
        for m in attn_modules:
            m._detllm_invariant = state
        model.config._attn_implementation = ATTENTION_NAME
        model._detllm_invariant_state = state  # backend.py reads its call counts around each batch
        yield
    finally:
        model.__dict__.pop("_detllm_invariant_state", None)
        model.config._attn_implementation = saved_impl
        for m in attn_modules:
            if "_detllm_invariant" in m.__dict__:
                del m._detllm_invariant
        for parent, name, child in swapped:
            setattr(parent, name, child)
        hook.remove()
        for registry in (ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS):
            with suppress(KeyError):  # set above unless the failure came first
                del registry[ATTENTION_NAME]


def live_calls(model) -> tuple[int, int] | None:
    """(invariant linear calls, invariant attention calls) so far while installed; None when not installed."""
    state = model.__dict__.get("_detllm_invariant_state")
    return None if state is None else (state.linear_calls, state.attention_calls)


def _observe(torch, state: _State, kwargs: dict[str, Any]) -> None:
    """Before each forward call: which phase (prompt or decode) and where each row's real tokens start."""
    from ...core.errors import BackendError

    mask = kwargs.get("attention_mask")
    past = kwargs.get("past_key_values")
    prefill = past is None or past.get_seq_length() == 0
    state.block = PREFILL_BLOCK if prefill else DECODE_BLOCK
    state.real = None
    if mask is None:
        ids = kwargs.get("input_ids")
        state.starts = (0,) * (ids.shape[0] if ids is not None else 1)
        return
    mask = mask.to("cpu")
    starts = (mask == 0).long().cumprod(-1).sum(-1)  # leading zeros: left padding
    if int(mask.sum()) != int((mask.shape[1] - starts).sum()):
        raise BackendError("batch_invariant needs left padding (a mask of zeros then ones per row)")
    state.starts = tuple(starts.tolist())
    ids = kwargs.get("input_ids")
    if prefill and ids is not None and tuple(ids.shape) == tuple(mask.shape):  # the whole prompt in one call
        state.real = kwargs["attention_mask"].bool()


def applied(ops: tuple[Op, ...], *, installed: bool) -> list[Applied]:
    """The record for determinism_applied.json: one setting per op."""
    return [op.applied(installed) for op in ops]


def uncovered(ops: tuple[Op, ...]) -> list[Op]:
    return [op for op in ops if not op.covered]
