"""`hf`: Hugging Face transformers in this process. The backend and its decode loop
(backend.py) and the batch-invariant ops of `--opt batch_invariant=true` (invariant.py).
Importing this package imports no torch."""

from .backend import HFBackend, HFOptions

__all__ = ["HFBackend", "HFOptions"]
