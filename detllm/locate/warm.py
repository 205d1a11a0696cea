"""What warmed a cache before a recorded batch ran (cold vs warm prefix cache): with vLLM's prefix
caching on, every batch the run folder recorded earlier in the same process (the runner's schedule,
in order: earlier runs and batch sizes, then the earlier batches of the side's own run) left KV
blocks the batch could reuse. locate's re-run replays them, after a cold start, before the batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..backends.base import Request
from ..pipeline.batching import batch_requests, plan_batches
from ..compare.causes import Side
from ..commands.diff import Selection, load_sides
from ..core.errors import UsageError
from ..pipeline.fresh import fresh_runs
from ..core.prompts import FILLERS, PromptSet


def caches_across_batches(config: Any) -> bool:
    """The recorded engine kept a cache across batches: vLLM with prefix caching on."""
    return config.backend == "vllm" and str(dict(config.options).get("prefix_caching", "")).lower() in ("1", "true", "yes", "on")


def earlier(side: Side, config: Any, batch: list[int]) -> tuple[list[list[Request]], list[dict[str, Any]]]:
    """The batches recorded before `batch` of `side` in the same process, as Requests (fillers as
    placeholders, tokenized when the backend starts), and what they were (for locate.json)."""
    if any(r.get("fresh_process") for r in side.records or ()):
        return [], []  # a fresh process started cold
    fresh = fresh_runs(config)
    schedule = [(b, r) for b in config.batch_sizes for r in range(config.runs if b == config.batch_size else 1)]
    schedule = [(b, r) for b, r in schedule if not (b == config.batch_size and r in fresh)]
    mine = (side.batch_size, side.run_index)
    if mine not in schedule:
        return [], []
    before = schedule[:schedule.index(mine)]
    count = side.run_config["prompts"]["count"]
    others = load_sides(*(Selection(Path(side.folder), r, b) for b, r in before)) if before else ()
    batches: list[list[Request]] = []
    said: list[dict[str, Any]] = []
    for (b, r), other in [*zip(before, others), (mine, side)]:
        plan = plan_batches(count, b)
        upto = plan.index(batch) if (b, r) == mine else len(plan)
        if upto == 0:
            continue
        texts, ids = _recorded(other)
        prompts = PromptSet(tuple(texts.get(i, "") for i in range(count)), f"warm-up of {side.label}")
        for members in plan[:upto]:
            missing = [i for i in members if i >= 0 and i not in texts]
            if missing:
                raise UsageError(f"{other.label}: the trace holds no record of prompt(s) {missing[:5]}, recorded before "
                                 f"{side.label} warmed the prefix cache: the warm-up cannot be replayed")
            batches.append(batch_requests(prompts, members, [ids.get(i, ()) for i in range(count)], [()] * len(FILLERS)))
        said.append({"run_index": r, "batch_size": b, "batches": upto, "prompts": sorted({i for m in plan[:upto] for i in m if i >= 0})})
    return batches, said


def _recorded(side: Side) -> tuple[dict[int, str], dict[int, tuple[int, ...]]]:
    texts, ids = {}, {}
    for r in side.records or ():
        if r.get("prompt_text") is None or r.get("input_ids") is None:
            raise UsageError(f"{side.label} was recorded with --no-prompt-text: the batches that warmed the cache cannot be rebuilt")
        texts[r["prompt_index"]], ids[r["prompt_index"]] = r["prompt_text"], tuple(r["input_ids"])
    return texts, ids
