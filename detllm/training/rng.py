"""Every random number source a training step draws from, seeded, captured as JSON (integers and
strings only, so its digest is exact) and restored: Python's `random`, NumPy's global generator,
torch's CPU generator, each CUDA device's generator, and the data-order generator of the task.
Does not own where the state is stored (checkpoint.py) or its digest (digest.rng_digest).
"""

from __future__ import annotations

import random
from typing import Any

from ..core.errors import UsageError

DATA_SALT = 0x9E3779B97F4A7C15  # the data-order generator's seed is the run seed plus this, mod 2^64: its own stream
_U64 = 1 << 64


def seed_all(seed: int) -> Any:
    """Seed every global source from `seed` and return the data-order torch.Generator."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed([seed & 0xFFFFFFFF, seed >> 32])  # all 64 bits of the seed
    torch.manual_seed(seed)  # CPU and every CUDA device
    return torch.Generator().manual_seed((seed + DATA_SALT) % _U64)


def _fhex(x: float | None) -> str | None:
    return None if x is None else float(x).hex()


def capture(data: Any) -> dict[str, Any]:
    """The RNG state document (rng.json's `state`), `data` being the data-order generator."""
    import numpy as np
    import torch

    version, internal, gauss = random.getstate()
    name, key, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": {"version": version, "internal": list(internal), "gauss_next": _fhex(gauss)},
        "numpy": {"bit_generator": name, "key": [int(k) for k in key], "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": _fhex(cached)},
        "torch_cpu": bytes(torch.get_rng_state().numpy()).hex(),
        "torch_cuda": [bytes(s.numpy()).hex() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "data": bytes(data.get_state().numpy()).hex(),
    }


def restore(state: dict[str, Any], data: Any) -> None:
    """Set every source to `state` (capture's document); `data` is set in place."""
    import numpy as np
    import torch

    py = state["python"]
    gauss = None if py["gauss_next"] is None else float.fromhex(py["gauss_next"])
    random.setstate((py["version"], tuple(py["internal"]), gauss))
    npy = state["numpy"]
    np.random.set_state((npy["bit_generator"], np.array(npy["key"], dtype=np.uint32), npy["pos"], npy["has_gauss"],
                         float.fromhex(npy["cached_gaussian"])))
    torch.set_rng_state(_bytes_tensor(state["torch_cpu"]))
    cuda = state["torch_cuda"]
    if cuda:
        if not torch.cuda.is_available() or torch.cuda.device_count() != len(cuda):
            raise UsageError(f"the RNG state holds {len(cuda)} CUDA generator(s); this machine has "
                             f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}", hint="resume on the same devices")
        torch.cuda.set_rng_state_all([_bytes_tensor(s) for s in cuda])
    data.set_state(_bytes_tensor(state["data"]))


def _bytes_tensor(hexed: str) -> Any:
    import torch

    return torch.frombuffer(bytearray.fromhex(hexed), dtype=torch.uint8).clone()


class Saved:
    """The caller's global RNG state, put back when a run in this process ends (`with Saved():`):
    a library call must not leave the caller's generators where training left them."""

    def __enter__(self) -> "Saved":
        import torch

        self._gen = torch.Generator()
        self.state = capture(self._gen)
        return self

    def __exit__(self, *exc: Any) -> None:
        restore(self.state, self._gen)


__all__ = ["DATA_SALT", "Saved", "capture", "restore", "seed_all"]
