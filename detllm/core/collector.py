"""The cyclic garbage collector held off the heap that exists when a capture starts: a capture keeps
thousands of records alive while it allocates, and each full collection CPython runs then walks every
object of the process (~376,000 with transformers and a model loaded: ~0.2 s of CPU, in about every
second smollm2 capture). Used by the hf capture (locate); the collector itself is unchanged.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def heap_frozen() -> Iterator[None]:
    """Until the block ends, collections look only at objects made inside it (gc.freeze: the older
    ones move to the permanent generation), then the older objects return to the oldest generation
    (gc.unfreeze). Where something froze the heap already (a server freezing before it forks), it is
    left as it is: unfreezing would undo theirs."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
