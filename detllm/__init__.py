"""detllm: is your LLM inference deterministic? Prove it with a repro pack; when
outputs differ, say where and why. Public API re-exports only, resolved on first use
(PEP 562), so `import detllm` and the CLI's start-up load none of the engine code;
heavy engines are imported lazily by the backends that need them."""

from __future__ import annotations

import sys
import types
from importlib import import_module
from typing import TYPE_CHECKING, Any

# public name -> the module (relative to this package) that defines it
_EXPORTS = {
    "check": ".api", "make_config": ".api", "run": ".api",
    "Decoding": ".config", "RunConfig": ".config",
    "diff": ".diff",
    "DetllmError": ".errors",
    "Verification": ".verify", "verify": ".verify",
    "create_pack": ".pack",
    "replay": ".replay",
    "Outcome": ".runner",
    "fleet_check": ".fleet.endpoints", "fleet_diff": ".fleet.nway",
    "train_check": ".training.check",
    "parity": ".training.parity", "train_diff": ".training.diffing",
}

__all__ = ["Decoding", "DetllmError", "Outcome", "RunConfig", "Verification", "check", "create_pack", "diff", "fleet_check", "fleet_diff",
           "make_config", "parity", "replay", "run", "train_check", "train_diff", "verify"]

if TYPE_CHECKING:
    from .api import check, make_config, run
    from .config import Decoding, RunConfig
    from .diff import diff
    from .errors import DetllmError
    from .fleet.endpoints import fleet_check
    from .fleet.nway import fleet_diff
    from .verify import Verification, verify
    from .pack import create_pack
    from .replay import replay
    from .runner import Outcome
    from .training.check import train_check
    from .training.diffing import train_diff
    from .training.parity import parity


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'detllm' has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """`detllm.diff` and `detllm.replay` name both a submodule and the function it defines. Importing
    the submodule binds its name on the package (importlib does), which would shadow the function:
    the package keeps the function instead, as the eager `from .diff import diff` did."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == "." + name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
