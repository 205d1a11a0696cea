"""How many prompts a check's PASS needs (`check --max-rate R --confidence C`), and the seeded
filler prompts `--fill-prompts` adds from a built-in corpus when the user's are fewer.

Owns the refusal before anything runs (too few prompts, no --fill-prompts: UsageError, exit 2)
and the corpus. The fillers follow the user's prompts, so prompt indexes below
RunConfig.user_prompts are the user's (engagement.py bounds the two apart).
"""

from __future__ import annotations

import dataclasses
import random

from ..core.config import RunConfig
from ..core.errors import UsageError
from ..core.prompts import PromptSet

_OPENINGS = ("Explain in one paragraph", "Write three sentences about", "Describe for a new student", "List the main facts about",
             "Summarise what is known about", "Give a short example involving", "Compare two views of", "Tell a short story about")
_TOPICS = ("how tides follow the moon", "the water cycle", "prime numbers", "how a bicycle stays upright", "photosynthesis",
           "the history of the printing press", "why the sky is blue", "sorting a list of numbers", "volcanoes", "the speed of sound",
           "how bees find flowers", "compound interest", "the rules of chess", "glaciers", "the human heart", "binary numbers",
           "a lighthouse keeper's night", "how bread rises", "the planets of the solar system", "electric circuits",
           "migrating birds", "the first telescope", "recycling paper", "how a compass works", "coral reefs")
CORPUS = tuple(f"{o} {t}." for t in _TOPICS for o in _OPENINGS)  # 200 prompts, each distinct


def fillers(k: int, seed: int) -> tuple[str, ...]:
    """k distinct filler prompts drawn from CORPUS by a generator seeded with the check's seed."""
    if k > len(CORPUS):
        raise UsageError(f"--fill-prompts can add at most {len(CORPUS)} prompts from its corpus; {k} were needed",
                         hint="raise --max-rate or give more prompts of your own")
    return tuple(random.Random(f"detllm-fill-prompts:{seed}").sample(CORPUS, k))


def plan(config: RunConfig, prompts: PromptSet) -> tuple[RunConfig, PromptSet]:
    """(config, prompts) a check with --max-rate runs: unchanged when the prompts suffice; topped up
    with fillers (config.user_prompts set) under --fill-prompts; else refused before running."""
    if config.max_rate is None:
        return config, prompts
    from .engagement import needed  # the bound's arithmetic; engagement's comparisons are for after the runs

    need, have = needed(config.max_rate, config.confidence), len(prompts.texts)
    if have >= need:
        return config, prompts
    if not config.fill_prompts:
        raise UsageError(f"--max-rate {config.max_rate:g} needs {need} prompts for a PASS to bound the per-prompt divergence rate "
                         f"below {config.max_rate:g} at {config.confidence:g} confidence (none diverging); {have} given",
                         hint="add prompts, or --fill-prompts to add seeded fillers from the built-in corpus")
    extra = fillers(need - have, config.seed)
    filled = PromptSet(prompts.texts + extra, f"{prompts.source} + {len(extra)} fillers (--fill-prompts, seed {config.seed})")
    return dataclasses.replace(config, user_prompts=have), filled


__all__ = ["CORPUS", "fillers", "plan"]
