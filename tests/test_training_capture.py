"""The per-tensor capture pass (training/capture.py) against the grouped pass that wrote every earlier
pack: the same P and the same figure bits for every dtype and edge a step can meet (None, empty,
NaN, inf, -0.0, non-contiguous), on one thread and on two workers; the caller's torch thread count
and the count new threads start with are unchanged after it. Replay compares the figures bit for bit,
so a pack written before the per-tensor pass must replay onto the same bits."""

from __future__ import annotations

import math
import threading

import pytest

torch = pytest.importorskip("torch")

from detllm.training import capture  # noqa: E402
from detllm.training.capture import digests_with_figures  # noqa: E402
from detllm.training.digest import CHAINS, torch_tensor_digest  # noqa: E402
from tests.grouped_pass import grouped_figures  # noqa: E402


def _tensors():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(300, 700, generator=g)  # above torch's grain size: a parallel kernel where parallelism is on
    nan = torch.randn(64, generator=g)
    nan[7] = float("nan")
    inf = torch.randn(64, generator=g)
    inf[3] = -float("inf")
    # above torch's grain size (32768 elements) in every dtype: a reduction that could split over threads
    wide = {f"wide-{d}": torch.randn(400, 300, generator=g).to(d) for d in (torch.bfloat16, torch.float16, torch.float64)}
    return [*wide.items(), ("big", big), ("vec", torch.randn(4096, generator=g) * 1e-3),
            ("bf16", torch.randn(513, 3, generator=g).bfloat16()),
            ("f16", torch.randn(1000, generator=g).half()), ("f64", torch.randn(77, 5, generator=g, dtype=torch.float64)),
            ("none", None), ("empty", torch.zeros(0, 4)), ("nan", nan), ("inf", inf), ("negzero", torch.full((9,), -0.0)),
            ("negative", -torch.rand(33, generator=g) - 1.0), ("transposed", big[:, :50].t()), ("scalar", torch.tensor(-2.5))]


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("chain", CHAINS)
def test_per_tensor_pass_gives_the_grouped_pass_bits(threads, chain):
    """The grouped pass computed the figures on the step's n threads; the workers compute on one each."""
    named = _tensors()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        per, figs = digests_with_figures(named, chain)
        want = grouped_figures([t for _, t in named])
    finally:
        torch.set_num_threads(before)
    assert list(per) == [n for n, _ in named]
    assert per == {n: torch_tensor_digest(n, t, chain=chain) for n, t in named}
    # repr compares the float bits that JSON would write (-0.0 and 0.0 differ; None for NaN and inf)
    assert [tuple(map(repr, f)) for f in figs] == [tuple(map(repr, f)) for f in want]
    at = dict(zip((n for n, _ in named), figs))
    assert at["negzero"] == (0.0, 0.0) and at["none"] == at["empty"] == (None, None) and at["nan"] == (None, None)
    assert at["inf"] == (None, None) and at["negative"][1] > 1.0


def test_workers_leave_the_thread_counts_as_they_were(monkeypatch):
    """The workers compute on one thread each; the caller keeps its count, and a thread started
    afterwards takes the caller's count, not the workers' one."""
    monkeypatch.setattr(capture, "_POOLS", {})  # a pool started by this test
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        digests_with_figures(_tensors(), CHAINS[-1])
        workers = capture._POOLS[2].submit(lambda: torch.get_num_threads()), capture._POOLS[2].submit(lambda: torch.get_num_threads())
        seen = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert [w.result() for w in workers] == [1, 1]
        assert torch.get_num_threads() == 2 and seen == [2]
    finally:
        torch.set_num_threads(before)
        capture._POOLS[2].shutdown()
