"""A served endpoint (the `openai` backend) under diagnose: which server answers, and its prompt
cache as a knob.

Owns identifying the server before anything is written (an unreachable endpoint is one line,
exit 4), the cache knob per server kind (llama-server takes `cache_prompt: false` per request,
so it is probed; vLLM's and SGLang's cache is switched where the server is started, so it is
named in skipped_knobs with the reason), and ranking the per-record evidence: the cached prompt
tokens each side of a diverged prompt reused, whether or not the knob could be flipped. Reaches
the backend through the registry only; runs no probe itself.
"""

from __future__ import annotations

from typing import Any

from ..pipeline.cacheprobe import wants_probe
from ..compare.engine import select
from ..compare.steps import abs_diff
from ..core.config import RunConfig
from .probes import Probe

CACHE_KNOB = "cache_prompt"
RECORDED_KNOB = "prefix cache"
_ORDER = {"follows": 0, "vanishes": 1, "moves": 2, "not_followed": 3}


def identify(config: RunConfig) -> dict[str, str] | None:
    """{"server": kind, "cache_switch": how its cache is switched} of the endpoint a served check
    ran against, asked of the live server (/props, /get_server_info, /version, /v1/models); None
    for a local engine. An unreachable endpoint raises BackendUnavailableError (exit 4)."""
    if config.backend != "openai":
        return None
    from ..backends.registry import create_backend

    backend = create_backend(config)
    try:
        info = backend.env_info()
    finally:
        backend.close()
    return {"server": str(info.get("server") or "generic"), "cache_switch": str(info.get("cache_switch") or "")}


def add_cache_knob(probes: list[Probe], skipped: list[dict[str, str]], config: RunConfig,
                   served: dict[str, str] | None) -> tuple[list[Probe], list[dict[str, str]]]:
    """The plan with the served cache's knob: a `cache_prompt=false` probe on llama-server, else
    the reason it cannot be flipped per request. Unchanged for a local engine."""
    if served is None:
        return probes, skipped
    kind, opts = served["server"], config.option_dict()
    if kind == "llamacpp":
        if wants_probe(config):
            skipped.append({"knob": CACHE_KNOB, "reason": "the failing check is a --cache-probe: its sides already are the "
                                                          "cache off (cold) and on (warm)"})
        elif str(opts.get(CACHE_KNOB, "")).lower() in ("0", "false", "no", "off"):
            skipped.append({"knob": CACHE_KNOB, "reason": "already cache_prompt=false in the failing run"})
        else:
            probes.append(Probe(f"{CACHE_KNOB}=false", CACHE_KNOB, "check",
                                "whether a prompt prefix reused from llama-server's cache decides it (cache_prompt: false "
                                "sent with every request, so no request reuses one)", 0.8, options={CACHE_KNOB: "false"}))
            probes.sort(key=lambda p: p.cost)
    elif kind in ("vllm", "sglang"):
        skipped.append({"knob": RECORDED_KNOB, "reason": f"this {kind} server's prefix cache is {served['cache_switch']}; no "
                                                         "request field turns it off for one client, so diagnose cannot flip "
                                                         "it: the recorded cached-token counts are ranked instead"})
    else:
        skipped.append({"knob": RECORDED_KNOB, "reason": "the server is not llama-server, vLLM or SGLang (by /props, "
                                                         "/get_server_info, /version and /v1/models): no cache switch is known "
                                                         "for it; the recorded cached-token counts are ranked instead"})
    return probes, skipped


def _diverged(a: dict[str, Any], b: dict[str, Any], *, logprobs: bool, atol: float) -> bool:
    if a["token_ids"] != b["token_ids"]:
        return True
    return logprobs and any(abs_diff(x, y) > atol for x, y in zip(a.get("logprobs") or [], b.get("logprobs") or []))


def _cached(r: dict[str, Any]) -> int | None:
    v = (r.get("evidence") or {}).get("cached_prompt_tokens")
    return v if isinstance(v, int) else None


def cache_pairs(records: list[dict[str, Any]], *, tier: int, atol: float, base_batch: int, runs: int) -> list[dict[str, Any]]:
    """Every compared pair of one prompt (a repeat against run 0 at the base batch size, a batch
    size against batch 1), with whether it diverged at `tier` and each side's cached prompt tokens."""
    batches = sorted({r["batch_size"] for r in records})
    base = base_batch if base_batch in batches else batches[0]
    sets = [(f"run_{k} vs run_0 @ batch {base}", select(records, run=0, batch=base), select(records, run=k, batch=base), tier >= 2)
            for k in range(1, runs)]
    if 1 in batches:
        sets += [(f"batch {b} vs batch 1", select(records, run=0, batch=1), select(records, run=0, batch=b), tier >= 3)
                 for b in batches if b != 1]
    pairs = []
    for name, left, right, logprobs in sets:
        by = {r["prompt_index"]: r for r in right}
        for a in left:
            b = by.get(a["prompt_index"])
            if b is not None:
                pairs.append({"comparison": name, "prompt_index": a["prompt_index"], "cached": [_cached(a), _cached(b)],
                              "prompt_tokens": (a.get("evidence") or {}).get("prompt_tokens"),
                              "diverged": _diverged(a, b, logprobs=logprobs, atol=atol)})
    return pairs


def cache_evidence(pairs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The recorded cache knob: its verdict and one-line summary, or None when no record says
    how many cached tokens it reused."""
    known = [p for p in pairs if None not in p["cached"]]
    if not known:
        return None
    bad = [p for p in known if p["diverged"]]
    differs = [p for p in bad if p["cached"][0] != p["cached"][1]]
    if not bad:
        return None
    ex = differs[0] if differs else bad[0]
    of = f" of {ex['prompt_tokens']}" if isinstance(ex.get("prompt_tokens"), int) else ""
    example = f"{ex['comparison']}, prompt {ex['prompt_index']}: {ex['cached'][0]} vs {ex['cached'][1]} cached prompt tokens{of}"
    if len(differs) == len(bad):
        return {"verdict": "follows", "summary": f"recorded per record: the two sides of every diverged prompt reused different "
                                                 f"numbers of cached prompt tokens ({len(differs)}/{len(bad)} diverged pairs; "
                                                 f"{example})"}
    if not differs:
        return {"verdict": "not_followed", "summary": f"recorded per record: the two sides of every diverged prompt reused the "
                                                      f"same number of cached prompt tokens ({len(bad)} diverged pairs; {example})"}
    return {"verdict": "not_followed", "summary": f"recorded per record: cached prompt tokens differ in only {len(differs)}/{len(bad)} "
                                                  f"diverged pairs ({example}); the others diverged with equal counts, so the cache "
                                                  "alone does not explain it"}


def rank_cache_evidence(knobs: list[dict[str, Any]], records: list[dict[str, Any]], config: RunConfig, tier: int,
                        served: dict[str, str] | None) -> list[dict[str, Any]]:
    """The ranked knobs with the recorded cache evidence: folded into the cache_prompt probe's
    entry where it ran, else an entry of its own (vLLM, SGLang, an unknown server), re-ranked."""
    if served is None:
        return knobs
    ev = cache_evidence(cache_pairs(records, tier=tier, atol=config.atol, base_batch=config.batch_size, runs=config.runs))
    if ev is None:
        return knobs
    probed = next((k for k in knobs if k["knob"] == CACHE_KNOB), None)
    if probed is not None:
        probed["summary"] = f"{probed['summary']}; {ev['summary']}"
    else:
        why = "" if served["server"] == "llamacpp" else f"; not switchable per request: {served['cache_switch']}"
        knobs = [*knobs, {"knob": RECORDED_KNOB, "verdict": ev["verdict"], "probes": [], "summary": ev["summary"] + why}]
    knobs = sorted(knobs, key=lambda k: _ORDER[k["verdict"]])
    return [dict(k, rank=i) for i, k in enumerate(knobs, 1)]


__all__ = ["CACHE_KNOB", "RECORDED_KNOB", "add_cache_knob", "cache_evidence", "cache_pairs", "identify", "rank_cache_evidence"]
