"""detllm: is your LLM inference deterministic? Prove it with a repro pack; when
outputs differ, say where and why. Public API re-exports only; heavy engines are
imported lazily by the backends that need them."""

from .api import check, make_config, run
from .config import Decoding, RunConfig
from .errors import DetllmError
from .runner import Outcome

__all__ = ["Decoding", "DetllmError", "Outcome", "RunConfig", "check", "make_config", "run"]
