"""Run prompts through a backend and write the run folder.

Owns the order of events that makes "nothing written on bad input" true: validate
the config, read the prompts, check --out, create the backend, gate the tier,
tokenize — and only then create the folder, generate batch after batch, write the
trace, compare and report. Batches are real: at batch size b the prompts are
generated b at a time, the last batch topped up with built-in fillers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..runfolder import artifacts
from . import fresh
from ..backends.base import Backend, options_json
from .batching import add_evidence, batch_requests, plan_batches, trace_record
from ..backends.registry import create_backend
from .tiergate import gate_tier
from ..core.config import RunConfig
from .control import negative_control
from ..runfolder.env import Redaction, collect_env, detllm_version
from ..core.errors import DetllmError, UsageError
from ..runfolder.folderlock import exclusive_writer
from ..core.prompts import FILLERS, PromptSet, load_prompts
from .outcome import Outcome, write_report  # re-exported: the Python API's names

if TYPE_CHECKING:
    from ..runfolder.signing import Signer

Progress = Callable[[int, int, int], None]  # (prompts done, prompts total, tokens generated so far)
MakeReport = Callable[[list, int, float | None, dict], dict]  # (records, effective tier, noise floor, summary) -> report.json


def check_fits(input_ids: Sequence[Sequence[int]], max_new_tokens: int, limit: int | None) -> None:
    """Refuse (UsageError) a prompt that cannot hold --max-new-tokens more within the context."""
    if limit is None:
        return
    for i, ids in enumerate(input_ids):
        if len(ids) + max_new_tokens > limit:
            raise UsageError(f"prompt {i} has {len(ids)} tokens; with --max-new-tokens {max_new_tokens} it exceeds "
                             f"the model's context of {limit} tokens", hint="shorten the prompt or lower --max-new-tokens")


def execute(config: RunConfig, *, command: str, out: Path | None = None, **kwargs: Any) -> Outcome:
    """Run `config` into `out` (default: a new folder under artifacts/) holding the folder's
    exclusive lock (folderlock.py) from before anything in it is cleared until it is sealed:
    a second run into the same --out at the same time is refused. See _execute."""
    out = Path(out) if out is not None else artifacts.default_out_dir(command)
    with exclusive_writer(out):
        try:
            return _execute(config, command=command, out=out, **kwargs)
        except (DetllmError, OSError) as exc:
            if not (out / artifacts.PARTIAL).exists():
                raise  # refused before the first write: nothing to say about the folder
            left = f"{str(out)!r} is left incomplete ({artifacts.PARTIAL}); re-run into it or remove it"
            if isinstance(exc, OSError):  # disk full, permissions: one line, like any path error (exit 2)
                raise UsageError(f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""), hint=left) from exc
            exc.hint = f"{exc.hint}; {left}" if exc.hint else left
            raise


def _execute(
    config: RunConfig,
    *,
    command: str,
    prompts_path: str | Path | None = None,
    out: Path | None = None,
    force: bool = False,
    backend: Backend | None = None,
    progress: Progress | None = None,
    prompt_set: PromptSet | None = None,
    sign_key: str | Path | None = None,
    make_report: MakeReport | None = None,
    redaction: Redaction | None = None,
) -> Outcome:
    """Run `config` (command "run", "check" or "replay"), write the run folder, return the outcome.
    `prompt_set` replaces the prompt file (replay: the pack's prompts); `make_report` replaces the
    check verdict (replay: the diff against the pack); `sign_key` signs the manifest."""
    config.validate(command=command)
    signer = None
    if sign_key is not None:  # a bad key is refused before anything runs
        from ..runfolder.signing import load_signing_key

        signer = load_signing_key(sign_key)
    prompts = prompt_set or load_prompts(prompts_path)
    out = Path(out) if out is not None else artifacts.default_out_dir(command)
    artifacts.check_out_dir(out, force=force)
    owned = backend is None
    backend = backend or create_backend(config)
    try:
        caps = backend.capabilities()
        tier, why = gate_tier(config, caps)
        input_ids = [tuple(backend.tokenize(t)) for t in prompts.texts]
        filler_ids = [tuple(backend.tokenize(t)) for t in FILLERS]
        check_fits(input_ids, config.decoding.max_new_tokens, backend.context_limit())
        identity = backend.model_identity()
        artifacts.prepare_out_dir(out, force=force)
        artifacts.write_json(out, artifacts.RUN_CONFIG, artifacts.stamp("run_config", {
            "detllm_version": detllm_version(),
            "command": command,
            "created_at": artifacts.utc_now(),
            "config": config.to_json(),
            "backend_options": options_json(getattr(backend, "options", None)),
            "model": identity.to_json(),
            "prompts": {"source": prompts.source, "count": len(prompts.texts), "sha256": prompts.sha256},
        }))
        with backend.determinism(tier=tier, seed=config.seed, threads=config.threads) as applied:
            settings = [a.to_json() for a in applied]
            artifacts.write_json(out, artifacts.ENV, collect_env(backend.env_info(), torch=backend.uses_torch,
                                                                       redaction=redaction))
            artifacts.write_json(out, artifacts.APPLIED, artifacts.stamp("determinism_applied", {
                "backend": config.backend,
                "tier_requested": config.tier,
                "tier_effective": tier,
                "mode": config.mode,
                "downgraded": tier != config.tier,
                "downgrade_reason": why,
                "capabilities": {"max_tier": caps.max_tier, "logprobs": caps.logprobs, "sampling": caps.sampling,
                                 "batch_invariant": caps.batch_invariant, "notes": list(caps.notes)},
                "settings": settings,
            }))
            with fresh.Dispatcher(config, backend, tier=tier, identity=identity.to_json(), settings=settings) as gen:
                records, digests = _generate(config, gen, prompts, input_ids, filler_ids, out, caps.logprobs, progress)
            control = None
            if config.negative_control and command == "check":  # in-process, after the check's own runs
                control = negative_control(config, backend, caps, prompts, input_ids, filler_ids, records)
    finally:
        if owned:
            backend.close()
    # what only the finished runs need is imported now, once the engine's peak is behind: the comparisons,
    # causes and report rendering add nothing to the memory a check's generation holds
    from ..compare.divergence import run_noise_floor

    floor = run_noise_floor(config.dtype, settings, identity.quantization)
    return _finish(config, command, out, records, digests, tier, floor, signer, make_report, control)


def _generate(config, backend, prompts, input_ids, filler_ids, out, want_logprobs, progress) -> tuple[list[dict[str, Any]], list[bytes]]:
    """Generate every (batch size, run) and stream the trace; returns the records and their chain digests."""
    schedule = [(b, r) for b in config.batch_sizes for r in range(config.runs if b == config.batch_size else 1)]
    schedule.sort(key=lambda br: backend.is_fresh(*br))  # fresh-process repeats last (fresh.py)
    total = len(schedule) * len(prompts.texts)
    done = tokens = 0
    writer = artifacts.TraceWriter(out)
    records = []
    try:
        for batch_size, run in schedule:
            for batch in plan_batches(len(prompts.texts), batch_size):
                reqs = batch_requests(prompts, batch, input_ids, filler_ids)
                gens = backend.generate(reqs, batch_size=batch_size, run=run, seed=config.seed, n_logprobs=config.logprobs, logprobs=want_logprobs)
                for pos, (req, gen) in enumerate(zip(reqs, gens)):
                    if req.is_filler:
                        continue
                    rec = trace_record(config, prompts, req.prompt_index, req.input_ids, gen, run, batch_size, pos)
                    if backend.is_fresh(batch_size, run):
                        rec["fresh_process"] = True
                    elif config.fresh_process:  # the reference's process, against which a fresh repeat's pid is judged
                        add_evidence(rec, {"pid": os.getpid()})
                    writer.write(rec)
                    records.append(rec)
                    done += 1
                    tokens += len(gen.token_ids)
                if progress:
                    progress(done, total, tokens)
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    return records, writer.digests


def _finish(config: RunConfig, command: str, out: Path, records: list[dict[str, Any]], digests: list[bytes], tier: int,
            floor: float | None, signer: Signer | None = None, make_report: MakeReport | None = None,
            control: dict[str, Any] | None = None) -> Outcome:
    summary = {
        "backend": config.backend,
        "model": config.model,
        "prompts": len({r["prompt_index"] for r in records}),
        "runs": config.runs,
        "batch_sizes": list(config.batch_sizes),
        "generated_tokens": sum(len(r["token_ids"]) for r in records),
        "records": len(records),
        "atol": config.atol,
    }
    if make_report is not None:
        report = make_report(records, tier, floor, summary)
    elif command == "run":
        report = artifacts.stamp("report", {
            "command": "run", "status": "RECORDED", "category": "RECORDED",
            "tier": {"requested": config.tier, "effective": tier},
            "causes": [], "first_divergence": None, "comparisons": [], "summary": summary,
        })
    else:
        # the one verdict function verify re-derives with (checkverdict.py): plain check or cache probe
        from .checkverdict import check_verdict

        report = check_verdict(config, compared_records(out, records), tier=tier, floor=floor, summary=summary,
                               control=control)
    write_report(out, report, signer=signer, record_digests=digests)
    return Outcome(out, report)


COMPARE_FROM_DISK_BYTES = 1 << 24  # a trace this large is compared as the diff compares it: from the file


def compared_records(out: Path, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the check compares: the records in memory, or, for a large trace, the same records read
    back from the trace just written, whose payloads that differ compare/arrays.py reads as arrays on
    two cores (1,000 x 1,000 drifted steps: ~35 s of CPU as Python lists, ~2 s this way). The values
    are the same: the file is what the writer made of them (a NaN written as null, which the
    comparison treats alike), and verify re-derives the verdict from that file too."""
    path = out / artifacts.TRACE
    try:
        if path.stat().st_size < COMPARE_FROM_DISK_BYTES:
            return records
    except OSError:
        return records
    from ..compare.trace import load_records

    return load_records(path)[0]


__all__ = ["Outcome", "execute", "gate_tier", "plan_batches", "write_report", "load_prompts"]
