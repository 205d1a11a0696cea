"""The hf tier-3 probe of the blocked linear (backends/hf/invariant.py) covers every row offset of a
block (review R14): a sequence's rows sit at any offset of a 64-row prompt block or an 8-row decode
block, so a GEMM that computed one offset differently must be caught there, whichever offset it is.
No CPU here computes an offset differently (the review swept them all), so the fault is injected
into block_linear: the row at one offset of every block moves by one ulp."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from detllm.backends.hf import invariant as inv  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model():
    from detllm.backends.hf import HFBackend

    return HFBackend("tiny").model


def _offset_fault(real, block: int, offset: int):
    def block_linear(torch, x, weight, bias, b):
        out = real(torch, x, weight, bias, b)
        if b != block or out.numel() == 0 or out.reshape(-1, out.shape[-1]).shape[0] <= offset:
            return out
        rows = out.reshape(-1, out.shape[-1])
        at = torch.arange(offset, rows.shape[0], block)  # this offset of every block
        rows[at] = torch.nextafter(rows[at], torch.full_like(rows[at], float("inf")))
        return out
    return block_linear


def test_the_probe_passes_the_real_blocked_linear(tiny_model):
    with torch.inference_mode():
        op = inv._probe_linears(torch, tiny_model, "cpu")
    assert op.covered and "every row offset" in op.how, op.how


@pytest.mark.parametrize("block", [inv.DECODE_BLOCK, inv.PREFILL_BLOCK])
def test_a_linear_that_computes_any_one_offset_differently_is_not_covered(tiny_model, monkeypatch, block):
    real = inv.block_linear
    missed = []
    for offset in range(1, block):  # offset 0 is where the probe alone sits: the reference itself
        monkeypatch.setattr(inv, "block_linear", _offset_fault(real, block, offset))
        with torch.inference_mode():
            op = inv._probe_linears(torch, tiny_model, "cpu")
        if op.covered:
            missed.append(offset)
        else:
            assert f"in {block}-row blocks changed at" in op.how, op.how
    assert missed == [], f"offsets of a {block}-row block the probe does not cover: {missed}"
