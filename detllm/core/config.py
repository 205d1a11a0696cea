"""Run configuration as frozen dataclasses, validated once, before anything runs.

Owns: what the user asked for (backend, model, decoding, tier, batches, runs), and the
one validation layer for numbers: each numeric field declares its accepted `Range` in its
metadata (backends' Options dataclasses too), and `check_ranges` refuses NaN, infinities,
bools and out-of-range values with one line. docs/cli.md lists every range.
Does not own: what a backend actually applied (see backends/base.py `Applied`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Collection

from .errors import UsageError

# One seed range for every backend: numpy's legacy RNG (seeded by hf) takes 0..2**32-1, and
# torch, random, vLLM and llama.cpp take at least that. Per-request seeds are derived from it
# by backends.base.request_seed, so no engine ever sees a seed outside its own type.
SEED_MAX = 2**32 - 1
INT64_MAX = 2**63 - 1  # the bound of an int option that declares no range (every engine's int type holds it)


@dataclass(frozen=True)
class Range:
    """The accepted values of one numeric setting: a finite number in [lo, hi] (lo excluded
    when lo_open; None: unbounded on that side), an integer when `integer`."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    integer: bool = False

    def check(self, what: str, value: Any) -> None:
        """UsageError naming `what` unless `value` is accepted."""
        kinds = (int,) if self.integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise UsageError(f"{what} must be {'an integer' if self.integer else 'a number'} in {self.text()}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{what} must be a finite number in {self.text()}, got {value}")
        low = self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo))
        if low or (self.hi is not None and value > self.hi):
            raise UsageError(f"{what} must be in {self.text()}, got {value}")

    def text(self) -> str:
        """The range as docs/cli.md writes it, e.g. [0, 4294967295] or (0, 1]."""
        lo = "-inf" if self.lo is None else _num(self.lo)
        hi = "inf" if self.hi is None else _num(self.hi)
        return f"{'(' if self.lo_open or self.lo is None else '['}{lo}, {hi}{')' if self.hi is None else ']'}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def ints(lo: int | None, hi: int | None) -> Range:
    return Range(lo, hi, integer=True)


def floats(lo: float | None, hi: float | None, *, lo_open: bool = False) -> Range:
    return Range(lo, hi, lo_open=lo_open)


def ranged(default: Any, rng: Range) -> Any:
    """A dataclass field with a declared range (dataclasses.field metadata "range")."""
    return field(default=default, metadata={"range": rng})


def field_range(f: dataclasses.Field) -> Range | None:
    """The declared range of a field; a number field without one is still held to finite
    values and to int64 (so an engine never sees NaN or an integer it cannot hold)."""
    rng = f.metadata.get("range")
    if rng is not None:
        return rng
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    if kind.replace(" ", "") in ("int", "int|None"):
        return ints(-INT64_MAX - 1, INT64_MAX)
    if kind.replace(" ", "") in ("float", "float|None"):
        return floats(None, None)
    return None


def check_ranges(obj: Any, flag: Callable[[str], str]) -> None:
    """Every numeric field of the dataclass `obj` against its range; `flag` names a field as
    the user wrote it (--max-new-tokens, --opt port). None (an unset optional) passes."""
    for f in dataclasses.fields(obj):
        rng = field_range(f)
        value = getattr(obj, f.name)
        if rng is not None and value is not None:
            rng.check(flag(f.name), value)


def cli_flag(name: str) -> str:
    return "--" + name.replace("_", "-")

TIERS = {
    0: "artifacts only: runs are recorded, nothing is required to agree",
    1: "token ids repeat across runs at a fixed batch size",
    2: "tier 1, and the chosen token's logprob and the top-k logprobs are equal",
    3: "tier 2, and outputs are equal across batch sizes (batch invariance enforced)",
}
MODES = ("strict", "best-effort")
MAX_BATCH = 4096  # --batch-size and each --vary-batch size
DTYPES = ("float32", "bfloat16", "float16", "auto")
DEVICES = ("cpu", "cuda", "auto")


@dataclass(frozen=True)
class Decoding:
    max_new_tokens: int = ranged(16, ints(1, 1_000_000))  # generated tokens per prompt, padding never counted
    temperature: float = ranged(0.0, floats(0, 100))  # 0 means greedy (argmax); > 0 samples
    top_p: float = ranged(1.0, floats(0, 1, lo_open=True))  # nucleus filter when sampling; 1.0 disables it
    top_k: int = ranged(0, ints(0, 1_000_000))  # sampling filter (not the logprob top-k); 0 disables it; <= any vocabulary

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        check_ranges(self, cli_flag)


@dataclass(frozen=True)
class RunConfig:
    backend: str = "hf"  # registry name: hf, vllm, llamacpp, fake
    model: str = "tiny"  # built-in name, local path, or hub id
    revision: str | None = None  # hub revision; recorded even when None
    dtype: str = "float32"  # weights/activations dtype the backend is asked for
    device: str = "cpu"  # cpu, cuda, or auto (cuda when present)
    decoding: Decoding = field(default_factory=Decoding)
    seed: int = ranged(0, ints(0, SEED_MAX))  # seeds python/numpy/torch and every per-request generator; one range for every backend
    tier: int = 1  # requested determinism tier (see TIERS); 0..3, checked against TIERS
    mode: str = "best-effort"  # strict refuses an unenforceable tier, best-effort downgrades
    batch_size: int = ranged(1, ints(1, MAX_BATCH))  # batch size of the repeated runs
    vary_batch: tuple[int, ...] = ()  # extra batch sizes compared against batch size 1; each in [1, MAX_BATCH]
    runs: int = ranged(1, ints(1, 1000))  # repeats at batch_size (check needs >= 2)
    logprobs: int = ranged(5, ints(1, 100))  # (id, logprob) pairs recorded per step, best first (OpenAI: top_logprobs); not a sampling filter
    record_prompt_text: bool = True  # False keeps only the sha256 of each prompt
    fresh_process: int = 0  # check: this many repeats each run in a new process (fresh.py); 0: all share one process
    negative_control: bool = False  # check: also run one deliberately non-invariant setting, which must differ (control.py)
    require_engagement: bool = False  # check: a comparison whose engagement is not observable is UNVERIFIED (pipeline/engagement.py)
    max_rate: float | None = None  # check: the divergence rate a PASS must bound; refused before running when the prompts are too few
    confidence: float = 0.95  # the one-sided confidence of every PASS's bound
    fill_prompts: bool = False  # check: top the prompts up with seeded fillers until --max-rate can be met
    user_prompts: int | None = None  # set by --fill-prompts (pipeline/fillprompts.py): prompts below this index are the user's
    threads: int | None = ranged(None, ints(1, 1024))  # intra-op threads; None keeps the backend default
    atol: float = ranged(0.0, floats(0, 1000))  # logprob tolerance at tier 2; 0 means bitwise
    options: tuple[tuple[str, str], ...] = ()  # backend-specific key=value, typed by the backend

    def validate(self, *, command: str = "run") -> None:
        check_ranges(self, cli_flag)
        if self.tier not in TIERS:
            raise UsageError(f"--tier must be 0, 1, 2 or 3, got {self.tier}")
        if self.mode not in MODES:
            raise UsageError(f"--mode must be strict or best-effort, got {self.mode!r}")
        if self.dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise UsageError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        for b in self.vary_batch:
            ints(1, MAX_BATCH).check("--vary-batch sizes", b)
        if len(set(self.vary_batch)) != len(self.vary_batch):
            raise UsageError(f"--vary-batch lists a size twice: {','.join(map(str, self.vary_batch))}")
        if command == "check" and self.tier == 3 and len(self.batch_sizes) < 2:  # no second batch size: nothing to hold invariant
            given = f" (--vary-batch {','.join(map(str, self.vary_batch))} runs batch size {self.batch_size} alone)" if self.vary_batch else ""
            raise UsageError(f"tier 3 promises batch invariance, which a check comparing no second batch size never tests{given}",
                             hint="add --vary-batch with a second size, e.g. 1,2,8")
        if command == "check" and self.runs < 2:
            raise UsageError(f"check needs --runs of at least 2 to compare runs, got {self.runs}")
        if self.negative_control and command == "run":
            raise UsageError("--negative-control belongs to check: a run compares nothing")
        if self.fresh_process < 0:
            raise UsageError(f"--fresh-process must be >= 0, got {self.fresh_process}")
        if self.fresh_process and command == "run":
            raise UsageError("--fresh-process applies to check, which repeats runs; run generates each batch size once")
        if self.fresh_process > self.runs - 1:
            raise UsageError(f"--fresh-process {self.fresh_process} needs --runs of at least {self.fresh_process + 1}: run 0, the "
                             f"reference, runs in the check's own process", hint=f"use --runs {self.fresh_process + 1}")
        if not 0.0 < self.confidence < 1.0:
            raise UsageError(f"--confidence must lie between 0 and 1, got {self.confidence}")
        if self.max_rate is not None and not 0.0 < self.max_rate < 1.0:
            raise UsageError(f"--max-rate must lie between 0 and 1, got {self.max_rate}")
        if (self.max_rate is not None or self.fill_prompts or self.require_engagement) and command == "run":
            raise UsageError("--max-rate, --fill-prompts and --require-engagement belong to check: a run compares nothing")
        if self.fill_prompts and self.max_rate is None:
            raise UsageError("--fill-prompts adds fillers up to what --max-rate needs: give --max-rate too")
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
    """`--vary-batch 1,2,8` -> (1, 2, 8); an empty item ("1,,2", ","), a non-integer or a size
    given twice is a UsageError. None (flag absent) is (); an empty string is refused."""
    if text is None:
        return ()
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        raise UsageError(f"--vary-batch expects comma-separated integers like 1,2,8, got {text!r} (an empty item)")
    try:
        sizes = tuple(int(x) for x in items)
    except ValueError as exc:
        raise UsageError(f"--vary-batch expects comma-separated integers like 1,2,8, got {text!r}") from exc
    if len(set(sizes)) != len(sizes):
        raise UsageError(f"--vary-batch lists a size twice: {text!r}")
    return sizes


def parse_axes(specs: list[str], *, int_axes: Collection[str] = (), command: str = "sweep",
               example: str = "batch_size=1,2,8") -> list[tuple[str, list[str]]]:
    """`--axis name=v1,v2` strings to [(name, values)], the one axis parser of the tool (sweep,
    train-check); a malformed or repeated axis or value, or a non-integer value of an axis in
    `int_axes`, is a UsageError."""
    axes: list[tuple[str, list[str]]] = []
    for spec in specs:
        name, sep, values = spec.partition("=")
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not name.strip() or not vals:
            raise UsageError(f"--axis expects name=v1,v2 (e.g. {example}), got {spec!r}")
        name = name.strip()
        if name in (a for a, _ in axes):
            raise UsageError(f"--axis {name} is given twice")
        if len(set(vals)) != len(vals):
            raise UsageError(f"--axis {name} repeats a value: {values!r}")
        if name in int_axes:
            try:
                [int(v) for v in vals]
            except ValueError as exc:
                raise UsageError(f"--axis {name} takes integers, got {values!r}") from exc
        axes.append((name, vals))
    if not axes:
        raise UsageError(f"{command} needs at least one --axis", hint=f"e.g. --axis {example}")
    return axes


def check_atol(atol: Any) -> None:
    """diff's --atol: the same range as RunConfig.atol."""
    RunConfig.__dataclass_fields__["atol"].metadata["range"].check("--atol", atol)
