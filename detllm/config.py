"""Run configuration as frozen dataclasses, validated once, before anything runs.

Owns: what the user asked for (backend, model, decoding, tier, batches, runs).
Does not own: what a backend actually applied (see backends/base.py `Applied`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .errors import UsageError

TIERS = {
    0: "artifacts only: runs are recorded, nothing is required to agree",
    1: "token ids repeat across runs at a fixed batch size",
    2: "tier 1, and the chosen token's logprob and the top-k logprobs are equal",
    3: "tier 2, and outputs are equal across batch sizes (batch invariance enforced)",
}
MODES = ("strict", "best-effort")
DTYPES = ("float32", "bfloat16", "float16", "auto")
DEVICES = ("cpu", "cuda", "auto")


@dataclass(frozen=True)
class Decoding:
    max_new_tokens: int = 16  # generated tokens per prompt, padding never counted
    temperature: float = 0.0  # 0 means greedy (argmax); > 0 samples
    top_p: float = 1.0  # nucleus filter when sampling; 1.0 disables it
    top_k: int = 0  # sampling filter (not the logprob top-k); 0 disables it

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise UsageError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be >= 0, got {self.top_k}")


@dataclass(frozen=True)
class RunConfig:
    backend: str = "hf"  # registry name: hf, vllm, llamacpp, fake
    model: str = "tiny"  # built-in name, local path, or hub id
    revision: str | None = None  # hub revision; recorded even when None
    dtype: str = "float32"  # weights/activations dtype the backend is asked for
    device: str = "cpu"  # cpu, cuda, or auto (cuda when present)
    decoding: Decoding = field(default_factory=Decoding)
    seed: int = 0  # seeds python/numpy/torch and every per-request generator
    tier: int = 1  # requested determinism tier (see TIERS)
    mode: str = "best-effort"  # strict refuses an unenforceable tier, best-effort downgrades
    batch_size: int = 1  # batch size of the repeated runs
    vary_batch: tuple[int, ...] = ()  # extra batch sizes compared against batch size 1
    runs: int = 1  # repeats at batch_size (check needs >= 2)
    logprobs: int = 5  # (id, logprob) pairs recorded per step, best first (OpenAI: top_logprobs); not a sampling filter
    record_prompt_text: bool = True  # False keeps only the sha256 of each prompt
    threads: int | None = None  # intra-op threads; None keeps the backend default
    atol: float = 0.0  # logprob tolerance at tier 2; 0 means bitwise
    options: tuple[tuple[str, str], ...] = ()  # backend-specific key=value, typed by the backend

    def validate(self, *, command: str = "run") -> None:
        if self.tier not in TIERS:
            raise UsageError(f"--tier must be 0, 1, 2 or 3, got {self.tier}")
        if self.mode not in MODES:
            raise UsageError(f"--mode must be strict or best-effort, got {self.mode!r}")
        if self.dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise UsageError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.batch_size < 1:
            raise UsageError(f"--batch-size must be at least 1, got {self.batch_size}")
        for b in self.vary_batch:
            if b < 1:
                raise UsageError(f"--vary-batch sizes must be at least 1, got {b}")
        if command == "check" and self.tier == 3 and not self.vary_batch:
            raise UsageError("tier 3 promises batch invariance, which a check without --vary-batch never tests",
                             hint="add --vary-batch, e.g. 1,2,8")
        if command == "check" and self.runs < 2:
            raise UsageError(f"check needs --runs of at least 2 to compare runs, got {self.runs}")
        if self.runs < 1:
            raise UsageError(f"--runs must be at least 1, got {self.runs}")
        if self.logprobs < 1:
            raise UsageError(f"--logprobs must be at least 1, got {self.logprobs}")
        if self.threads is not None and self.threads < 1:
            raise UsageError(f"--threads must be at least 1, got {self.threads}")
        if self.atol < 0:
            raise UsageError(f"--atol must be >= 0, got {self.atol}")
        if self.seed < 0:
            raise UsageError(f"--seed must be >= 0, got {self.seed}")
        self.decoding.validate()

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """Every batch size this config runs, the repeated one first, without repeats."""
        sizes = [self.batch_size]
        extra = list(self.vary_batch)
        if extra and 1 not in extra and 1 != self.batch_size:
            extra.insert(0, 1)  # vary-batch sizes are compared against batch size 1
        for b in extra:
            if b not in sizes:
                sizes.append(b)
        return tuple(sizes)

    def option_dict(self) -> dict[str, str]:
        return dict(self.options)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["vary_batch"] = list(self.vary_batch)
        d["options"] = dict(self.options)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RunConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if "logprobs_top_k" in d and "logprobs" not in d:  # schema_version 1 named it logprobs_top_k (detllm/versions.py)
            kw["logprobs"] = d["logprobs_top_k"]
        kw["decoding"] = Decoding(**d["decoding"])
        kw["vary_batch"] = tuple(d.get("vary_batch", ()))
        kw["options"] = tuple(sorted((str(k), str(v)) for k, v in dict(d.get("options", {})).items()))
        return cls(**kw)


def parse_options(pairs: list[str]) -> tuple[tuple[str, str], ...]:
    """`--opt key=value` strings to sorted pairs; a malformed pair is a UsageError."""
    out: dict[str, str] = {}
    for p in pairs:
        if "=" not in p or not p.split("=", 1)[0].strip():
            raise UsageError(f"--opt expects key=value, got {p!r}")
        k, v = p.split("=", 1)
        out[k.strip()] = v.strip()
    return tuple(sorted(out.items()))


def parse_batch_list(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise UsageError(f"--vary-batch expects comma-separated integers like 1,2,8, got {text!r}") from exc
