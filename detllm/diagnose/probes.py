"""The probe plan: which knobs exist for the backend at hand, what each probe changes, what it
proves, and what it costs, cheapest first.

Owns the knob table per backend (read from each backend's Options dataclass, so a knob the
backend lacks is skipped and said so) and ordering. Pure: builds configs, runs nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..core.config import RunConfig

LADDER = (1, 2, 4, 8)  # batch sizes of the batch-size ladder, plus the check's own


@dataclass(frozen=True)
class Probe:
    name: str  # unique in a plan, e.g. "threads=1"
    knob: str  # what is varied: "batch composition", "threads", "kv_type", ...
    kind: str  # check | ladder | needle | fresh_process | prefill
    proves: str  # one line: what the result tells the user
    cost: float  # relative cost (1 = one small check in the shared worker); the plan sorts on it
    threads: int | None = None  # RunConfig.threads for the probe (None: keep)
    dtype: str | None = None  # RunConfig.dtype for the probe (None: keep)
    options: dict[str, str] = field(default_factory=dict)  # --opt changes
    fresh: bool = False  # needs its own process (engine options that cannot change in one process)
    # a diff's recorded difference: RunConfig fields set to the right side's value as they are, None
    # (the engine's default) included, and environment variables (None: unset) for a fresh process
    config: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str | None] = field(default_factory=dict)
    unset: tuple[str, ...] = ()  # --opt names removed, so the backend's default applies (an undo whose default is None)
    undoes: dict[str, str] = field(default_factory=dict)  # an undo: the user's own --opt values this probe takes back

    def setting(self) -> dict[str, Any]:
        s: dict[str, Any] = dict(self.options)
        s.update({k: None for k in self.unset})
        s.update(self.config)
        s.update({f"env.{k}": v for k, v in self.env.items()})
        if self.threads is not None:
            s["threads"] = self.threads
        if self.dtype is not None:
            s["dtype"] = self.dtype
        return s

    def apply(self, config: RunConfig) -> RunConfig:
        opts = {k: v for k, v in config.options if k not in self.unset}
        opts.update(self.options)
        return dataclasses.replace(
            config, mode="best-effort", threads=self.threads if self.threads is not None else config.threads,
            dtype=self.dtype or config.dtype, options=tuple(sorted(opts.items())))


def option_fields(backend: str) -> set[str]:
    """The --opt names a backend accepts, read from its Options dataclass (imports the backend
    module, which imports no engine)."""
    from ..backends.registry import BACKENDS, backend_class

    if backend not in BACKENDS:
        return set()
    options = backend_class(backend).Options
    return {f.name for f in dataclasses.fields(options)} if options is not None else set()


def _knob(probes, skipped, fields, config, key, value, *, proves, cost=1.0, fresh=False, why_missing=None):
    """A --opt probe when the backend has the option and it is not already at `value`."""
    current = config.option_dict().get(key)
    if key not in fields:
        skipped.append({"knob": key, "reason": why_missing or f"backend {config.backend!r} has no option {key!r}"})
    elif current is not None and str(current).lower() == str(value).lower():
        skipped.append({"knob": key, "reason": f"already {key}={current} in the failing run"})
    else:
        probes.append(Probe(f"{key}={value}", key, "check", proves, cost, options={key: str(value)}, fresh=fresh))


# --opt settings never taken back by an undo probe: what the check asks of whom, not how the engine
# computes (with compare/causes' INERT_OPTIONS: ports, timeouts, paths, key names)
NOT_UNDONE = {
    "base_url": "which server answers",
    "cache_probe": "the check's own design (each prompt cold, then warm)",
    "trust_remote_code": "what loads the model",
    "server": "names the server's kind",
    "chat": "what is asked (chat messages or a prompt)",
}


def undo_probes(config: RunConfig) -> list[Probe]:
    """One probe per --opt the user set away from the backend's default, taking it back to the
    default (the option removed where the default is None: the engine's own). Not for the fake
    backend, whose options are its script (what it computes), nor for NOT_UNDONE/INERT_OPTIONS."""
    from ..backends.base import options_json, parse_options
    from ..backends.registry import BACKENDS, backend_class
    from ..compare.causes import INERT_OPTIONS

    if config.backend == "fake" or config.backend not in BACKENDS or backend_class(config.backend).Options is None:
        return []
    options = backend_class(config.backend).Options
    defaults = options_json(options())
    probes = []
    for key, raw in config.options:
        if key in NOT_UNDONE or key in INERT_OPTIONS or key not in defaults:
            continue
        value = options_json(parse_options(options, ((key, raw),), config.backend))[key]
        default = defaults[key]
        if value == default:
            continue
        shown = "default" if default is None else str(default).lower()
        probes.append(Probe(f"{key}={shown}", key, "check", f"whether taking back your own --opt {key}={raw} (the backend's "
                            f"default: {'unset' if default is None else shown}) makes it stop", 0.5,
                            options={} if default is None else {key: shown}, unset=(key,) if default is None else (),
                            undoes={key: raw}))
    return probes


def plan(config: RunConfig, kinds: list[str], *, tier: int, fresh_repeats: int = 3) -> tuple[list[Probe], list[dict[str, str]]]:
    """(probes, skipped knobs with the reason) for a divergence of `kinds` ("run", "batch") seen at
    `tier`: first every undo of the user's own settings (undo_probes), then the rest cheapest first."""
    undo = undo_probes(config)
    probes, skipped = _new_settings(config, kinds, tier=tier, fresh_repeats=fresh_repeats)
    names = {p.name for p in undo}
    return undo + [p for p in probes if p.name not in names], skipped


def _new_settings(config: RunConfig, kinds: list[str], *, tier: int, fresh_repeats: int) -> tuple[list[Probe], list[dict[str, str]]]:
    probes: list[Probe] = []
    skipped: list[dict[str, str]] = []
    fields = option_fields(config.backend)
    b = config.backend
    if "batch" in kinds:
        probes.append(Probe("batch-size ladder", "batch composition", "ladder",
                            "which batch sizes change a prompt's output against batch 1", 1.0))
        probes.append(Probe("needle in a batch", "batch composition", "needle",
                            "whether a prompt's output changes with its position and company in a batch", 1.1))
    probes.append(Probe(f"fresh-process repeats x{fresh_repeats}", "process", "fresh_process",
                        "whether a new process (thread pools, kernel choices, caches) gives other outputs", 0.9 * fresh_repeats,
                        fresh=True))
    if b == "openai":
        skipped.append({"knob": "threads", "reason": "a served endpoint's threads are the server's own setting"})
    elif config.threads != 1:
        probes.append(Probe("threads=1", "threads", "check", "whether the divergence needs parallel reductions", 1.0, threads=1))
    else:
        skipped.append({"knob": "threads", "reason": "the failing run already used one thread"})
    if b in ("llamacpp", "openai"):
        skipped.append({"knob": "dtype", "reason": "llama.cpp computes in the types the GGUF file fixes" if b == "llamacpp"
                        else "a served endpoint's dtype is the server's own setting"})
    elif config.dtype in ("float32", "auto"):
        skipped.append({"knob": "dtype", "reason": f"the failing run already asked for {config.dtype}"})
    else:
        probes.append(Probe("dtype=float32", "dtype", "check", "whether the divergence is low-precision rounding", 1.3, dtype="float32"))
    if b == "hf":
        attn = config.option_dict().get("attn_implementation", "eager")
        _knob(probes, skipped, fields, config, "attn_implementation", "sdpa" if attn == "eager" else "eager",
              proves="whether the attention kernel decides it", cost=1.2)
        skipped.append({"knob": "torch.use_deterministic_algorithms",
                        "reason": "the hf backend turns it on in every run at tier >= 1; not a free knob" if tier >= 1
                        else "tier 0 asks for nothing"})
        skipped.append({"knob": "TF32 / cuDNN", "reason": "CUDA settings; the hf backend turns TF32 off and cuDNN deterministic on"
                        if config.device == "cuda" else "CUDA settings, and this run is on the CPU"})
        _knob(probes, skipped, fields, config, "batch_invariant", "true", cost=1.5,
              proves="whether hf's batch-invariant mode removes the batch dependence",
              why_missing="this hf backend has no batch-invariant mode yet")
    elif b == "llamacpp":
        _knob(probes, skipped, fields, config, "kv_type", "f32", proves="whether the f16 KV cache rounding decides it")
        _knob(probes, skipped, fields, config, "flash_attn", "off", proves="whether the flash-attention kernel decides it")
        _knob(probes, skipped, fields, config, "ubatch", "1", proves="whether the physical batch (-ub) split decides it")
        if config.option_dict().get("cache_prompt", "false").lower() in ("1", "true", "yes", "on"):
            _knob(probes, skipped, fields, config, "cache_prompt", "false", proves="whether KV reuse across requests decides it")
        else:
            skipped.append({"knob": "cache_prompt", "reason": "already off in the failing run (detllm's default)"})
        skipped.append({"knob": "slots", "reason": "already one slot per batch member, prompt i on slot i (detllm's default)"}
                       if "slots" not in config.option_dict() else {"knob": "slots", "reason": "set by the user; the ladder varies it"})
    elif b == "vllm":
        _vllm_knobs(probes, skipped, fields, config)
    elif b == "openai":
        skipped.append({"knob": "concurrency", "reason": "a batch is that many concurrent requests: the batch-size ladder's "
                                                         "batch 1 is concurrency 1"})
        # the server's cache: diagnose/served.py adds its knob, which needs the live server's kind
    elif b not in ("fake",):
        # another engine: probe whatever of these it has
        _knob(probes, skipped, fields, config, "concurrency", "1", proves="whether concurrent requests (server-side batching) decide it")
        _knob(probes, skipped, fields, config, "cache_prompt", "false", proves="whether a warm server cache decides it")
    probes.sort(key=lambda p: p.cost)  # stable: equal costs keep the order above
    return probes, skipped


def _vllm_knobs(probes, skipped, fields, config) -> None:
    from ..backends.registry import backend_class

    vllm = backend_class("vllm")  # asked of the class: nothing is built, no engine imported
    opts = config.option_dict()
    if opts.get("enforce_eager") is None and vllm.defaults_here().get("enforce_eager"):
        skipped.append({"knob": "enforce_eager", "reason": "the CPU build already runs eagerly (no graphs, no compile)"})
    else:
        _knob(probes, skipped, fields, config, "enforce_eager", "true", cost=2.0, fresh=True,
              proves="whether CUDA graphs / torch.compile decide it")
    _knob(probes, skipped, fields, config, "prefix_caching", "false", cost=2.0, fresh=True,
          proves="whether reusing cached prefixes decides it")
    skipped.append({"knob": "chunked_prefill", "reason": "the vllm backend has no option for it; vLLM's setting is recorded in "
                                                         "determinism_applied.json"})
    _knob(probes, skipped, fields, config, "max_num_seqs", "1", cost=2.0, fresh=True,
          proves="whether scheduling sequences together decides it (one sequence at a time)")
    ok, why = vllm.batch_invariance_here()
    if ok:
        _knob(probes, skipped, fields, config, "batch_invariant", "true", cost=2.0, fresh=True,
              proves="whether vLLM's batch-invariant kernels remove the batch dependence")
    else:
        skipped.append({"knob": "batch_invariant", "reason": why})


__all__ = ["LADDER", "NOT_UNDONE", "Probe", "option_fields", "plan", "undo_probes"]
