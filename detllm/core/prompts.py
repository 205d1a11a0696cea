"""Prompt sets: the built-in defaults, prompt files, and filler prompts for batches.

A prompt file is `.jsonl` (one JSON object per line with a "prompt" or "text"
string, or a bare JSON string), `.json` (one JSON array of such values) or plain text
(one prompt per non-blank line); the seed's `--prompt-file` is always JSONL. Prompts may also be given inline (`--prompt`,
the API's `prompts=[...]`). Read and validated before anything runs; a bad file is
one UsageError naming the line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Sequence

from .errors import UsageError
from .hashing import sha256_text

BUILTIN_PROMPTS = (
    "The capital of France is",
    "Once upon a time",
    "def add(a, b):",
    "When two runs disagree, the first divergent token",
)
# Fill a batch up to its size when the prompt set is smaller; never traced.
FILLERS = (
    "The quick brown fox jumps over the lazy dog.",
    "Numbers: 1 2 3 4 5 6 7 8 9 10",
    "Machine learning models predict the next token",
    "Every morning the robot walked to the harbour",
    "Questions? Answers! Lists; items, commas, and",
    "A repro pack holds the environment",
    "Batch size, threads, kernels and library versions",
    "The capital of Italy is Rome. The capital of Spain is",
)


@dataclass(frozen=True)
class PromptSet:
    texts: tuple[str, ...]
    source: str  # file path or "builtin"

    @cached_property  # computed once: the runner reads ids[i] per record (a property made a run quadratic)
    def ids(self) -> tuple[str, ...]:
        return tuple(sha256_text(t) for t in self.texts)

    @cached_property
    def occurrences(self) -> tuple[int, ...]:
        """Per prompt, how many earlier prompts have the same id: with the id, the key of the
        per-request seed rule (backends.base.request_seed)."""
        seen: dict[str, int] = {}
        out = []
        for pid in self.ids:
            out.append(seen.get(pid, 0))
            seen[pid] = out[-1] + 1
        return tuple(out)

    @cached_property
    def sha256(self) -> str:
        return sha256_text("\n".join(self.ids))


def inline_prompts(texts: Sequence[str]) -> PromptSet:
    """Prompts given as strings (`--prompt`, `prompts=[...]`)."""
    texts = tuple(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str) or not t:
            raise UsageError(f"prompt {i} must be a non-empty string, got {t!r}"[:200])
    if not texts:
        raise UsageError("the prompt list is empty", hint="give at least one prompt")
    return PromptSet(texts, "inline")


def resolve_prompts(prompts: "str | Path | Sequence[str] | PromptSet | None" = None, *, texts: Sequence[str] = (),
                    jsonl_file: str | Path | None = None) -> PromptSet:
    """One prompt set from the ways a user can give one: a file (`--prompts`, `prompts="f.jsonl"`),
    a JSONL file (`--prompt-file`), or strings (`--prompt`, `prompts=[...]`). More than one source
    is a UsageError; none gives the built-in prompts."""
    if isinstance(prompts, PromptSet) and not texts and jsonl_file is None:
        return prompts  # already resolved (the CLI resolves before it calls the API)
    given = [x for x in (prompts, jsonl_file, tuple(texts) or None) if x is not None]
    if len(given) > 1:
        raise UsageError("give prompts one way: --prompt, --prompt-file or --prompts")
    if jsonl_file is not None:
        return load_prompts(jsonl_file, jsonl=True)
    if texts:
        return inline_prompts(texts)
    if isinstance(prompts, (list, tuple)):
        return inline_prompts(prompts)
    if prompts is not None and not isinstance(prompts, (str, Path)):
        raise UsageError(f"prompts must be a list of strings or a file path, got {type(prompts).__name__}")
    if isinstance(prompts, str) and not Path(prompts).exists():
        raise UsageError(f"prompt file {prompts!r} does not exist", hint="to give prompt strings, pass a list: prompts=[...]")
    return load_prompts(prompts)


def _prompt_of(obj: object, where: str) -> str:
    """A prompt from one JSON value: a string, or an object's "prompt" (or "text") string."""
    text = obj if isinstance(obj, str) else obj.get("prompt", obj.get("text")) if isinstance(obj, dict) else None
    if not isinstance(text, str) or not text:
        raise UsageError(f"{where}: expected an object with a non-empty \"prompt\" (or \"text\") string, or a non-empty string")
    return text


def load_prompts(path: str | Path | None, *, jsonl: bool | None = None) -> PromptSet:
    """The built-in prompts (no path) or a prompt file; `jsonl` forces (or forbids) JSONL,
    otherwise the suffix decides: `.jsonl` JSONL, `.json` one JSON array, else one prompt per line."""
    if path is None:
        return PromptSet(BUILTIN_PROMPTS, "builtin")
    p = Path(path)
    if not p.exists():
        raise UsageError(f"prompt file {str(p)!r} does not exist")
    try:
        raw = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"prompt file {str(p)!r} cannot be read as UTF-8 text: {exc.__class__.__name__}") from exc
    texts: list[str] = []
    if jsonl or (jsonl is None and p.suffix == ".jsonl"):
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise UsageError(f"prompt file {str(p)!r} line {n}: not valid JSON") from exc
            texts.append(_prompt_of(obj, f"prompt file {str(p)!r} line {n}"))
    elif p.suffix == ".json":  # one JSON document: an array of prompts, never one text prompt holding the brackets
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise UsageError(f"prompt file {str(p)!r}: not valid JSON ({exc.msg}, line {exc.lineno})",
                             hint="a .json prompt file holds one JSON array; for one prompt per line use .txt, for JSONL .jsonl") from exc
        if not isinstance(doc, list):
            raise UsageError(f"prompt file {str(p)!r}: a .json prompt file holds a JSON array of prompts, got a JSON {type(doc).__name__}",
                             hint='["first prompt", {"prompt": "second"}]; for JSONL use .jsonl')
        texts = [_prompt_of(obj, f"prompt file {str(p)!r} item {i}") for i, obj in enumerate(doc)]
    else:
        texts = [line for line in raw.splitlines() if line.strip()]
    if not texts:
        raise UsageError(f"prompt file {str(p)!r} holds no prompts")
    return PromptSet(tuple(texts), str(p))
