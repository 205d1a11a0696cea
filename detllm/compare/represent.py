"""Like with like: two records of one prompt made comparable before anything compares them.

A served run (backend openai) may record what a local engine records in another form: token
strings where the server gave no ids (`evidence.tokens_as` "strings"), the whole text as one
"token" ("whole text"), or no input ids at all when the server tokenized the prompt text itself
(`evidence.prompt_as` "text": the input ids are unknown). Comparing those raw calls a
representation a flip and an unknown a difference. `comparable` maps each mixed pair to one
representation: token texts on both sides (the top-k keyed by text where every entry's text is
known, else not compared), the text alone when one side has nothing finer, and unknown input ids
taken as neither equal nor different. Pairs recorded alike are returned untouched (the same
objects, so the fast path still reads them from disk). Does not find divergences (divergence.py).
"""

from __future__ import annotations

from typing import Any

from ..core.hashing import sha256_bytes
from .trace import TraceRecord, same_output

EMPTY_IDS_SHA256 = sha256_bytes(b"[]")  # the runner's input_ids_sha256 of no ids: the server tokenized the text


def input_ids_known(rec: dict[str, Any]) -> bool:
    """False when the record holds no input ids of its own: the server tokenized the prompt text."""
    ev = rec.get("evidence")
    return not (isinstance(ev, dict) and ev.get("prompt_as") == "text") and rec["input_ids_sha256"] != EMPTY_IDS_SHA256


def representation(rec: dict[str, Any]) -> str:
    """"ids", "strings" (token strings in token_ids) or "text" (the whole text as one entry)."""
    ev = rec.get("evidence")  # only a served engine's records carry it; a local engine records ids
    said = ev.get("tokens_as") if isinstance(ev, dict) else None
    if said == "whole text":
        return "text"
    if said == "strings" or (isinstance(ev, dict) and any(isinstance(t, str) for t in rec["token_ids"])):
        return "strings"
    return "ids"


def _load(rec: dict[str, Any]) -> dict[str, Any]:
    load = getattr(rec, "load", None)  # a TraceRecord read from disk: its payload parsed first
    return dict(load() if load is not None else rec)


class _IdsUnknown(TraceRecord):
    """A TraceRecord with its input ids unknown (None), over the same payload bytes as the record it
    stands for: a pair of these is taken as identical without being parsed or walked (engine.compare),
    as a pair with known ids is (a fleet of servers that tokenize the text themselves: 28 pairs x 100
    prompts for 8 replicas). Its payload, when read, is the record's, parsed and validated there."""

    __slots__ = ("_of",)

    def load(self) -> "TraceRecord":
        if "token_ids" not in self.keys():
            self.update({k: v for k, v in self._of.load().items() if k not in _UNKNOWN})
        return self


_UNKNOWN = {"input_ids_sha256": None, "input_ids": None}


def _ids_unknown(rec: TraceRecord) -> TraceRecord:
    out = _IdsUnknown({**rec, **_UNKNOWN}, rec._src, rec._start, rec._end, rec.where)
    out._of = rec
    return out


def _vocabulary(records: list[dict[str, Any]]) -> dict[int, str]:
    """id -> text of every generated token the records hold (what they say about their tokenizer)."""
    vocab: dict[int, str] = {}
    for r in records:
        for i, t in zip(r["token_ids"], r["token_texts"]):
            if isinstance(i, int):
                vocab.setdefault(i, t)
    return vocab


def _as_text(rec: dict[str, Any], kind: str, vocab: dict[int, str]) -> tuple[list[str], list[Any] | None]:
    """(tokens as strings, top-k keyed by text or None when an entry's text is unknown)."""
    if kind == "strings":
        return [str(t) for t in rec["token_ids"]], rec.get("top_logprobs")
    top = rec.get("top_logprobs")
    if top is not None and all(t[0] in vocab for step in top for t in step):
        top = [[[vocab[t[0]], t[1]] for t in step] for step in top]
    else:
        top = None
    return list(rec["token_texts"]), top


def _pair(a: dict[str, Any], b: dict[str, Any], vocab: dict[int, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    ka, kb = representation(a), representation(b)
    known = input_ids_known(a) and input_ids_known(b)
    if ka == kb and known:
        return a, b
    if ka == kb != "text" and same_output(a, b):  # byte-identical payloads, only the input ids unknown
        return _ids_unknown(a), _ids_unknown(b)
    a, b = _load(a), _load(b)
    if not known:  # unknown input ids are neither equal nor different: not compared
        a["input_ids_sha256"] = b["input_ids_sha256"] = None
        a["input_ids"] = b["input_ids"] = None
    if "text" in (ka, kb):  # nothing finer than the text on one side: compare the texts
        for r in (a, b):
            r.update(token_ids=[r["text"]] if r["text"] else [], token_texts=[r["text"]] if r["text"] else [],
                     logprobs=None, top_logprobs=None)
    elif ka != kb:  # token strings on one side: both sides' tokens as text, the top-k by text where known
        (ta, topa), (tb, topb) = _as_text(a, ka, vocab), _as_text(b, kb, vocab)
        both = topa is not None and topb is not None
        a.update(token_ids=ta, top_logprobs=topa if both else None)
        b.update(token_ids=tb, top_logprobs=topb if both else None)
    return a, b


def mixed(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[str]:
    """What the pairs hold in different forms: "token representation", "input ids" (unknown on a side)."""
    out = []
    if any(representation(a) != representation(b) for a, b in pairs):
        out.append("token representation")
    if any(not (input_ids_known(a) and input_ids_known(b)) for a, b in pairs):
        out.append("input ids")
    return out


def comparable(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The aligned pairs, each in one representation on both sides (see the module docstring)."""
    if not mixed(pairs):
        return pairs
    vocab = _vocabulary([r for p in pairs for r in p if representation(r) == "ids"])
    return [_pair(a, b, vocab) for a, b in pairs]
