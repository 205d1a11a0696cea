"""One module kept out of the import system while something else imports: inside the block `import
name` raises ImportError, as for a module that is not installed; after it the module imports as usual.
The hf backend keeps triton out while transformers' model classes import on a GPU-less torch
(backends/hf/lean.py); the openai backend keeps httpx's command-line client out while httpx imports
(backends/openai/wire.py). A module already imported is left as it is.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def kept_out(name: str, *, when: bool = True) -> Iterator[bool]:
    """Inside: `name` is not importable when `when` holds and it is not imported yet (yields True then);
    on leaving, it can be imported again."""
    keep_out = when and name not in sys.modules
    if keep_out:
        sys.modules[name] = None  # type: ignore[assignment]  # the import system's "not importable" mark
    try:
        yield keep_out
    finally:
        if keep_out and sys.modules.get(name, 0) is None:
            del sys.modules[name]
