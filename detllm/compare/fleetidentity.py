"""What a replica is, as its run folder recorded it: the model (path, weights, quantization), the
engine or server build and props (for a served endpoint: /props, /version, /v1/models and the
/metrics info labels the openai backend records in env.json; the system_fingerprint of its
answers), the settings in effect and the run's config. Replicas whose identities differ are named
before any output is compared. Reads Sides only; the address of a replica is not its identity.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..compare.causes import Side
from ..compare.causes.sides import flat_diff

# run_config.config fields that say how a replica computes, not how detllm drove it (runs, batch
# sizes, tier and out are the plan of the check, the same for every replica of one fleet check)
CONFIG_FIELDS = ("backend", "model", "revision", "dtype", "device", "threads", "seed", "decoding", "logprobs")
NOT_IDENTITY_OPTIONS = ("base_url", "api_key_env")  # where a replica is reached and its key's name
NOT_IDENTITY_SERVED = ("base_url", "api_key_env", "headers")  # env.backend: the address, and per-answer headers


def identity(side: Side) -> dict[str, Any]:
    """A replica's identity as one JSON object (see the module docstring)."""
    rc, env, applied = side.run_config or {}, side.env or {}, side.applied or {}
    cfg = rc.get("config") or {}
    config = {k: cfg.get(k) for k in CONFIG_FIELDS if k in cfg}
    options = cfg.get("options") or {}
    if isinstance(options, dict):
        config["options"] = {k: v for k, v in options.items() if k not in NOT_IDENTITY_OPTIONS}
    model = {k: v for k, v in (rc.get("model") or {}).items() if k != "remote"}  # remote names the URL
    served = {k: v for k, v in (env.get("backend") or {}).items() if k not in NOT_IDENTITY_SERVED}
    server_header = ((env.get("backend") or {}).get("headers") or {})
    if isinstance(server_header, dict):
        served["server_header"] = next((v for k, v in server_header.items() if k.lower() == "server"), None)
    settings = {s["name"]: s.get("effective") for s in applied.get("settings", []) if isinstance(s, dict) and "name" in s}
    fingerprints = sorted({str(r["evidence"]["system_fingerprint"]) for r in side.records or ()
                           if isinstance(r.get("evidence"), dict) and r["evidence"].get("system_fingerprint")})
    return {"model": model, "engine": served, "libraries": env.get("libraries"), "settings": settings, "config": config,
            "system_fingerprints": fingerprints}


def digest(ident: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def identity_groups(sides: dict[int, Side]) -> dict[str, Any]:
    """Replicas grouped by identity, largest group first; with a strict majority, the replicas
    outside it are `mismatched` and each difference from the majority's identity is listed."""
    idents = {i: identity(s) for i, s in sides.items()}
    by_digest: dict[str, list[int]] = {}
    for i, ident in idents.items():
        by_digest.setdefault(digest(ident), []).append(i)
    groups = sorted(by_digest.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    major = groups[0][1] if groups and 2 * len(groups[0][1]) > len(sides) else None
    mismatched = sorted(i for _, g in groups[1:] for i in g) if major else []
    differences = []
    ref = groups[0][1][0] if groups else None
    for _, g in groups[1:]:
        for d in flat_diff(idents[ref], idents[g[0]])[:20]:
            differences.append({"replicas": g, "against": ref, "field": d["field"], "reference": d["left"], "value": d["right"]})
    return {"groups": [{"digest": d, "replicas": g} for d, g in groups], "majority": major, "mismatched": mismatched,
            "differences": differences}


__all__ = ["identity", "identity_groups"]
