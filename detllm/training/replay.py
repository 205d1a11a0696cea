"""`detllm replay TRAIN_PACK [--sample k/N]`: re-run a training pack here and check that every
re-run step lands on its committed h_t. Without --sample the whole run is re-run from genesis;
with it, k of the N segments between checkpoint boundaries are chosen at random and each is
re-run from its checkpoint (loaded only after its digests check out). Owns the segment plan, the
comparison with the committed records and train_replay.json; the steps are loop.py's.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable

from ..runfolder import artifacts
from ..runfolder.archive import open_run_path
from ..runfolder.env import detllm_version
from ..core.errors import ModelChangedError, UsageError
from ..runfolder.integrity import open_seal
from .chain import STEPS, load_config
from .pack import CHECKPOINTS_INDEX, TrainingOutcome, checkpoints_dir, records, verify_training
from .verdict import first_divergence

TRAIN_REPLAY = "train_replay.json"


def parse_sample(text: str | None) -> tuple[int, int] | None:
    """`--sample k/N` -> (k, N); None: the whole run from genesis."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise UsageError(f"--sample expects k/N with 1 <= k <= N (e.g. 2/8), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def segments(steps: int, n: int, available: set[int]) -> list[tuple[int, int]]:
    """N segments [b_i, b_{i+1}) of the K steps, every b_i a checkpoint boundary."""
    if n > steps:
        raise UsageError(f"--sample asks for {n} segments of a {steps}-step run", hint=f"N must be at most {steps}")
    cuts = [round(i * steps / n) for i in range(n + 1)]
    missing = [b for b in cuts[:-1] if b not in available]
    if missing:
        raise UsageError(f"--sample .../{n} starts segments at boundaries {', '.join(map(str, cuts[:-1]))}, but the pack has no "
                         f"checkpoint at boundary {missing[0]}", hint="choose N so its segments start at checkpoint boundaries")
    return list(zip(cuts[:-1], cuts[1:]))


def starting_weights(config: dict[str, Any], model: str | None, allow_model_change: bool) -> Path:
    """The starting weights: the recorded model (or --model), refused (exit 7) when they are not
    the recorded ones."""
    from ..core.hashing import folder_identity
    from ..models import resolve_model

    spec = config["model"]
    resolved = resolve_model(model or spec["id"], "hf")
    if resolved.path is None:
        raise UsageError(f"model {spec['id']!r} is not on this machine", hint="pass --model with a local folder")
    if spec["weights_sha256"] is not None and not allow_model_change:
        local = folder_identity(spec["id"], resolved.path).weights_sha256
        if local != spec["weights_sha256"]:
            raise ModelChangedError(f"the local weights of {spec['id']!r} (sha256 {local[:12]}…) are not the pack's "
                                    f"({spec['weights_sha256'][:12]}…)", hint="pass --allow-model-change to replay anyway")
    return resolved.path


def replay_training(pack: str | Path, *, out: str | Path | None = None, force: bool = False, sample: str | None = None,
                    sample_seed: int | None = None, checkpoints: str | Path | None = None, model: str | None = None,
                    allow_model_change: bool = False, script: str | None = None, allow_pack_options: tuple[str, ...] = (),
                    pubkey: str | Path | None = None, progress: Callable[[str], None] | None = None) -> TrainingOutcome:
    """Verify the pack, then re-run it (or k of N segments) and compare every re-run record's h_t
    with the committed one. PASS: every re-run step landed on its commitment."""
    with open_run_path(Path(pack)) as folder:
        return replay_folder(folder, label=str(pack), out=out, force=force, sample=sample, sample_seed=sample_seed,
                             checkpoints=checkpoints, model=model, allow_model_change=allow_model_change, script=script,
                             allow_pack_options=allow_pack_options, pubkey=pubkey, progress=progress)


def replay_folder(folder: Path, *, label: str, out: str | Path | None = None, force: bool = False, sample: str | None = None,
                  sample_seed: int | None = None, checkpoints: str | Path | None = None, model: str | None = None,
                  allow_model_change: bool = False, script: str | None = None, allow_pack_options: tuple[str, ...] = (),
                  pubkey: str | Path | None = None, progress: Callable[[str], None] | None = None) -> TrainingOutcome:
    """replay_training() of a folder (an extracted pack); `label` names the pack in the document."""
    from .loop import RunRequest, run_steps

    plan = parse_sample(sample)
    say = progress or (lambda _text: None)
    verify_training(open_seal(folder, pubkey), checkpoints=checkpoints)  # a changed pack is refused before anything runs
    config, _ = load_config(folder)
    committed = records(folder / STEPS)
    steps = config["steps"]
    make_task = _task_factory(folder, config, script, allow_pack_options)  # (start) -> loop's make_task, None: built-in
    model_path = starting_weights(config, model, allow_model_change) if config["task"]["kind"] == "builtin" else Path(".")
    out = Path(out) if out is not None else artifacts.default_out_dir("replay")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not ((out / TRAIN_REPLAY).is_file() and force))):
        raise UsageError(f"--out {str(out)!r} is not an empty folder", hint="choose another --out (or --force over an earlier replay)")
    if plan is None:
        runs = [(0, steps, None)]
    else:
        where = checkpoints_dir(folder, checkpoints)
        index = artifacts.read_json(folder / CHECKPOINTS_INDEX, "train_checkpoints") if (folder / CHECKPOINTS_INDEX).is_file() else None
        if where is None or index is None:
            raise UsageError("--sample re-runs segments from checkpoints, and this pack's checkpoints are not found",
                             hint="pass --checkpoints DIR (or pack them with `detllm pack --with-checkpoints`)")
        by_b = {c["boundary"]: c for c in index["checkpoints"]}
        segs = segments(steps, plan[1], set(by_b))
        rnd = random.Random(sample_seed) if sample_seed is not None else random.SystemRandom()
        chosen = sorted(rnd.sample(range(plan[1]), plan[0]))
        runs = [(segs[i][0], segs[i][1], {"dir": str(where / by_b[segs[i][0]]["dir"]),
                                          "descriptor_sha256": by_b[segs[i][0]]["descriptor_sha256"]}) for i in chosen]
    if out.is_dir():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    rows = []
    for start, stop, resume in runs:
        say(f"re-running steps {start}..{stop - 1}" + (f" from checkpoint boundary {start}" if resume else " from genesis"))
        req = RunRequest(config=config, model_path=str(model_path), run=0, seed=config["seed"], stop=stop,
                         steps_file=str(out / f"segment_{start:06d}_{stop:06d}.jsonl"), resume=resume)
        got = run_steps(req, make_task(start)) if make_task is not None else run_steps(req)
        rows.append(_judge(committed, got.records, start, stop, config, resume is not None, got.seconds))
    ok = all(r["landed"] for r in rows)
    doc = artifacts.stamp("train_replay", {
        "detllm_version": detllm_version(), "created_at": artifacts.utc_now(), "pack": label, "steps": steps,
        "sample": None if plan is None else {"k": plan[0], "n": plan[1], "seed": sample_seed},
        "verdict": "PASS" if ok else "FAIL", "segments": rows,
    })
    artifacts.write_json(out, TRAIN_REPLAY, doc)
    text = render_replay(doc)
    artifacts.atomic_write_text(out / "train_replay.txt", text)
    return TrainingOutcome(doc, out, text)


def _judge(committed: list[dict[str, Any]], got: list[dict[str, Any]], start: int, stop: int, config: dict[str, Any],
           resumed: bool, seconds: float) -> dict[str, Any]:
    """One re-run segment against the committed records: every h_t equal, else the first step whose
    h differs and, from the records, the first field and parameter there."""
    ref = {r["step"]: r for r in committed[1:]}
    mine = {r["step"]: r for r in got if r["artifact_type"] == "train_step"}
    first = next((t for t in range(start, stop) if mine.get(t, {}).get("h") != ref[t]["h"]), None)
    genesis_ok = resumed or (got and got[0]["artifact_type"] == "train_genesis" and got[0]["h"] == committed[0]["h"])
    row: dict[str, Any] = {"start": start, "stop": stop, "from": "checkpoint" if resumed else "genesis", "landed": first is None and bool(genesis_ok),
                           "head": mine[stop - 1]["h"] if stop - 1 in mine else None, "committed_head": ref[stop - 1]["h"],
                           "first_divergence": None, "seconds": seconds}
    if not row["landed"]:
        base = [committed[0]] + [ref[t] for t in range(start, stop)]
        again = [got[0] if not resumed else committed[0]] + [mine[t] for t in range(start, stop) if t in mine]
        row["first_divergence"] = first_divergence(base, again, run=1, test_options={})
    return row


def _task_factory(folder: Path, config: dict[str, Any], script: str | None, allow: tuple[str, ...]) -> Any:
    """None for the built-in task (loop.py's default); for a --script pack, per segment start, the
    loop's make_task running the script the user gave (or the pack's copy, only when allowed),
    checked against the recorded sha256 before it runs."""
    if config["task"]["kind"] != "script":
        if script is not None:
            raise UsageError("--script applies to a pack made with --script; this pack trained the built-in task")
        return None
    from .script import script_for_replay, script_task_maker

    if script is None and "script" not in allow:
        script_for_replay(folder, config, script, allow)  # refused here, before --out is touched
    return lambda start: script_task_maker(lambda: script_for_replay(folder, config, script, allow), fast_forward=start)


def render_replay(doc: dict[str, Any]) -> str:
    what = "the whole run from genesis" if doc["sample"] is None else f"{doc['sample']['k']} of {doc['sample']['n']} segments"
    lines = [f"replay: {doc['verdict']}  ({what}, {doc['steps']} steps)"]
    for r in doc["segments"]:
        state = "landed on its committed h" if r["landed"] else "did NOT land on its committed h"
        lines.append(f"  steps {r['start']}..{r['stop'] - 1} from {r['from']}: {state} (h_{r['stop'] - 1} "
                     f"{(r['head'] or '-')[:16]}…, committed {r['committed_head'][:16]}…)")
        d = r["first_divergence"]
        if d is not None:
            lines.append(f"    first divergence: step {d['step']}, {d['where']}" + (f", parameter {d['parameter']}" if d["parameter"] else ""))
    return "\n".join(lines) + "\n"
