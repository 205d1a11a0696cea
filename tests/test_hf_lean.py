"""hf/lean.py: triton is kept out of the process while transformers' model classes import, only on a
torch build with no GPU backend and only when nothing imported it first; afterwards it imports as usual."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from detllm.backends.hf.lean import gpuless, without_triton

CPU = SimpleNamespace(version=SimpleNamespace(cuda=None, hip=None, xpu=None))
CUDA = SimpleNamespace(version=SimpleNamespace(cuda="12.8", hip=None))
ROCM = SimpleNamespace(version=SimpleNamespace(cuda=None, hip="6.2"))


def test_only_a_gpuless_torch_keeps_triton_out(monkeypatch):
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    assert gpuless(CPU) and not gpuless(CUDA) and not gpuless(ROCM)
    with without_triton(CPU) as kept_out:
        assert kept_out and "triton" in sys.modules and sys.modules["triton"] is None
        try:
            import triton  # noqa: F401
        except ImportError:
            pass
        else:
            raise AssertionError("triton imported inside")
    assert "triton" not in sys.modules  # importable again afterwards
    for torch in (CUDA, ROCM):
        with without_triton(torch) as kept_out:
            assert not kept_out and "triton" not in sys.modules


def test_a_triton_already_imported_is_left_alone(monkeypatch):
    loaded = SimpleNamespace(__name__="triton")
    monkeypatch.setitem(sys.modules, "triton", loaded)
    with without_triton(CPU) as kept_out:
        assert not kept_out and sys.modules["triton"] is loaded
    assert sys.modules["triton"] is loaded
