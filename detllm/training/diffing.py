"""`detllm diff A B` of two training packs: the first divergent step, the first field and the first
parameter by name whose gradient or value differs, max |Δ| there (digests give none, so both sides
are re-run to that step from their nearest checkpoints, each re-run checked against its own
commitments), and how the difference grows over the later steps (from the recorded figures).
Owns train_diff.json and its text; the record comparison is verdict.py's, the steps loop.py's.
"""

from __future__ import annotations

import math
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ..runfolder import artifacts
from ..runfolder.archive import is_archive, open_run_path
from ..runfolder.env import detllm_version
from ..core.errors import UsageError
from ..runfolder.integrity import open_seal, seal
from .chain import STEPS, load_config
from .digest import chain_of
from .pack import CHECKPOINTS_INDEX, TrainingOutcome, checkpoints_dir, is_training_pack, records, verify_training
from .verdict import differing_parameters, first_divergence

TRAIN_DIFF = "train_diff.json"
NO_SCRIPT = "a --script pack: not re-run here without its script (give it: diff A B --script PATH[:make], its sha256 checked)"


def is_training_side(arg: str) -> bool:
    """A diff side that is a training pack (a folder, or a .tar.gz holding one)."""
    p = Path(arg)
    if p.is_dir():
        return is_training_pack(p)
    if p.is_file() and is_archive(p):
        with open_run_path(p) as folder:
            return is_training_pack(folder)
    return False


def diff_training_sides(a: str, b: str, **kw: Any) -> TrainingOutcome:
    """diff's dispatch for training packs: both sides must be one; diff's options for traces
    (--junit, --plot, --tier, --atol) do not apply and are refused, never dropped."""
    for side in (a, b):
        if not is_training_side(side):
            raise UsageError(f"{side!r} is not a training pack, and the other side is one", hint="diff two training packs")
    for key, flag in (("junit", "--junit"), ("plot", "--plot"), ("tier", "--tier")):
        if kw.get(key) is not None:
            raise UsageError(f"{flag} does not apply to training packs (they are compared bit for bit, step by step)")
    if kw.get("atol"):
        raise UsageError("--atol does not apply to training packs: they are compared bit for bit")
    return diff_packs(a, b, out=kw.get("out"), force=kw.get("force", False), scripts=kw.get("script"))


def growth(ref: list[dict[str, Any]], other: list[dict[str, Any]], start: int) -> list[dict[str, Any]]:
    """Per step from `start` on, from the records: parameters whose value (and gradient) digests
    differ, |Δloss|, |Δgrad_norm| and the largest |Δ L2 norm| of a parameter's value (a lower
    bound of that parameter's ‖Δθ‖₂)."""
    a = {r["step"]: r for r in ref if r["artifact_type"] == "train_step"}
    b = {r["step"]: r for r in other if r["artifact_type"] == "train_step"}
    rows = []
    for t in sorted(set(a) & set(b)):
        if t < start:
            continue
        ra, rb = a[t], b[t]
        l2 = [abs(x["value_l2"] - y["value_l2"]) for n, x in ra["tensors"].items() if (y := rb["tensors"].get(n))
              and x["value_l2"] is not None and y["value_l2"] is not None]
        rows.append({"step": t, "values_differing": len(differing_parameters(ra, rb, "value_sha256")),
                     "grads_differing": len(differing_parameters(ra, rb, "grad_sha256")), "parameters": len(ra["tensors"]),
                     "abs_loss_diff": _absdiff(ra["loss"], rb["loss"]), "abs_grad_norm_diff": _absdiff(ra["grad_norm"], rb["grad_norm"]),
                     "max_abs_value_l2_diff": max(l2, default=0.0)})
    return rows


def _absdiff(x: float | None, y: float | None) -> float | None:
    return None if x is None or y is None else abs(x - y)


def _nearest(folder: Path, checkpoints: str | Path | None, step: int) -> dict[str, Any] | None:
    """The checkpoint at the largest boundary <= step, as a RunRequest's `resume`; None: none found."""
    where = checkpoints_dir(folder, checkpoints)
    if where is None or not (folder / CHECKPOINTS_INDEX).is_file():
        return None
    index = artifacts.read_json(folder / CHECKPOINTS_INDEX, "train_checkpoints")
    usable = [c for c in index["checkpoints"] if c["boundary"] <= step and (where / c["dir"]).is_dir()]
    if not usable:
        return None
    best = max(usable, key=lambda c: c["boundary"])
    return {"dir": str(where / best["dir"]), "descriptor_sha256": best["descriptor_sha256"], "boundary": best["boundary"]}


def replay_tensors(folder: Path, config: dict[str, Any], committed: list[dict[str, Any]], step: int, names: list[str],
                   checkpoints: str | Path | None, tmp: Path, script: str | None = None) -> tuple[dict[str, tuple[Any, Any]] | None, str]:
    """Re-run one side to `step` from its nearest checkpoint and return name -> (gradient, value)
    at that step, with a note; None when it cannot (no checkpoint, a script pack, or the re-run did
    not land on the side's own commitments: its tensors would not be the recorded ones)."""
    from .loop import RunRequest, run_steps
    from .replay import starting_weights  # the architecture only: the checkpoint's parameters replace the weights

    if config["task"]["kind"] == "script" and script is None:
        return None, NO_SCRIPT
    resume = _nearest(folder, checkpoints, step)
    if resume is None:
        return None, "no checkpoint at or before that step was found"
    b = resume.pop("boundary")
    model, make = _runner(folder, config, script, b)
    req = RunRequest(config=config, model_path=str(model), run=0, seed=config["seed"], stop=step + 1,
                     steps_file=str(tmp / f"replay_{id(folder)}.jsonl"), resume=resume, keep_tensors=True)
    got = run_steps(req, make)
    ref = {r["step"]: r["h"] for r in committed[1:]}
    if any(r["h"] != ref.get(r["step"]) for r in got.records if r["artifact_type"] == "train_step"):
        return None, f"re-running from boundary {b} did not land on this pack's own commitments"
    kept = got.kept.get(step, {})
    return {n: kept[n] for n in names if n in kept}, f"re-run from checkpoint boundary {b} to step {step}, landed on its commitments"


def _runner(folder: Path, config: dict[str, Any], script: str | None, boundary: int) -> tuple[Path, Any]:
    """(model path, make_task) to re-run a side from `boundary`: the recorded weights, or a --script pack's script."""
    from .loop import build_task
    from .replay import starting_weights  # the architecture only: the checkpoint's parameters replace the weights
    from .script import script_runner

    if config["task"]["kind"] == "script":
        return script_runner(folder, config, script, boundary)
    return starting_weights(config, None, True), build_task


NUMERIC_KEYS = frozenset({"threads", "dtype", "grad_accumulation"})  # same data and randomness, other arithmetic
INERT_KEYS = frozenset({"checkpoint_every"})  # where checkpoints are taken changes no bit of the training (segmented replay)


def _config_cause(ca: dict[str, Any], cb: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """The cause of a divergence between packs whose train_config.json differs, named by the keys."""
    keys = [k for k in keys if k not in INERT_KEYS] or keys
    said = ", ".join(f"{k} {ca.get(k)!r} vs {cb.get(k)!r}" for k in keys)
    if keys == ["seed"]:
        return {"where": "seed", "cause": "seed", "detail": f"A was trained with seed {ca['seed']}, B with seed {cb['seed']}: "
                                                            "every random stream (data order, dropout) differs"}
    if set(keys) <= NUMERIC_KEYS:
        return {"cause": "numerics", "detail": f"the same data and randomness with other arithmetic: {said}"}
    return {"cause": "unknown", "detail": f"train_config.json differs: {said}"}


def first_op(fa: Path, ca: dict[str, Any], sa: dict[str, Any], ck_a: Any, fb: Path, cb: dict[str, Any], sb: dict[str, Any],
             ck_b: Any, t: int, scripts: tuple[str | None, str | None] = (None, None)) -> dict[str, Any]:
    """The first module or op (forward, then backward) whose tensor differs at step t, from both
    sides re-run under taps (opdiff.py); only where both drew the same batch at t."""
    from .opdiff import first_differing, tapped_step

    if sa["batch_sha256"] != sb["batch_sha256"]:
        return {"found": None, "why": f"the two batches of step {t} differ: the inputs are the first difference"}
    if any(c["task"]["kind"] == "script" and s is None for c, s in ((ca, scripts[0]), (cb, scripts[1]))):
        return {"found": None, "why": NO_SCRIPT}
    ra, rb = _nearest(fa, ck_a, t), _nearest(fb, ck_b, t)
    if ra is None or rb is None:
        return {"found": None, "why": "no checkpoint at or before that step on both sides"}
    taps = []
    for f, c, r, script in ((fa, ca, ra, scripts[0]), (fb, cb, rb, scripts[1])):
        model, make = _runner(f, c, script, r["boundary"])
        taps.append(tapped_step(c, model, r, t, make))
    found = first_differing(*taps)
    why = "" if found is not None else "every captured module output and gradient is equal (the difference is outside the modules)"
    return {"found": found, "why": why, "captured": [len(x.tensors) for x in taps]}


def _max_abs(x: Any, y: Any) -> float | None:
    if x is None or y is None or x.shape != y.shape:
        return None
    d = (x.double() - y.double()).abs().max().item()
    return d if math.isfinite(d) else None


def diff_packs(a: str | Path, b: str | Path, *, out: str | Path | None = None, force: bool = False,
               checkpoints_a: str | Path | None = None, checkpoints_b: str | Path | None = None,
               magnitude: bool = True, scripts: list[str] | None = None) -> TrainingOutcome:
    """Compare two training packs' reference runs step by step. PASS: bitwise equal at every step.
    `scripts`: the script of --script packs (one for both sides, or A's then B's), checked by sha256."""
    out = Path(out) if out is not None else None
    if out is not None and out.exists() and (not out.is_dir() or (any(out.iterdir()) and not ((out / TRAIN_DIFF).is_file() and force))):
        raise UsageError(f"--out {str(out)!r} is not an empty folder", hint="choose another --out (or --force over an earlier diff)")
    with ExitStack() as stack:
        fa, fb = (stack.enter_context(open_run_path(Path(p))) for p in (a, b))
        for f in (fa, fb):
            verify_training(open_seal(f))  # a changed pack is refused before it is compared
        (ca, _), (cb, _) = load_config(fa), load_config(fb)
        if chain_of(ca) != chain_of(cb):
            raise UsageError(f"{a} and {b} hash their tensors by different chain versions ({chain_of(ca)}, {chain_of(cb)}): "
                             f"no digest of one can be compared with the other's",
                             hint="record the older side again with this detllm (train-run), then diff")
        ss = _scripts(fa, ca, fb, cb, scripts)
        ra, rb = records(fa / STEPS), records(fb / STEPS)
        div = first_divergence(ra, rb, run=1, test_options={}, dtype=ca["dtype"])
        config_keys = sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k))
        if div is not None and config_keys and first_divergence(ra, rb, run=1, config=False) is None:
            div = None  # every step bitwise equal: the configurations differ (so must H(config)) and changed no bit
        if div is not None and config_keys:
            div.update(_config_cause(ca, cb, config_keys))
        detail: dict[str, Any] = {}
        if div is not None and div["step"] is not None:
            t = div["step"]
            sa = next(r for r in ra[1:] if r["step"] == t)
            sb = next((r for r in rb[1:] if r["step"] == t), None)
            grads = differing_parameters(sa, sb, "grad_sha256") if sb else []
            values = differing_parameters(sa, sb, "value_sha256") if sb else []
            detail = {"grads_differing": grads, "values_differing": values}
            param = div["parameter"]
            if magnitude and param is not None and sb is not None:
                with tempfile.TemporaryDirectory(prefix="detllm-train-diff-") as tmp:
                    ta, note_a = replay_tensors(fa, ca, ra, t, [param], checkpoints_a, Path(tmp), ss[0])
                    tb, note_b = replay_tensors(fb, cb, rb, t, [param], checkpoints_b, Path(tmp), ss[1])
                detail["replay"] = {"a": note_a, "b": note_b}
                if ta and tb and param in ta and param in tb:
                    detail["max_abs_grad_diff"] = _max_abs(ta[param][0], tb[param][0])
                    detail["max_abs_value_diff"] = _max_abs(ta[param][1], tb[param][1])
                    div["max_abs_diff"] = detail["max_abs_grad_diff"] if param in grads else detail["max_abs_value_diff"]
            if magnitude and sb is not None:
                detail["first_op"] = first_op(fa, ca, sa, checkpoints_a, fb, cb, sb, checkpoints_b, t, ss)
    start = div["step"] if div is not None and div["step"] is not None else 0
    doc = artifacts.stamp("train_diff", {
        "detllm_version": detllm_version(), "created_at": artifacts.utc_now(), "a": str(a), "b": str(b),
        "verdict": "PASS" if div is None else "FAIL", "config_differs": config_keys, "first_divergence": div,
        "at_divergence": detail, "growth": growth(ra, rb, start) if div is not None else [],
    })
    text = render_diff(doc)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        artifacts.write_json(out, TRAIN_DIFF, doc)
        artifacts.atomic_write_text(out / "train_diff.txt", text)
        seal(out)  # verify and pack take it (training/results.py re-derives its verdict)
    return TrainingOutcome(doc, out, text)


def _scripts(fa: Path, ca: dict[str, Any], fb: Path, cb: dict[str, Any], given: list[str] | None) -> tuple[str | None, str | None]:
    from .script import side_script

    if given and (len(given) > 2 or "script" not in (ca["task"]["kind"], cb["task"]["kind"])):
        raise UsageError("--script applies to packs made with --script: once for both sides, or twice (A's, then B's)")
    return side_script(fa, ca, given, 0), side_script(fb, cb, given, 1)


def render_diff(doc: dict[str, Any]) -> str:
    d = doc["first_divergence"]
    if d is None:
        same = "diff: PASS  the two training packs' reference runs are bitwise equal at every step"
        keys = doc["config_differs"]
        return same + (f"\n  train_config.json differs in: {', '.join(keys)}, which changed no bit of any step "
                       "(only H(config) in the genesis differs)\n" if keys else "\n")
    at = f"step {d['step']}" if d["step"] is not None else "the genesis"
    lines = [f"diff: FAIL  first divergent step: {at} ({d['where']})" + (f", first parameter {d['parameter']}" if d["parameter"] else "")]
    if doc["config_differs"]:
        lines.append(f"  train_config.json differs in: {', '.join(doc['config_differs'])}")
    lines.append(f"  cause: {d['cause']}: {d['detail']}")
    x = doc["at_divergence"]
    if x:
        lines.append(f"  at step {d['step']}: {len(x['grads_differing'])} gradients and {len(x['values_differing'])} values differ")
        if "max_abs_grad_diff" in x:
            g, v = x["max_abs_grad_diff"], x["max_abs_value_diff"]
            lines.append(f"  max |Δ| at {d['parameter']}: gradient {g if g is None else f'{g:.3g}'}, value {v if v is None else f'{v:.3g}'}")
        if "replay" in x:
            lines.append(f"  tensors: A {x['replay']['a']}; B {x['replay']['b']}")
        op = x.get("first_op")
        if op is not None and op["found"] is not None:
            f = op["found"]
            delta = "" if f["max_abs_diff"] is None else f", max |Δ| {f['max_abs_diff']:.3g}"
            lines.append(f"  first module/op that differs inside step {d['step']}: {f['name']} ({f['phase']}, {f['kind']}{delta})")
        elif op is not None:
            lines.append(f"  first module/op inside step {d['step']}: not named: {op['why']}")
    if doc["growth"]:
        lines.append("  growth (step: values differing / parameters, |Δloss|, max |Δ‖θ‖₂| of a parameter):")
        for g in doc["growth"]:
            loss = "-" if g["abs_loss_diff"] is None else f"{g['abs_loss_diff']:.3g}"
            lines.append(f"    {g['step']}: {g['values_differing']}/{g['parameters']}, {loss}, {g['max_abs_value_l2_diff']:.3g}")
    return "\n".join(lines) + "\n"


train_diff = diff_packs  # the Python API's name (detllm.train_diff): the CLI's `diff A B` of two training packs
