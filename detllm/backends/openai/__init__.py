"""`openai`: a client of any OpenAI-compatible server. The backend (backend.py), its options
(options.py), HTTP and concurrency (load.py) and reading the answers (answers.py)."""

from .backend import OpenAIBackend
from .options import OpenAIOptions

__all__ = ["OpenAIBackend", "OpenAIOptions"]
