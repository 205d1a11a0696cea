"""Keep engines' own chatter off stderr, which holds detllm's one line on failure.

Owns `captured_stderr()`: file descriptor 2 (where C/C++ code such as torch's NUMA warning and
vLLM's engine logs write, and where Python's sys.stderr ends up) points at a temporary file
for the block. What was captured is handed to the caller, for an error message that needs
it, and otherwise dropped: the settings an engine applied are recorded in the run folder,
not in its log. Does not silence detllm's own messages, which are printed by the CLI after
the block. POSIX file descriptors only; elsewhere the block runs as it is.
"""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def captured_stderr() -> Iterator[Callable[[], str]]:
    """Capture fd 2 for the block; yields a function that returns the text captured so far."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no fd 2 to redirect (an embedded interpreter)
        yield lambda: ""
        return
    sink = tempfile.TemporaryFile()
    os.dup2(sink.fileno(), 2)

    kept: list[str] = []  # the text, once the block has ended

    def text() -> str:
        return kept[0] if kept else os.pread(sink.fileno(), 1 << 16, 0).decode("utf-8", "replace")  # the first 64 KiB

    try:
        yield text
    finally:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(saved, 2)
        os.close(saved)
        kept.append(text())
        sink.close()


__all__ = ["captured_stderr"]
