"""`detllm train-check` (and `detllm.train_check`): K training steps run at least twice — the
reference (run 0), repeats in this process, repeats in fresh processes — compared bit for bit at
every step, written as a sealed training pack (train_config.json, env.json, steps.jsonl,
repeats/, checkpoints.json, train_report.json, report.txt, manifest.json) with the checkpoints
beside it. Owns the order of the runs and the verdict's report; the step is steps.py, the run
loop.py, the comparison verdict.py, the formats docs/training.md.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..runfolder import artifacts, schema_io
from ..runfolder.env import collect_env, detllm_version
from ..core.errors import EXIT_FAIL, EXIT_PASS, DetllmError, UsageError
from ..runfolder.folderlock import exclusive_writer
from ..runfolder.integrity import seal
from . import cadence
from .chain import STEPS, TRAIN_CONFIG
from .child import run_fresh
from .digest import CHAIN, CHAIN_1, MAX_SAFE_INT, jcs
from .loop import RunRequest, RunResult, run_steps
from .task import check_task_args, optimizer_section, task_section
from .verdict import describe, earlier, first_divergence, summary

TRAIN_REPORT = "train_report.json"
CHECKPOINTS = "checkpoints.json"
REPORT_TXT = "report.txt"
OWNED = (TRAIN_CONFIG, "script.py.txt", artifacts.ENV, STEPS, "repeats", CHECKPOINTS, TRAIN_REPORT, REPORT_TXT, artifacts.MANIFEST, "manifest.sig")


@dataclass
class TrainOutcome:
    report: dict[str, Any]
    out_dir: Path
    checkpoints_dir: Path
    exit_code: int

    def text(self) -> str:
        return render_text(self.report, self.out_dir, self.checkpoints_dir)


def parse_test_options(items: list[str] | None) -> dict[str, Any]:
    """--test-option repeat_seed=SEED | grad_add=STEP:PARAMETER:VALUE (both change run 1 only)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, val = item.partition("=")
        try:
            if key == "repeat_seed" and sep:
                out[key] = {"run": 1, "seed": int(val)}
            elif key == "grad_add" and sep:
                step, param, value = val.split(":")
                out[key] = {"run": 1, "step": int(step), "parameter": param, "value": float(value)}
            else:
                raise ValueError
        except ValueError:
            raise UsageError(f"--test-option {item!r} is not repeat_seed=SEED or grad_add=STEP:PARAMETER:VALUE") from None
    return out


def make_config(*, model_id: str, identity: dict[str, Any], steps: int, seed: int, threads: int | None, batch_size: int,
                seq_len: int, grad_accumulation: int, dtype: str, checkpoint_every: int | None,
                test_options: dict[str, Any], task: dict[str, Any] | None = None,
                optimizer: dict[str, Any] | None = None, chain: str | None = None) -> dict[str, Any]:
    """train_config.json's document (refused when RFC 8785 cannot carry it exactly); `task` and
    `optimizer` are a --script's sections (script.py), else the built-in task's. `chain` is named
    unless it is detllm-train/1 (whose configs name none, as before it was recorded); None: the
    version this detllm writes (digest.CHAIN)."""
    chain = chain or CHAIN
    doc = schema_io.stamp("train_config", {
        "model": {"id": model_id, **{k: identity.get(k) for k in ("weights_sha256", "tokenizer_sha256", "config_sha256")}},
        "task": task or task_section(batch_size=batch_size, seq_len=seq_len), "optimizer": optimizer or optimizer_section(),
        "seed": seed, "steps": steps, "grad_accumulation": grad_accumulation, "dtype": dtype, "threads": threads,
        "checkpoint_every": checkpoint_every, "test_options": test_options, **({} if chain == CHAIN_1 else {"chain": chain}),
    })
    try:
        jcs(doc)
    except ValueError as exc:
        raise UsageError(f"the training configuration cannot be hashed exactly: {exc}") from exc
    return doc


def _check_args(steps: int, seed: int, threads: int | None, repeats: int, fresh_process: int, checkpoint_every: int | None,
                opts: dict[str, Any], one_run: bool = False) -> None:
    if not 1 <= steps <= 1_000_000:
        raise UsageError(f"--steps {steps}: must be between 1 and 1000000")
    if not 0 <= seed <= MAX_SAFE_INT:
        raise UsageError(f"--seed {seed}: must be between 0 and 2^53-1 (it is hashed as an exact JSON integer)")
    if threads is not None and threads < 1:
        raise UsageError(f"--threads {threads}: must be at least 1")
    if repeats < 0 or fresh_process < 0 or (repeats + fresh_process < 1 and not one_run):
        raise UsageError("train-check needs at least one repeat to compare with run 0",
                         hint="--repeats 1 or --fresh-process 1; `detllm train-run` records one run alone")
    if checkpoint_every is not None and checkpoint_every < 1:
        raise UsageError(f"--checkpoint-every {checkpoint_every}: must be at least 1")
    grad = opts.get("grad_add")
    if grad is not None and (not 0 <= grad["step"] < steps or not math.isfinite(grad["value"]) or grad["value"] == 0):
        raise UsageError(f"--test-option grad_add: step {grad['step']} must be below --steps {steps} and the value finite and not 0")
    if "repeat_seed" in opts and not 0 <= opts["repeat_seed"]["seed"] <= MAX_SAFE_INT:
        raise UsageError("--test-option repeat_seed: the seed must be between 0 and 2^53-1")


def _parameters(model_path: Path, dtype: str) -> list[tuple[str, int]]:
    """The model's parameter names and their bytes in `dtype`, from its config on the meta device
    (no weights loaded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_path)))
    width = getattr(torch, dtype).itemsize
    return [(n, p.numel() * width) for n, p in model.named_parameters()]


def _check_out(out: Path, ckdir: Path, force: bool) -> None:
    """Refuse, before anything is written, an --out that is a file or a folder detllm did not write
    as a training pack (unless --force and no name clashes), and a checkpoint folder that holds
    anything but checkpoints."""
    for path, flag in ((out, "--out"), (ckdir, "--checkpoints")):
        if path.exists() and not path.is_dir():
            raise UsageError(f"{flag} {str(path)!r} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / TRAIN_CONFIG).is_file():
        if {p.name for p in out.iterdir()} - {artifacts.PARTIAL}:
            clash = [n for n in OWNED if (out / n).exists()]
            if not force or clash:
                raise UsageError(f"--out {str(out)!r} is not empty and is not a training pack", hint="choose another --out")
    if ckdir.is_dir():
        other = [p.name for p in ckdir.iterdir() if not p.name.startswith("boundary_")]
        if other:
            raise UsageError(f"--checkpoints {str(ckdir)!r} holds {other[0]!r}, not a detllm checkpoint", hint="choose another folder")


def _prepare(out: Path, ckdir: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    artifacts.mark_incomplete(out)
    for name in OWNED:
        p = out / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
    if ckdir.is_dir():
        shutil.rmtree(ckdir)
    ckdir.mkdir(parents=True)


def train_check(*, model: str = "tiny", steps: int = 8, seed: int = 0, out: str | Path | None = None, threads: int | None = None,
                repeats: int = 1, fresh_process: int = 1, batch_size: int = 4, seq_len: int = 32, grad_accumulation: int = 1,
                dtype: str = "float32", checkpoint_every: int | None | str = "auto", checkpoints: str | Path | None = None,
                test_options: dict[str, Any] | None = None, force: bool = False, sign_key: str | Path | None = None,
                script: str | None = None, say: Callable[[str], None] | None = None, command: str = "train-check") -> TrainOutcome:
    """Run the built-in training task `1 + repeats + fresh_process` times and compare every step bit
    for bit; write the training pack to `out` and its checkpoints beside it. Exit code 0 PASS, 1 FAIL.
    `checkpoint_every`: a cadence, None (before the first step and after the last only) or "auto"
    (cadence.py: the smallest that keeps the checkpoints under max(2 checkpoints, 2 GB)); `say`
    hears the checkpoints' number and size before training starts. `command` "train-run": run 0
    alone, nothing compared (trainrun.py)."""
    from ..core.hashing import folder_identity
    from ..models import resolve_model
    from ..runfolder.signing import load_signing_key

    opts = dict(test_options or {})
    auto = checkpoint_every == "auto"
    _check_args(steps, seed, threads, repeats, fresh_process, None if auto else checkpoint_every, opts, command == "train-run")
    check_task_args(batch_size=batch_size, seq_len=seq_len, grad_accumulation=grad_accumulation, dtype=dtype)
    for key, o in opts.items():
        if o["run"] > repeats + fresh_process:
            raise UsageError(f"--test-option {key} changes run {o['run']}, but only {repeats + fresh_process} repeat(s) run")
    signer = load_signing_key(sign_key) if sign_key is not None else None
    sections: dict[str, Any] = {}
    if script is not None:  # --script (script.py): the script's path stands for the model folder from here on
        from .script import script_setup

        path, sections["task"], sections["optimizer"], params = script_setup(script)
        model, identity = "script", {}
    else:
        resolved = resolve_model(model)
        if resolved.path is None or not resolved.path.is_dir():
            raise UsageError(f"--model {model!r}: train-check needs a built-in model or a local model folder")
        path = resolved.path
    params = params if script else _parameters(path, dtype)
    names = [n for n, _ in params]
    if "grad_add" in opts and opts["grad_add"]["parameter"] not in names:
        raise UsageError(f"--test-option grad_add: the model has no parameter {opts['grad_add']['parameter']!r}",
                         hint=f"e.g. {names[-1]}")
    each = cadence.checkpoint_bytes(sum(b for _, b in params))
    if auto:
        checkpoint_every = cadence.default_every(steps, each)
    if script is None:
        identity = folder_identity(model, path).to_json()
    config = make_config(model_id=model, identity=identity, steps=steps, seed=seed, threads=threads, batch_size=batch_size,
                         seq_len=seq_len, grad_accumulation=grad_accumulation, dtype=dtype, checkpoint_every=checkpoint_every,
                         test_options=opts, **sections)
    out = Path(out) if out is not None else artifacts.default_out_dir("train-check")
    ckdir = Path(checkpoints) if checkpoints is not None else out.parent / (out.name + ".checkpoints")
    _check_out(out, ckdir, force)
    if say is not None:  # every refusal is behind us: the plan is the first line, before any training
        say(cadence.plan_line(steps, checkpoint_every, each, auto))
    with exclusive_writer(out):
        try:
            return _execute(config, path, out, ckdir, repeats, fresh_process, signer, command)
        except (DetllmError, OSError) as exc:
            if not (out / artifacts.PARTIAL).exists():
                raise
            left = f"{str(out)!r} is left incomplete ({artifacts.PARTIAL}); re-run into it or remove it"
            if isinstance(exc, OSError):
                raise UsageError(f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""), hint=left) from exc
            exc.hint = f"{exc.hint}; {left}" if exc.hint else left
            raise


def train_run(**kw: Any) -> TrainOutcome:
    """`detllm train-run`: train_check's run 0 alone (the same arguments, no repeats or test options),
    a pack whose verdict is RECORDED (trainrun.py)."""
    if kw.pop("test_options", None):
        raise UsageError("train-run records one run: --test-option changes a repeat, and there is none")
    return train_check(**kw, repeats=0, fresh_process=0, command="train-run")


def _execute(config: dict[str, Any], model_path: Path, out: Path, ckdir: Path, repeats: int, fresh: int, signer: Any,
             command: str = "train-check") -> TrainOutcome:
    _prepare(out, ckdir)
    schema_io.write_json(out, TRAIN_CONFIG, config)
    if config["task"]["kind"] == "script":
        from .script import copy_script

        copy_script(model_path, out)  # its bytes in the pack; run again only from a given path or when allowed
    schema_io.write_json(out, artifacts.ENV, collect_env(None))
    seeds = {r: config["seed"] for r in range(1 + repeats + fresh)}
    if "repeat_seed" in config["test_options"]:
        seeds[config["test_options"]["repeat_seed"]["run"]] = config["test_options"]["repeat_seed"]["seed"]

    def request(r: int, **kw: Any) -> RunRequest:
        name = STEPS if r == 0 else f"repeats/run_{r}.jsonl"
        return RunRequest(config=config, model_path=str(model_path), run=r, seed=seeds[r], stop=config["steps"],
                          steps_file=str(out / name), **kw)

    results: dict[int, RunResult] = {0: run_steps(request(0, checkpoints=str(ckdir), keep_tensors=True))}
    for r in range(1, 1 + repeats + fresh):
        req = request(r, reference=str(out / STEPS))
        results[r] = run_steps(req) if r <= repeats else run_fresh(req)
    schema_io.write_json(out, CHECKPOINTS, schema_io.stamp("train_checkpoints", {
        "location": _relative(ckdir, out), "every": config["checkpoint_every"], "checkpoints": results[0].checkpoints}))
    report = make_report(config, results, repeats, command)
    schema_io.write_json(out, TRAIN_REPORT, report)
    schema_io.atomic_write_text(out / REPORT_TXT, render_text(report, out, ckdir))
    seal(out, signer)
    artifacts.mark_complete(out)
    return TrainOutcome(report, out, ckdir, EXIT_FAIL if report["verdict"] == "FAIL" else EXIT_PASS)


def _relative(path: Path, start: Path) -> str:
    return os.path.relpath(path.resolve(), start.resolve())


def max_abs_diff(a: Any, b: Any) -> float | None:
    """max |a - b| in float64 over two tensors of one shape; None when one is missing."""
    if a is None or b is None or a.shape != b.shape:
        return None
    d = (a.double() - b.double()).abs().max().item()
    return d if math.isfinite(d) else None


def make_report(config: dict[str, Any], results: dict[int, RunResult], repeats: int, command: str = "train-check") -> dict[str, Any]:
    ref = results[0]
    runs, comparisons, first = [], [], None
    for r, res in sorted(results.items()):
        g = res.records[0]
        runs.append({"run": r, "process": "reference" if r == 0 else "same" if r <= repeats else "fresh",
                     "file": STEPS if r == 0 else f"repeats/run_{r}.jsonl", "seed": g["seed"], "genesis": g["h"],
                     "head": res.records[-1]["h"], "seconds": res.seconds})
        if r == 0:
            continue
        div = first_divergence(ref.records, res.records, run=r, test_options=config["test_options"], dtype=config["dtype"])
        if div is not None and div["step"] is not None and div["parameter"] and res.divergent_step == div["step"]:
            kept = ref.kept.get(div["step"], {}).get(div["parameter"])
            mine = (res.divergent or {}).get(div["parameter"])
            if kept is not None and mine is not None:
                use_value = div["where"] == "value" or kept[0] is None or mine[0] is None or bool((kept[0] == mine[0]).all())
                div["max_abs_diff"] = max_abs_diff(kept[1], mine[1]) if use_value else max_abs_diff(kept[0], mine[0])
        comparisons.append({"run": r, "equal": div is None, "first_divergence": div})
        if div is not None and (first is None or earlier(div, first)):
            first = div
    n_same, n_fresh = repeats, len(results) - 1 - repeats
    verdict = "PASS" if first is None else "FAIL"
    k = config["steps"]
    fresh_text = (f", {n_fresh} in fresh processes (each imported torch, loaded the model and seeded anew)" if n_fresh
                  else "; none in a fresh process, so what is fixed per process was not varied")
    scope = (f"run 0 and {n_same} repeat(s) in this process{fresh_text}; threads {config['threads'] or 'torch default'}; "
             f"not varied: the machine, library versions, thread count, dtype")
    text = summary(first, len(results), k)
    if command == "train-run":  # one run, nothing compared: recorded, never PASS (trainrun.py)
        from .trainrun import RECORDED, recorded_scope, recorded_summary

        verdict, text, scope = RECORDED, recorded_summary(k, ref.records[-1]["h"]), recorded_scope(config)
    return schema_io.stamp("train_report", {
        "detllm_version": detllm_version(), "created_at": schema_io.utc_now(), "command": command, "verdict": verdict,
        "model": config["model"]["id"], "steps": k, "seed": config["seed"], "runs": runs, "comparisons": comparisons,
        "first_divergence": first, "summary": text, "scope": scope, "test_options": config["test_options"],
    })


def render_text(report: dict[str, Any], out: Path, ckdir: Path) -> str:
    lines = [report["summary"], f"scope: {report['scope']}"]
    for r in report["runs"]:
        lines.append(f"  run {r['run']} ({r['process']}, seed {r['seed']}): head {r['head'][:16]}…  {r['seconds']:.2f} s")
    for c in report["comparisons"]:
        if c["first_divergence"] is not None and c["first_divergence"] != report["first_divergence"]:
            lines.append(f"  run {c['run']}: {describe(c['first_divergence'])}")
    if report["test_options"]:
        lines.append(f"test options (test-only, recorded in {TRAIN_CONFIG}): {report['test_options']}")
    lines += [f"training pack: {out}", f"checkpoints: {ckdir}"]
    return "\n".join(lines) + "\n"


__all__ = ["TrainOutcome", "make_config", "make_report", "max_abs_diff", "parse_test_options", "render_text", "train_check", "train_run"]
