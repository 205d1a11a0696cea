"""hf/lean.py: triton is kept out of the process while transformers' model classes import, only on a
torch build with no GPU backend and only when nothing imported it first; afterwards it imports as usual; forget_sources drops the source text seeding and loading left in linecache."""

from __future__ import annotations

import linecache
import sys
from types import SimpleNamespace

from detllm.backends.hf.lean import forget_sources, gpuless, without_triton

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


def test_seeding_fills_linecache_and_forget_sources_drops_only_files_it_can_read_back(monkeypatch):
    """torch.manual_seed without a CUDA context formats the stack (its lazy CUDA seeding), reading every
    file on it; forget_sources drops those and keeps an entry with no file behind it (generated code)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        import pytest
        pytest.skip("a live CUDA context seeds at once, formatting no stack")
    monkeypatch.setattr(linecache, "cache", {})
    generated = ("x = 1\n",)
    linecache.cache["<generated-by-test>"] = (6, None, list(generated), "<generated-by-test>")
    torch.manual_seed(0)
    files = [name for name in linecache.cache if name.endswith(".py")]
    assert any("torch" in name for name in files), "torch.manual_seed read no source: nothing here to forget"
    assert forget_sources() == len(files)
    assert list(linecache.cache) == ["<generated-by-test>"]
    assert linecache.getline(__file__, 1).startswith('"""hf/lean.py')  # a traceback still reads a file back
