"""Prompt sets: the built-in defaults, prompt files, and filler prompts for batches.

A prompt file is `.jsonl` (one JSON object per line with a "prompt" or "text"
string) or plain text (one prompt per non-blank line). Read and validated before
anything runs; a bad file is one UsageError naming the line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(sha256_text(t) for t in self.texts)

    @property
    def sha256(self) -> str:
        return sha256_text("\n".join(self.ids))


def load_prompts(path: str | Path | None) -> PromptSet:
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
    if p.suffix == ".jsonl":
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise UsageError(f"prompt file {str(p)!r} line {n}: not valid JSON") from exc
            text = obj.get("prompt", obj.get("text")) if isinstance(obj, dict) else None
            if not isinstance(text, str) or not text:
                raise UsageError(f"prompt file {str(p)!r} line {n}: expected an object with a non-empty \"prompt\" string")
            texts.append(text)
    else:
        texts = [line for line in raw.splitlines() if line.strip()]
    if not texts:
        raise UsageError(f"prompt file {str(p)!r} holds no prompts")
    return PromptSet(tuple(texts), str(p))
