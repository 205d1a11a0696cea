"""Which rows of a vLLM forward pass belong to which request, read inside a hook.

vLLM flattens every sequence of a step into `[num_tokens, ...]`; request i of the model runner's
input batch owns rows `query_start_loc[i]:query_start_loc[i+1]` of the forward context's attention
metadata, and its logits are row i. Used by capture.py and perturbing.py; vLLM is imported when a
hook fires, never at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...core.errors import BackendError


@dataclass(frozen=True)
class Span:
    """One request's rows in one forward pass."""

    req_id: str  # vLLM's request id ("<counter>-<suffix>"): the counter is LLM.request_counter's value
    index: int  # its index in the input batch: its logits row
    start: int  # its rows of the flattened tensors: start..end-1
    end: int
    first: int  # the positions of its first and last query token
    last: int
    prompt_len: int

    @property
    def step(self) -> int | None:
        """The generated-token step this forward yields for the request (0: the prefill); None: a
        prefill chunk before the last one, which yields no token."""
        s = self.last - self.prompt_len + 1
        return s if s >= 0 else None


def runner_of(llm: Any) -> Any:
    """The in-process model runner (multiprocessing off): its input batch maps request ids to rows."""
    worker = getattr(llm.llm_engine.model_executor, "driver_worker", None)
    runner = getattr(getattr(worker, "worker", None), "model_runner", None)
    if runner is None or not hasattr(runner, "input_batch"):
        raise BackendError("vLLM hooks need the in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, one worker)")
    return runner


def _metadata(forward_context: Any) -> Any:
    meta = getattr(forward_context, "attn_metadata", None)
    if isinstance(meta, dict):
        return next(iter(meta.values()), None)
    if isinstance(meta, list) and meta:  # micro-batched: one dict per ubatch
        return next(iter(meta[0].values()), None)
    return meta


def spans(runner: Any, args: tuple, kwargs: dict) -> tuple[list[Span], int] | None:
    """(each request's rows, tokens in the whole forward) for the forward whose root module was
    called with `args`/`kwargs`; None outside a model forward (no attention metadata)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    meta = _metadata(get_forward_context())
    positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
    if meta is None or positions is None or getattr(meta, "query_start_loc", None) is None:
        return None
    batch = runner.input_batch
    qsl = meta.query_start_loc.tolist()
    out = []
    for req_id in batch.req_ids:
        if req_id is None:
            continue
        i = batch.req_id_to_index[req_id]
        start, end = int(qsl[i]), int(qsl[i + 1])
        if end > start:
            out.append(Span(req_id, i, start, end, int(positions[start]), int(positions[end - 1]),
                            int(batch.num_prompt_tokens[i])))
    return out, int(qsl[len(batch.req_ids)])


__all__ = ["Span", "runner_of", "spans"]
