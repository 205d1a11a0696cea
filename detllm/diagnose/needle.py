"""Needle in a batch (the design of vLLM's batch-invariance tests): one prompt placed at seeded
random positions inside batches of random size, next to prompts of other lengths, each output
compared with the prompt generated alone.

Owns the trial plan (pure, seeded) and, in a probe worker, running it on the real engine.
If the prompt's output changes with its company, the divergence follows batch composition.
"""

from __future__ import annotations

import random
from typing import Any

from ..compare.steps import abs_diff
from ..core.config import RunConfig


def trial_plan(n_others: int, *, trials: int, max_size: int, seed: int) -> list[dict[str, Any]]:
    """[{size, position, others}] with 2 <= size <= max_size; `others` index the company pool."""
    rng = random.Random(f"detllm-needle:{seed}")
    plan = []
    for _ in range(trials):
        size = rng.randint(2, max(2, max_size))
        plan.append({"size": size, "position": rng.randrange(size),
                     "others": [rng.randrange(n_others) for _ in range(size - 1)]})
    return plan


def compare_generations(ref, got, *, tier: int, atol: float) -> dict[str, Any]:
    """First differing generated token, max |dlogprob| over the shared steps, top-1 flips."""
    first = next((i for i, (x, y) in enumerate(zip(ref.token_ids, got.token_ids)) if x != y), None)
    if first is None and len(ref.token_ids) != len(got.token_ids):
        first = min(len(ref.token_ids), len(got.token_ids))
    shared = first if first is not None else len(ref.token_ids)
    lp, nulls = None, 0
    if ref.logprobs is not None and got.logprobs is not None:
        # the one NaN rule (compare/steps.py): a null on one side only is a difference, never a number in the maximum
        diffs = [abs_diff(a, b) for a, b in zip(ref.logprobs[:shared], got.logprobs[:shared])]
        nulls = sum(1 for d in diffs if d == float("inf"))
        lp = max((d for d in diffs if d != float("inf")), default=0.0)
    flips = 0
    if ref.top_logprobs and got.top_logprobs:
        flips = sum(1 for a, b in zip(ref.top_logprobs[:shared + 1], got.top_logprobs[:shared + 1]) if a and b and a[0][0] != b[0][0])
    diverged = first is not None or (tier >= 3 and lp is not None and (lp > atol or nulls > 0))
    return {"diverged": diverged, "first_token_index": first, "max_abs_logprob_diff": lp, "argmax_flips": flips,
            "null_logprob_steps": nulls}


def run_needle(config: RunConfig, job: dict[str, Any]) -> dict[str, Any]:
    """Worker side: generate the target alone, then once per trial inside its random batch."""
    from ..backends.base import Request
    from ..backends.registry import create_backend
    from ..core.hashing import sha256_bytes
    from ..core.prompts import FILLERS, load_prompts

    prompts = load_prompts(job.get("prompts"))
    target = job["target"]
    plan = job["plan"]
    tier, atol = job["tier"], config.atol
    with create_backend(config) as backend:
        caps = backend.capabilities()
        with backend.determinism(tier=min(tier, caps.max_tier), seed=config.seed, threads=config.threads):
            pool = [(i, t) for i, t in enumerate(prompts.texts) if i != target] + [(None, t) for t in FILLERS]
            ids = prompts.ids
            req = Request(target, tuple(backend.tokenize(prompts.texts[target])), prompts.texts[target], ids[target],
                          prompts.occurrences[target])
            company = [Request(-(k + 1), tuple(backend.tokenize(t)), t, "filler:" + sha256_bytes(t.encode()))
                       for k, (_, t) in enumerate(pool)]

            def gen(batch):
                return backend.generate(batch, config.decoding, seed=config.seed, n_logprobs=config.logprobs, logprobs=caps.logprobs)

            ref = gen([req])[0]
            trials = []
            for t in plan:
                others = [company[o % len(company)] for o in t["others"]]
                batch = others[: t["position"]] + [req] + others[t["position"]:]
                got = gen(batch)[t["position"]]
                trials.append({"size": t["size"], "position": t["position"], **compare_generations(ref, got, tier=tier, atol=atol)})
    return {"target": target, "trials": trials, "diverged": sum(t["diverged"] for t in trials), "total": len(trials)}
