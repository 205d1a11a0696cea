"""Lazy string registry of backends: name -> "module:Class", imported on first use.

Keeps `detllm --help`, `diff`, `report` and `verify` free of engine imports.
"""

from __future__ import annotations

import difflib
import importlib

from ..core.config import RunConfig
from ..core.errors import UsageError
from .base import Backend

BACKENDS: dict[str, str] = {
    "hf": "detllm.backends.hf.backend:HFBackend",
    "vllm": "detllm.backends.vllm.backend:VLLMBackend",
    "llamacpp": "detllm.backends.llamacpp.backend:LlamaCppBackend",
    "openai": "detllm.backends.openai.backend:OpenAIBackend",
    "fake": "detllm.backends.fake:FakeBackend",
}


def backend_class(name: str) -> type[Backend]:
    if name not in BACKENDS:
        close = difflib.get_close_matches(name, BACKENDS, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"choose one of: {', '.join(BACKENDS)}"
        raise UsageError(f"unknown backend {name!r}", hint=hint)
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def create_backend(config: RunConfig) -> Backend:
    return backend_class(config.backend).from_config(config)
