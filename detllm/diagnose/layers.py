"""The `layers` probe of diagnose: `detllm locate --layers-only` on the failing check as evidence of
where in the model the divergence enters (the first decoder layer whose input agrees and output
differs). Runs in a probe worker (worker.py); the locate files go to OUT/layers/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def run_layers_probe(job: dict[str, Any]) -> dict[str, Any]:
    """Worker side: locate the failing check folder `job["folder"]` at layer boundaries."""
    from ..locate import locate

    doc = locate(job["folder"], out=job["out"], layers_only=True, ops=False).doc
    op = doc["first_bitwise_op"]
    return {"status": "ran", "located": doc["status"], "line": doc["line"], "folder": job["out"],
            "layer": op["module"] if op else None, "step": doc["captured_step"]}


def layers_probe(pool: Any, config: Any, folder: str | Path | None, out: Path) -> dict[str, Any]:
    """Parent side: the probe's entry of diagnosis.json (`layers`)."""
    from ..backends.base import Backend
    from ..backends.registry import backend_class

    if folder is None:
        return {"status": "skipped", "reason": "no failing check folder to locate"}
    if backend_class(config.backend).capture is Backend.capture:
        return {"status": "skipped", "reason": f"backend {config.backend!r} has no internals to capture"}
    res = pool.shared().run({"kind": "layers", "config": config.to_json(), "folder": str(folder), "out": str(out / "layers")})
    if not res.get("ok"):
        return {"status": "error", "reason": res.get("error", "the probe failed")}
    return {k: res[k] for k in ("status", "located", "line", "folder", "layer", "step")}
