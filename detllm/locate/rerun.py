"""Re-running one side's recorded batch exactly as it was recorded, through the backend the
registry makes from the side's recorded config, with its capture capability: the batch's members,
order and padding rebuilt from the trace (batching.plan_batches, the runner's plan), the model
files checked against the recorded ones first (replay's rule: exit 7), the recorded determinism
settings applied, and the re-run's outputs checked against the recorded trace up to the step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..backends.base import Backend, Capture, CaptureSpec, Request
from ..backends.registry import backend_class, create_backend
from ..pipeline.batching import batch_requests, plan_batches
from ..compare.causes import Side
from ..core.clock import add
from ..core.config import RunConfig
from ..core.errors import BackendUnavailableError, UsageError
from ..core.prompts import FILLERS, PromptSet
from ..commands.replay import check_model, local_identity, pack_options
from .sides import differs_up_to
from .warm import caches_across_batches, earlier


@dataclass
class Rerun:
    """One side ready to re-run: its config, its backend (made once) and the recorded batch."""

    side: Side
    config: RunConfig
    requests: list[Request]
    row: int  # the prompt's row in the batch
    recorded: dict[int, dict[str, Any]]  # batch row -> the trace record it must reproduce (fillers absent)
    backend: Backend | None = None
    runs: int = 0  # re-runs made so far (at most 2)
    peak_bytes: int = 0  # the most bytes one capture held
    offers: str = "none"  # the backend's Capabilities.capture: the most it can capture
    notes: list[str] = field(default_factory=list)
    fixed_step: int | None = None  # capture at this step whatever step is asked (prefill vs decode: the prefill, 0)
    shares_backend: bool = False  # another Rerun made (and closes) the backend
    warm: list[list[Request]] = field(default_factory=list)  # batches replayed first to warm a cache the batch found warm
    warmed_by: list[dict[str, Any]] = field(default_factory=list)  # what they were (locate.json)
    in_pass_kv: bool = False  # a prefill side: its attentions keep the K/V they wrote (compared with the decode's cached ones)
    own_check: Any = None  # (Capture) -> what differs or None: the check of a side with no recorded trace (a prefill)
    clocks: list = field(default_factory=list)  # per capture re-run: its Capture.seconds ([wall, cpu] s; see cost())
    bare: dict = field(default_factory=dict)  # step -> [wall, cpu] s of the re-run to it without capture, measured once


def check_capture(config: RunConfig, label: str, rows: int = 1) -> None:
    """BackendUnavailableError (exit 4) for a backend without internals to capture (served
    endpoints), or one whose recorded config its capture refuses for a batch of `rows` (vLLM at
    tensor_parallel_size > 1, a llama.cpp GPU run), before anything is loaded or written."""
    cls = backend_class(config.backend)
    if cls.capture is Backend.capture:
        raise BackendUnavailableError(f"{label}: backend {config.backend!r} has no internals locate can capture",
                                      hint="locate re-runs a batch in-process (hf, or the engines that declare capture); "
                                           "a served endpoint only answers requests")
    refused = cls.capture_refusal(config, rows)
    if refused is not None:
        raise BackendUnavailableError(f"{label}: {refused[0]}", hint=refused[1])


def side_config(side: Side) -> RunConfig:
    """The side's recorded config as replay would take it (code-loading options refused)."""
    return pack_options(RunConfig.from_json(side.run_config["config"]))


def prepare(side: Side, prompt_index: int) -> Rerun:
    """The recorded batch of (side, prompt) as Requests: every member with its recorded input ids,
    fillers tokenized by the backend when it is made (start). Nothing is loaded yet."""
    config = side_config(side)
    check_capture(config, side.label, side.batch_size)
    count = side.run_config["prompts"]["count"]
    texts: dict[int, str] = {}
    ids: dict[int, tuple[int, ...]] = {}
    by_index = {r["prompt_index"]: r for r in side.records or ()}
    for r in by_index.values():
        if r.get("prompt_text") is None or r.get("input_ids") is None:
            raise UsageError(f"{side.label} was recorded with --no-prompt-text: its batch cannot be rebuilt to re-run it",
                             hint="re-record it with prompt text")
        texts[r["prompt_index"]], ids[r["prompt_index"]] = r["prompt_text"], tuple(r["input_ids"])
    batch = next((b for b in plan_batches(count, side.batch_size) if prompt_index in b), None)
    if batch is None or any(i >= 0 and i not in texts for i in batch):
        missing = sorted(i for i in (batch or [prompt_index]) if i >= 0 and i not in texts)
        raise UsageError(f"{side.label}: the trace holds no record of prompt(s) {missing[:5]} of the batch to re-run")
    prompts = PromptSet(tuple(texts.get(i, "") for i in range(count)), f"locate of {side.label}")
    rerun = Rerun(side, config, [], batch.index(prompt_index), {})
    for pos, i in enumerate(batch):
        if i >= 0:
            rec = by_index[i]
            if rec["batch_position"] != pos:
                raise UsageError(f"{side.label}: prompt {i} was recorded at batch position {rec['batch_position']}, the "
                                 f"batch plan puts it at {pos}: this trace's batches cannot be rebuilt")
            rerun.recorded[pos] = rec
            if rec.get("fresh_process"):
                rerun.notes = ["recorded in a fresh process (check --fresh-process); re-run in this one"]
    rerun.requests = batch_requests(prompts, batch, [ids.get(i, ()) for i in range(count)], [()] * len(FILLERS))
    if caches_across_batches(config):
        rerun.warm, rerun.warmed_by = earlier(side, config, batch)
    return rerun


def start(rerun: Rerun, seen: dict[tuple, Any] | None = None) -> None:
    """Check the model files against the recorded ones (ModelChangedError, exit 7), make the backend,
    tokenize the fillers. The files are hashed before any engine loads them where they are local (hf,
    vllm), once per model for both sides (`seen`); else the loaded engine's identity is checked, as
    replay does."""
    recorded = rerun.side.run_config["model"]
    key = (rerun.config.backend, rerun.config.model, rerun.config.revision)
    seen = {} if seen is None else seen
    if key not in seen:
        seen[key] = local_identity(rerun.config)
    before = seen[key]
    if before is not None:
        check_model(recorded, before, allow=False)
    backend = create_backend(rerun.config)
    try:
        if before is None:
            check_model(recorded, backend.model_identity().to_json(), allow=False)
        attach(rerun, backend)
    except BaseException:
        backend.close()
        raise


def attach(rerun: Rerun, backend: Backend, *, shared: bool = False) -> None:
    """Give `rerun` a started backend (`shared`: another Rerun closes it) and tokenize its fillers."""
    rerun.offers = backend.capabilities().capture
    if rerun.offers == "none":
        raise BackendUnavailableError(f"{rerun.side.label}: backend {rerun.config.backend!r} as configured captures nothing")
    # tokenized only where the batch has fillers: a vLLM backend starts its engine to tokenize, and with one
    # engine per process starting both sides' engines here would cost the first side's a restart
    needed = any(r.is_filler for batch in (rerun.requests, *rerun.warm) for r in batch)
    fillers = [tuple(backend.tokenize(t)) for t in FILLERS] if needed else []
    rerun.backend, rerun.shares_backend = backend, shared
    def filled(reqs: list[Request]) -> list[Request]:
        return [dataclasses.replace(r, input_ids=fillers[(-r.prompt_index - 1) % len(fillers)]) if r.is_filler else r for r in reqs]

    rerun.requests = filled(rerun.requests)
    rerun.warm = [filled(b) for b in rerun.warm]


def capture(rerun: Rerun, step: int, *, level: str, max_bytes: int, tier: int, reference: bool = True,
            ops_through: str | None = None, guide: bool = False) -> tuple[Capture, str | None]:
    """Re-run the batch up to `step` capturing row `rerun.row`; returns the capture and what it
    changed from the recorded trace (None: every member reproduced bitwise up to `step`).
    `ops_through`: at level ops, ops until that module completes (CaptureSpec.ops_through);
    `guide`: CaptureSpec.guide."""
    if rerun.backend is None:
        start(rerun)
    assert rerun.backend is not None
    if rerun.runs >= 2:
        raise UsageError(f"{rerun.side.label}: locate re-runs a side at most twice")
    cfg, applied = rerun.config, rerun.side.applied
    step = step if rerun.fixed_step is None else rerun.fixed_step
    spec = CaptureSpec(step=step, row=rerun.row, level=level, max_bytes=max_bytes, reference=reference,
                       warm_up=tuple(tuple(b) for b in rerun.warm), in_pass_kv=rerun.in_pass_kv, time_bare=step not in rerun.bare,
                       ops_through=ops_through, guide=guide)
    with rerun.backend.determinism(tier=applied["tier_effective"], seed=cfg.seed, threads=cfg.threads):
        cap = rerun.backend.capture(rerun.requests, cfg.decoding, seed=cfg.seed, n_logprobs=cfg.logprobs, spec=spec)
    rerun.runs += 1
    if "bare" in cap.seconds:
        rerun.bare.setdefault(step, cap.seconds["bare"])
    rerun.clocks.append((step, cap.seconds))
    rerun.peak_bytes = max(rerun.peak_bytes, captured_bytes(cap))
    for pos, rec in sorted(rerun.recorded.items()):
        if pos >= len(cap.generations):
            return cap, f"the re-run returned {len(cap.generations)} generations for a batch of {len(rerun.requests)}"
        what = differs_up_to(rec, cap.generations[pos], step, tier=tier)
        if what is not None:
            return cap, f"prompt {rec['prompt_index']} (batch row {pos}), {what}"
    if rerun.own_check is not None:
        return cap, rerun.own_check(cap)
    if (cap.engine or {}).get("not_reproduced"):  # the engine re-ran the batch, its capture did not (llama.cpp's dumper)
        return cap, cap.engine["not_reproduced"]
    return cap, None


def seconds(rerun: Rerun) -> dict[str, list[float]] | None:
    """This side's capture re-runs as [wall, cpu] s: "with_capture" (the float64 evaluated on demand
    included), "without_capture" (each re-run's measured bare time: the same batch to the same step,
    measured once per step); None where the backend measures no bare time."""
    if not rerun.clocks or any(step not in rerun.bare or "captured" not in c for step, c in rerun.clocks):
        return None
    with_, without = [0.0, 0.0], [0.0, 0.0]
    for step, c in rerun.clocks:
        with_, without = add(with_, add(c["captured"], c.get("reference"))), add(without, rerun.bare[step])
    return {"without_capture": [round(v, 3) for v in without], "with_capture": [round(v, 3) for v in with_]}


def timing(sides: list[Rerun]) -> dict[str, Any] | None:
    """locate.json cost.rerun_seconds: each side's capture re-runs with and without capture, and the
    overhead over both sides (with / without - 1, wall and cpu); None where a side has no bare time."""
    per = [seconds(r) for r in sides]
    if len(per) != 2 or None in per:
        return None
    tot = {k: add(per[0][k], per[1][k]) for k in ("without_capture", "with_capture")}
    over = {unit: round(tot["with_capture"][i] / tot["without_capture"][i] - 1, 3) if tot["without_capture"][i] > 0 else None
            for i, unit in enumerate(("wall", "cpu"))}
    return {"left": per[0], "right": per[1], "overhead": over, "units": "[wall, cpu] seconds; cpu: user + sys, all threads"}


def captured_bytes(cap: Capture) -> int:
    return sum(int(getattr(t.output, "nbytes", 0)) + sum(int(getattr(i, "nbytes", 0)) for i in t.inputs) for t in cap.tensors)


def close(rerun: Rerun) -> None:
    if rerun.backend is not None and not rerun.shares_backend:
        rerun.backend.close()
