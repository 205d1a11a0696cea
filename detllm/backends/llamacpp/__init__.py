"""`llamacpp`: a real llama.cpp `llama-server` over HTTP. The backend (backend.py), the server
process (server.py), what the build is (build.py), the .gguf model and its identity (model.py),
the options (options.py), and capture for `detllm locate` (capture.py running our dumper/, names.py)."""

from .backend import LlamaCppBackend, batch_seed, incomplete_utf8
from .build import cpu_features
from .model import resolve_gguf
from .options import LlamaCppOptions
from .server import Server, find_server, free_port

__all__ = ["LlamaCppBackend", "LlamaCppOptions", "Server", "batch_seed", "cpu_features", "find_server", "free_port",
           "incomplete_utf8", "resolve_gguf"]
