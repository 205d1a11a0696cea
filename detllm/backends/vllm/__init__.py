"""`vllm`: vLLM's offline engine in this process. The backend (backend.py), the one engine of the
process (engine.py), its options and applied record (options.py), and what is installed here
(installed.py). Importing this package imports no vLLM."""

from .backend import VLLMBackend
from .engine import release_engine
from .installed import batch_invariance_support, build_platform, installed_vllm
from .options import VLLMOptions

__all__ = ["VLLMBackend", "VLLMOptions", "batch_invariance_support", "build_platform", "installed_vllm", "release_engine"]
