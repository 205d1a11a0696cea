"""How a check's prompts are batched and recorded: the batch plan (prompts topped up with
fillers), the Requests of one batch (keyed for the seed rule), and the trace record of one
generation. Shared by the runner and the negative control; runs nothing itself.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Sequence

from ..runfolder.artifacts import stamp
from ..backends.base import Request
from ..core.config import RunConfig
from ..core.hashing import canonical_json, sha256_bytes, sha256_text
from ..core.prompts import FILLERS, PromptSet


def plan_batches(n_prompts: int, batch_size: int) -> list[list[int]]:
    """Prompt indexes per batch; short batches are topped up with fillers (index < 0)."""
    batches = []
    for start in range(0, n_prompts, batch_size):
        idx = list(range(start, min(start + batch_size, n_prompts)))
        idx += [-(k + 1) for k in range(batch_size - len(idx))]
        batches.append(idx)
    return batches


@lru_cache(maxsize=1 << 16)
def _ids_sha256(ids: tuple[int, ...]) -> str:
    """sha256 of input ids as canonical JSON, once per prompt (it is recorded per run and batch size)."""
    return sha256_bytes(canonical_json(list(ids)))


def trace_record(config: RunConfig, prompts: PromptSet, i: int, ids: Sequence[int], gen, run: int, batch: int, pos: int) -> dict[str, Any]:
    """The trace record of prompt `i` (input `ids`) generated as `gen`, in repeat `run`, at position
    `pos` of a batch of `batch`: key order and spelling are the trace's contract (schemas/)."""
    keep = config.record_prompt_text
    rec = stamp("trace_record", {
        "run_index": run,
        "batch_size": batch,
        "batch_position": pos,
        "prompt_index": i,
        "prompt_id": prompts.ids[i],
        "prompt_text": prompts.texts[i] if keep else None,
        "input_ids": list(ids) if keep else None,
        "input_ids_sha256": _ids_sha256(tuple(ids)),
        "token_ids": list(gen.token_ids),
        "token_texts": list(gen.token_texts),
        "text": gen.text,
        "logprobs": gen.logprobs,
        "top_logprobs": [[[t, lp] for t, lp in step] for step in gen.top_logprobs] if gen.top_logprobs is not None else None,
        "finish_reason": gen.finish_reason,
    })
    if gen.evidence is not None:  # what the engine reported about this request and its batch
        add_evidence(rec, gen.evidence)
    return rec


def add_evidence(rec: dict[str, Any], evidence: dict[str, Any]) -> None:
    """Merge `evidence` into the record's, every nested key in sorted order: the line the trace writer
    emits is then its own canonical JSON, the guess verify's fast path trusts (any other order is
    re-serialised: slower, same answer)."""
    rec["evidence"] = _key_sorted({**(rec.get("evidence") or {}), **evidence})


def _key_sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _key_sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_key_sorted(v) for v in value]
    return value


_FILLER_KEYS = tuple("filler:" + sha256_text(t) for t in FILLERS)  # the fillers' seed keys (request_seed)


def batch_requests(prompts: PromptSet, batch: Sequence[int], input_ids: Sequence[tuple[int, ...]],
                   filler_ids: Sequence[tuple[int, ...]]) -> list[Request]:
    """One batch of plan_batches() as Requests: prompts keyed by (id, occurrence) for the seed
    rule, fillers (index < 0) by their own text."""
    return [Request(i, input_ids[i], prompts.texts[i], prompts.ids[i], prompts.occurrences[i]) if i >= 0
            else Request(i, filler_ids[(-i - 1) % len(filler_ids)], FILLERS[(-i - 1) % len(FILLERS)],
                         _FILLER_KEYS[(-i - 1) % len(FILLERS)])
            for i in batch]
