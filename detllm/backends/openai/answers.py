"""Reading the answers of OpenAI-compatible servers for the `openai` backend: the first choice,
per-token logprob steps in either OpenAI format (chat's `content` list, which llama-server also uses
on /v1/completions with ids; completions' `tokens`/`token_logprobs`/`top_logprobs`), token ids where
the server gives them (an `id` field, vLLM's `token_id:N`), the prompt tokens served from cache, and
the requests a server says it is computing (/slots, /metrics: busy_from). Pure functions on JSON and
text; no HTTP, no runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from ...core.errors import BackendError

_TOKEN_ID = re.compile(r"^token_id:(\d+)$")  # vLLM's return_tokens_as_token_ids spelling
_INF = float("inf")
# /metrics gauges of requests the engine is computing right now (vLLM, SGLang, TGI)
RUNNING_GAUGES = re.compile(r"^(vllm:num_requests_running|sglang:num_running_reqs|tgi_batch_current_size)(\{[^}]*\})?\s+([0-9.eE+-]+)\s*$",
                            re.M)


@dataclass
class _Step:
    token: str
    id: int | None
    logprob: float | None
    top: list[tuple[str, int | None, float | None]]


def choice(doc: Any) -> dict[str, Any]:
    try:
        choice = doc["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise BackendError(f"the server's answer has no choices ({shape(doc)})") from None
    return choice if isinstance(choice, dict) else {}


def shape(doc: Any) -> str:
    """What an answer holds, for an error line: its keys, never its (long, partly private) values."""
    if isinstance(doc, dict):
        keys = sorted(str(k) for k in doc)
        return "its keys: " + ", ".join(keys[:12]) + (", ..." if len(keys) > 12 else "") if keys else "an empty object"
    if isinstance(doc, list):
        return f"a JSON list of {len(doc)}"
    return "a text answer, not JSON" if isinstance(doc, str) else "no body"


def _tok(token: Any, ident: Any) -> tuple[str, int | None]:
    """(text, id): an explicit id wins; vLLM's 'token_id:N' strings carry one."""
    if ident is None and type(token) is str and not token.startswith("token_id:"):
        return token, None  # the common case, without the regex (~150,000 calls per 1,600 answers of 16 x top-5)
    text = str(token) if token is not None else ""
    if isinstance(ident, int) and ident >= 0:
        return text, ident
    m = _TOKEN_ID.match(text)
    return (text, int(m.group(1))) if m else (text, None)


def steps(lp: Any) -> list[_Step] | None:
    """Per-token steps from either OpenAI logprobs format: chat's {"content": [...]} (llama-server
    uses it on /v1/completions too, with ids) or completions' {"tokens", "token_logprobs", "top_logprobs"}."""
    if not isinstance(lp, dict):
        return None
    out: list[_Step] = []
    if isinstance(lp.get("content"), list):
        for e in lp["content"]:
            tok, tid = _tok(e.get("token"), e.get("id"))
            top = [(*_tok(t.get("token"), t.get("id")), _f(t.get("logprob"))) for t in e.get("top_logprobs") or []]
            out.append(_Step(tok, tid, _f(e.get("logprob")), top))
        return out
    tokens = lp.get("tokens")
    if isinstance(tokens, list):
        lps = lp.get("token_logprobs") or [None] * len(tokens)
        tops = lp.get("top_logprobs") or [None] * len(tokens)
        for tok, l, top in zip(tokens, lps, tops):
            t, tid = _tok(tok, None)
            if type(top) is dict and _plain(top):  # the common case: text keys, finite float values (~2x faster)
                pairs = [(k, None, v) for k, v in sorted(top.items(), key=_value, reverse=True)]  # reverse keeps ties in order
            else:
                pairs = [(*_tok(k, None), _f(v)) for k, v in (top or {}).items()]
                pairs.sort(key=_rank)  # most likely first; stable, so ties keep the server's order
            out.append(_Step(t, tid, _f(l), pairs))
        return out
    return None


def plain_steps(lp: Any) -> tuple[list[str], list[str], list[float | None], list[list[tuple[str, float]]]] | None:
    """(tokens, their texts: the same strings in a list of its own, logprobs, top-k as (text, logprob) best
    first) of a completions answer laid out as most servers send it, read without a step object each: one
    or more token texts (no vLLM 'token_id:N'), token_logprobs and top_logprobs of the same length, every
    top-k entry a text and a finite float. What steps() would give for it, as _generation uses it; None
    for anything else (steps() reads it)."""
    if type(lp) is not dict or isinstance(lp.get("content"), list):
        return None
    tokens, lps, tops = lp.get("tokens"), lp.get("token_logprobs"), lp.get("top_logprobs")
    if type(tokens) is not list or not tokens or type(lps) is not list or type(tops) is not list \
            or not len(tokens) == len(lps) == len(tops):
        return None
    for t in tokens:
        if type(t) is not str or t.startswith("token_id:"):
            return None
    for top in tops:
        if type(top) is not dict or not _plain(top):
            return None
    # reverse keeps ties in the server's order, as steps() does
    return tokens, list(tokens), [_f(x) for x in lps], [sorted(top.items(), key=_value, reverse=True) for top in tops]


def _plain(top: dict[Any, Any]) -> bool:
    """Every key a token text (no vLLM 'token_id:N') and every value a finite float: taken as they are."""
    for k, v in top.items():
        if type(k) is not str or type(v) is not float or not -_INF < v < _INF or k.startswith("token_id:"):
            return False
    return True


_value = itemgetter(1)


def _rank(pair: tuple[str, int | None, float | None]) -> float:
    return -pair[2] if pair[2] is not None else 1e30


def _f(x: Any) -> float | None:
    if type(x) is float:  # the common case: a JSON number with a fraction
        return x if x == x and -_INF < x < _INF else None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if v == v and abs(v) != float("inf") else None


def cached_tokens(doc: Any) -> int | None:
    """Prompt tokens the server reused from its cache: OpenAI usage.prompt_tokens_details.cached_tokens,
    or llama-server's timings.cache_n."""
    if not isinstance(doc, dict):
        return None
    details = (doc.get("usage") or {}).get("prompt_tokens_details") if isinstance(doc.get("usage"), dict) else None
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return details["cached_tokens"]
    timings = doc.get("timings")
    if isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):
        return timings["cache_n"]
    return None


def busy_from(source: str, body: Any) -> int | None:
    """Requests the server is computing: /slots (llama-server) counts slots with is_processing,
    /metrics sums the running-request gauges."""
    if source == "/slots":
        if isinstance(body, list):
            return sum(1 for s in body if isinstance(s, dict) and (s.get("is_processing") or s.get("state") == 1))
        return None
    if isinstance(body, str):
        found = RUNNING_GAUGES.findall(body)
        return int(sum(float(v) for *_, v in found)) if found else None
    return None


__all__ = ["busy_from", "cached_tokens", "choice", "plain_steps", "shape", "steps"]
