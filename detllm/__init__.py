"""detllm: is your LLM inference deterministic? Prove it with a repro pack; when
outputs differ, say where and why. Public API re-exports only, resolved on first use
(PEP 562), so `import detllm` and the CLI's start-up load none of the engine code;
heavy engines are imported lazily by the backends that need them."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

# public name -> the module (relative to this package) that defines it
_EXPORTS = {
    "check": ".api", "make_config": ".api", "run": ".api",
    "Decoding": ".core.config", "RunConfig": ".core.config",
    "diff": ".commands.diff",
    "DetllmError": ".core.errors",
    "Verification": ".commands.verify", "verify": ".commands.verify",
    "create_pack": ".commands.pack",
    "replay": ".commands.replay",
    "Outcome": ".pipeline.runner",
    "fleet_check": ".fleet.endpoints", "fleet_diff": ".fleet.nway",
    "train_check": ".training.check", "train_run": ".training.check",
    "parity": ".training.parity", "train_diff": ".training.diffing",
}

__all__ = ["Decoding", "DetllmError", "Outcome", "RunConfig", "Verification", "check", "create_pack", "diff", "fleet_check", "fleet_diff",
           "make_config", "parity", "replay", "run", "train_check", "train_diff", "train_run", "verify"]

if TYPE_CHECKING:
    from .api import check, make_config, run
    from .core.config import Decoding, RunConfig
    from .commands.diff import diff
    from .core.errors import DetllmError
    from .fleet.endpoints import fleet_check
    from .fleet.nway import fleet_diff
    from .commands.verify import Verification, verify
    from .commands.pack import create_pack
    from .commands.replay import replay
    from .pipeline.runner import Outcome
    from .training.check import train_check
    from .training.diffing import train_diff
    from .training.parity import parity
    from .training.check import train_run


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'detllm' has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

