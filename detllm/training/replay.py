"""`detllm replay TRAIN_PACK [--sample k/N]`: re-run a training pack here and check that every
re-run step lands on its committed h_t with every re-computed field of its record equal. Without
--sample the whole run is re-run from genesis; with it, k of the N segments between checkpoint
boundaries are chosen at random, each re-run from its checkpoint (the first from genesis) and
checked to end on the state (R, optimizer, H(θ)) of the checkpoint at its stop boundary. Owns the
segment plan, the comparison with the committed records and train_replay.json; the steps are loop.py's.
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
from .verdict import differing_fields, first_divergence, step_differs

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
    where = checkpoints_dir(folder, checkpoints)
    index = artifacts.read_json(folder / CHECKPOINTS_INDEX, "train_checkpoints") if (folder / CHECKPOINTS_INDEX).is_file() else None
    by_b = {c["boundary"]: c for c in index["checkpoints"]} if index is not None and where is not None else {}

    def at(b: int) -> dict[str, Any] | None:  # the checkpoint at boundary b as a RunRequest's resume, None: not here
        c = by_b.get(b)
        return None if c is None or not (where / c["dir"]).is_dir() else {"dir": str(where / c["dir"]), "descriptor_sha256": c["descriptor_sha256"]}

    if plan is None:
        runs = [(0, steps, None, at(steps))]
    else:
        if not by_b:
            raise UsageError("--sample re-runs segments from checkpoints, and this pack's checkpoints are not found",
                             hint="pass --checkpoints DIR (or pack them with `detllm pack --with-checkpoints`)")
        segs = segments(steps, plan[1], set(by_b))
        rnd = random.Random(sample_seed) if sample_seed is not None else random.SystemRandom()
        chosen = [segs[i] for i in sorted(rnd.sample(range(plan[1]), plan[0]))]
        # a segment from boundary 0 starts at genesis (θ_init and the seed, nothing taken on trust); every
        # segment must end on the state of the checkpoint at its stop boundary, so both must be here
        gone = [b for a, z in chosen for b in ((a, z) if a else (z,)) if at(b) is None]
        if gone:
            raise UsageError(f"--sample: the checkpoint at boundary {gone[0]} is not in {str(where)!r}",
                             hint="a re-run segment starts from its first boundary's checkpoint and is checked against its last's")
        runs = [(a, z, at(a) if a else None, at(z)) for a, z in chosen]
    if out.is_dir():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    rows = []
    for start, stop, resume, end in runs:
        say(f"re-running steps {start}..{stop - 1}" + (f" from checkpoint boundary {start}" if resume else " from genesis"))
        req = RunRequest(config=config, model_path=str(model_path), run=0, seed=config["seed"], stop=stop,
                         steps_file=str(out / f"segment_{start:06d}_{stop:06d}.jsonl"), resume=resume, end_state=True)
        got = run_steps(req, make_task(start)) if make_task is not None else run_steps(req)
        row = _judge(committed, got.records, start, stop, config, resume is not None, got.seconds)
        row["end_state"] = end_state(committed, got.end_state, stop, end)
        rows.append(row)
    ok = all(r["landed"] and r["records_equal"] and r["end_state"]["equal"] is not False for r in rows)
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
    """One re-run segment against the committed records: every h_t equal (landed) and every
    re-computed field of every record equal (records_equal: batch, samples, R_t, loss, gradient
    norm, every digest and figure); else the first step that differs in either, its first field
    and parameter (verdict.first_divergence) and every field that differs there."""
    ref = {r["step"]: r for r in committed[1:]}
    mine = {r["step"]: r for r in got if r["artifact_type"] == "train_step"}
    genesis_ok = resumed or bool(got and got[0]["artifact_type"] == "train_genesis" and got[0]["h"] == committed[0]["h"]
                                 and not step_differs(got[0], committed[0]))
    first_h = next((t for t in range(start, stop) if mine.get(t, {}).get("h") != ref[t]["h"]), None)
    first_rec = next((t for t in range(start, stop) if t not in mine or step_differs(mine[t], ref[t])), None)
    row: dict[str, Any] = {"start": start, "stop": stop, "from": "checkpoint" if resumed else "genesis",
                           "landed": first_h is None and genesis_ok, "records_equal": first_rec is None and genesis_ok,
                           "head": mine[stop - 1]["h"] if stop - 1 in mine else None, "committed_head": ref[stop - 1]["h"],
                           "first_divergence": None, "fields": [], "seconds": seconds}
    if not (row["landed"] and row["records_equal"]):
        base = [committed[0]] + [ref[t] for t in range(start, stop)]
        again = [got[0] if not resumed else committed[0]] + [mine[t] for t in range(start, stop) if t in mine]
        row["first_divergence"] = first_divergence(base, again, run=1, test_options={}, dtype=config["dtype"])
        t = first_rec if first_rec is not None else first_h
        if t is not None and t in mine:
            row["fields"] = differing_fields(ref[t], mine[t])
    return row


def end_state(committed: list[dict[str, Any]], got: dict[str, str] | None, stop: int, end: dict[str, Any] | None) -> dict[str, Any]:
    """The state a re-run segment stopped on against the checkpoint at its stop boundary (loaded
    after its digests check out) and the R_stop steps.jsonl records: the RNG state (R), the
    optimizer state (O) and H(θ). `equal` None: no checkpoint at `stop` was found (a whole replay
    then still compared every step's R_t; only the state after the last step goes unchecked)."""
    from .checkpoint import load_checkpoint, optimizer_digest

    row: dict[str, Any] = {"boundary": stop, "equal": None, "differs": []}
    if end is None or got is None:
        return row
    ckpt = load_checkpoint(end["dir"], end["descriptor_sha256"])
    recorded = next((r["rng_sha256"] for r in committed[1:] if r["step"] == stop), ckpt.descriptor["rng_sha256"])
    want = {"rng_sha256": (ckpt.descriptor["rng_sha256"], recorded), "params_sha256": (ckpt.descriptor["params_sha256"],),
            "optimizer_sha256": (optimizer_digest(ckpt.optimizer, ckpt.descriptor["extra"]),)}
    row["differs"] = [k.removesuffix("_sha256") for k, vals in want.items() if any(got[k] != v for v in vals)]
    row["equal"] = not row["differs"]
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
        if "records_equal" in r:  # version 4 on: every re-computed field, and the state the segment ends on
            state += ", every record field equal" if r["records_equal"] else ", records DIFFER"
        lines.append(f"  steps {r['start']}..{r['stop'] - 1} from {r['from']}: {state} (h_{r['stop'] - 1} "
                     f"{(r['head'] or '-')[:16]}…, committed {r['committed_head'][:16]}…)")
        d = r["first_divergence"]
        if d is not None:
            lines.append(f"    first divergence: step {d['step']}, {d['where']}" + (f", parameter {d['parameter']}" if d["parameter"] else "")
                         + (f"; fields that differ: {', '.join(r['fields'][:6])}" + (f" and {len(r['fields']) - 6} more" if len(r['fields']) > 6 else "")
                            if r.get("fields") else ""))
        e = r.get("end_state")
        if e is not None:
            b = e["boundary"]
            lines.append(f"    ends on checkpoint boundary {b}'s state (R_{b}, optimizer, H(θ)): " + (
                "not checked: no checkpoint at that boundary was found" if e["equal"] is None else
                "equal" if e["equal"] else f"DIFFERS in {', '.join(e['differs'])}"))
    return "\n".join(lines) + "\n"
