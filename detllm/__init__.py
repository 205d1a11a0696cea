"""detllm: is your LLM inference deterministic? Prove it with a repro pack; when
outputs differ, say where and why. Public API re-exports only; heavy engines are
imported lazily by the backends that need them."""

from .api import check, make_config, run
from .config import Decoding, RunConfig
from .diff import diff
from .errors import DetllmError
from .integrity import Verification, verify
from .pack import create_pack
from .replay import replay
from .runner import Outcome

__all__ = ["Decoding", "DetllmError", "Outcome", "RunConfig", "Verification", "check", "create_pack", "diff", "make_config",
           "replay", "run", "verify"]
