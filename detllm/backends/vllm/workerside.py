"""Imported by vLLM inside each worker process it spawns (tensor_parallel_size > 1), never by detllm.

Makes the worker die with detllm's process: vLLM's own watch on its parent (a pipe) starts only once
the worker has loaded the model, so a detllm killed during the engine's start would leave its
workers behind. backend.py names `DiesWithParent` as vLLM's `worker_extension_cls`, which each worker
imports first thing; importing this module asks Linux to SIGKILL the worker when its parent dies.
"""

from __future__ import annotations

import multiprocessing
import os

from ...core.children import death_signal_hook


def _die_with_parent() -> None:
    parent = multiprocessing.parent_process()  # the process that spawned this one, as multiprocessing recorded it
    if parent is None:
        return
    hook = death_signal_hook()
    if hook is not None:
        hook()
    if os.getppid() != parent.pid:  # the parent died before the hook was in place
        os._exit(1)


_die_with_parent()


class DiesWithParent:
    """vLLM's worker extension: adds nothing to the worker; its import is what matters."""


__all__ = ["DiesWithParent"]
