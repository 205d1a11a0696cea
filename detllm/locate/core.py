"""`locate` end to end: resolve the two sides, find the step, re-run each side's recorded batch
with capture (at most twice per side), stop if a side does not reproduce its own trace, align the
captures, apply the root-cause rule and build locate.json. Reading, re-running and judging live in
sides.py, rerun.py, align.py and rule.py; writing the files in folder.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..runfolder import artifacts
from ..runfolder.env import detllm_version
from ..commands.diff import Selection
from ..core.errors import UsageError
from . import nextstep as nextsteps
from . import graft as grafts
from . import prefill as prefills
from . import rerun as reruns
from .category import categorize
from .align import pair_up
from .folder import Located, check_out, write_locate
from .rule import FACTOR, growth, judge, op_json, row_json, tolerance
from .warm import caches_across_batches
from .sides import compared_tier, first_step, forced_step, lengths_apart, load, resolve, side_json

DEFAULT_BOUND = 512 * 2**20  # bytes of captured tensors, both sides together
RULE = ("the first op, in execution order, whose inputs agree bitwise (cached K/V included) but whose output differs; "
        "a difference that entered from upstream is not that op's, one that entered through cached K/V is searched for "
        "at the step that wrote them")
TOLERANCE = {"factor": FACTOR, "formula": "|Δ| > factor * min(ref_error_left, ref_error_right) + 1 ulp",
             "description": "ref_error: each side's max |output - the same op in float64 on the same inputs|. With equal "
                            "inputs |Δ| <= ref_error_left + ref_error_right always, so a difference is beyond tolerance when "
                            "one side is further from float64 than the factor times the other is (torch._dynamo.utils.same's "
                            "idea), plus one unit in the last place at the output's magnitude"}


def locate(a: str, b: str | None = None, *, out: str | Path | None = None, force: bool = False, prompt: int | None = None,
           layers_only: bool = False, max_bytes: int = DEFAULT_BOUND, ops: bool = True, reference: bool = True,
           step: int | None = None, prefill: bool = False, graft: str = "right") -> Located:
    """Locate where sides `a` and `b` (or the sides of one diff or failing check folder `a`) first
    part: the step, then the first op at that step whose inputs agree but output differs.
    `layers_only`: layer boundaries only; `ops`: descend into aten ops where the backend captures
    them (a second re-run); `reference`: evaluate each op in float64 too (the tolerance; slower);
    `step`: capture at this step whatever was recorded there (a control: equal sides locate nothing);
    `prefill`: `a` alone (FOLDER[::sel]), its recorded decode against a prefill of the same tokens;
    `graft`: re-run the right side with the left's output of the located op grafted in (graft.py;
    "both": the reverse too, "off": none)."""
    grafts.check_mode(graft)
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or not 1024 <= max_bytes <= 2**50:
        raise UsageError(f"the memory bound on captured tensors is a number of bytes from 1024 to 2**50, got {max_bytes!r}")
    if prompt is not None and prompt < 0:
        raise UsageError(f"--prompt must be a prompt index (>= 0), got {prompt}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise UsageError(f"--step must be a generated-token position (>= 0), got {step!r}")
    if prefill:
        return _prefill(a, b, out=out, force=force, prompt=prompt, layers_only=layers_only, max_bytes=max_bytes, ops=ops,
                        reference=reference, step=step, graft=graft)
    left_sel, right_sel, source, chosen = resolve(a, b)
    left, right = load(left_sel, right_sel)
    target = check_out(out, force, left_sel, right_sel, source, given=a)
    tier = compared_tier(left, right)
    at = step
    step = first_step(left, right, tier=tier, prompt=prompt) if at is None else forced_step(left, right, at, prompt)
    doc: dict[str, Any] = {
        "detllm_version": detllm_version(), "created_at": artifacts.utc_now(), "source": source,
        "left": side_json(left, left_sel), "right": side_json(right, right_sel), "tier_compared": tier,
        "step": None, "status": "no_difference", "line": "", "captured_step": None, "steps_searched": [],
        "first_bitwise_op": None, "first_beyond_tolerance_op": None, "first_differing": None,
        "rule": RULE, "tolerance": TOLERANCE, "layers": [], "growth": [],
        "captured": {"level_requested": "layers" if layers_only else "ops" if ops else "modules",
                     "bound_bytes": max_bytes, "reference": reference},
        "not_captured": [], "cost": {},
    }
    if chosen:
        doc["chose"] = chosen
    apart = lengths_apart(left, right)
    if apart:
        doc["not_captured"].append(apart)
    if step is None:
        doc["line"] = ("the two sides agree bitwise over every step both recorded: nothing to locate" if apart else
                       "the two sides agree in everything recorded: nothing to locate")
        return write_locate(target, artifacts.stamp("locate", doc))
    doc["step"] = {"prompt": step.prompt_index, "right_prompt": step.right_prompt_index, "prompt_id": step.prompt_id,
                   "step": step.step, "what": step.what, "left": step.left, "right": step.right}
    sides = [reruns.prepare(left, step.prompt_index), reruns.prepare(right, step.right_prompt_index)]
    t0, timed = time.perf_counter(), None
    try:
        seen: dict = {}
        for r in sides:
            reruns.start(r, seen)  # model files checked (exit 7) and backends made before anything is written
        found = _search(doc, sides, step.step, tier=tier, layers_only=layers_only, bound=max_bytes, ops=ops, reference=reference)
        _cached_prefix(doc)
        timed = reruns.timing(sides)  # before the graft: its own seconds are graft.seconds
        if found is not None:
            grafts.graft(doc, sides, found, mode=graft, reference=reference, bound=max_bytes)
            categorize(doc, found, sides)
    finally:
        for r in sides:
            reruns.close(r)
    doc["cost"] = {"reruns": {"left": sides[0].runs, "right": sides[1].runs},
                   "peak_captured_bytes": {"left": sides[0].peak_bytes, "right": sides[1].peak_bytes},
                   "bound_bytes": max_bytes, "seconds": round(time.perf_counter() - t0, 3)}
    if timed is not None:
        doc["cost"]["rerun_seconds"] = timed
    return write_locate(target, artifacts.stamp("locate", doc))


def _prefill(a: str, b: str | None, *, out, force: bool, prompt: int | None, layers_only: bool, max_bytes: int,
             ops: bool, reference: bool, step: int | None, graft: str = "right") -> Located:
    """Prefill vs decode of one side: its recorded decode at step s (the first step where a prefill of
    prompt + tokens[:s] gives token s another logprob) against that prefill's last position."""
    if b is not None:
        raise UsageError("--prefill compares one side with its own prefill: pass one FOLDER or FOLDER::run_N@batch_B, not two")
    if step is not None:
        raise UsageError("--step and --prefill do not go together: --prefill finds the step where decode and prefill part")
    sel = Selection.parse(a)
    side, _ = load(sel, sel)
    tier = compared_tier(side, side)
    prefills.check(side, tier)
    reruns.check_capture(reruns.side_config(side), side.label)
    target = check_out(out, force, sel, sel, "selections")
    doc: dict[str, Any] = {
        "detllm_version": detllm_version(), "created_at": artifacts.utc_now(), "source": "prefill vs decode",
        "left": {**side_json(side, sel), "phase": "decode"}, "right": {**side_json(side, sel), "phase": "prefill"},
        "tier_compared": tier, "step": None, "status": "no_difference", "line": "", "captured_step": None,
        "steps_searched": [], "first_bitwise_op": None, "first_beyond_tolerance_op": None, "first_differing": None,
        "rule": RULE, "tolerance": TOLERANCE, "layers": [], "growth": [],
        "captured": {"level_requested": "layers" if layers_only else "ops" if ops else "modules",
                     "bound_bytes": max_bytes, "reference": reference},
        "not_captured": [], "cost": {},
    }
    t0 = time.perf_counter()
    decode, at, scanned = prefills.find_step(side, prompt, {})
    sides = [decode]
    try:
        doc["prefill"] = {"scored": scanned, "method": getattr(decode.backend, "score_method", "")}
        if at is None:
            steps = sum(p["steps_prefilled"] for p in doc["prefill"]["scored"])
            doc["line"] = (f"the prefill of prompt + tokens[:s] gives the recorded decode's token and logprob bitwise at every "
                           f"step ({steps} prefilled): nothing to locate")
        else:
            sides.append(prefills.prefill_side(decode, at))
            doc["step"] = {"prompt": at.prompt_index, "right_prompt": at.prompt_index, "prompt_id": at.prompt_id,
                           "step": at.step, "what": "prefill", "left": at.decoded, "right": at.prefilled, "token": at.token,
                           "prefill_token": at.prefill_token}
            doc["prefill"].update(prefill_length=len(sides[1].requests[0].input_ids), decode_batch=len(decode.requests))
            found = _search(doc, sides, at.step, tier=tier, layers_only=layers_only, bound=max_bytes, ops=ops, reference=reference)
            _kv_note(doc)
            if found is not None:
                grafts.graft(doc, sides, found, mode=graft, reference=reference, bound=max_bytes)
                categorize(doc, found, sides)
    finally:
        for r in sides:
            reruns.close(r)
    doc["cost"] = {"reruns": {"left": sides[0].runs, "right": sides[-1].runs if len(sides) > 1 else 0},
                   "peak_captured_bytes": {"left": sides[0].peak_bytes, "right": sides[-1].peak_bytes if len(sides) > 1 else 0},
                   "bound_bytes": max_bytes, "seconds": round(time.perf_counter() - t0, 3)}
    return write_locate(target, artifacts.stamp("locate", doc))


def _kv_note(doc: dict[str, Any]) -> None:
    """Prefill vs decode: how the decode's cached K/V were compared with the prefill's."""
    rows = [r for r in doc["layers"] if r["kind"] == "attention"]
    apart = [r["module"] for r in rows if r.get("kv_not_comparable")]
    if apart:
        doc["not_captured"].append(f"the decode side's cached K/V have no captured counterpart in the prefill (e.g. {apart[0]}): "
                                   "those attentions' inputs are not compared (kv_not_comparable), so none of them is blamed")
    compared = [r for r in rows if "cached_kv_equal" in r]
    if compared:
        moved = [r["module"] for r in compared if not r["cached_kv_equal"]]
        doc["not_captured"].append(
            f"the decode side's cached K/V (written at the steps before) were compared with the first positions of the K/V "
            f"the prefill's attention wrote in its pass, in {len(compared)} attention(s): "
            + (f"they differ from {moved[0]} on (so that attention's inputs differ)" if moved else "bitwise equal"))


def _cached_prefix(doc: dict[str, Any]) -> None:
    """Say which prompt positions only one side computed (the other read them from its prefix cache)."""
    warm = {k: doc[k].get("warmed_by") or {} for k in ("left", "right")}
    n = {k: warm[k].get("cached_prefix") or 0 for k in warm}
    if not any(n.values()):
        return
    both = min(n.values())
    if both:
        doc["not_captured"].append(f"prompt positions 0-{both - 1}: both sides read them from the prefix cache (warmed by "
                                   "replaying the earlier batches of their run folders first); computed by neither re-run")
    if n["left"] != n["right"]:
        key = "left" if n["left"] > n["right"] else "right"
        other = "right" if key == "left" else "left"
        doc["not_captured"].append(
            f"prompt positions {both}-{n[key] - 1} were computed on the {other} side only: the {key} side read them from the "
            f"prefix cache, warmed by replaying {warm[key]['batches']} earlier batch(es) of its run folder first; the rows "
            "compared are the positions both sides computed")


def _capture_both(doc: dict[str, Any], sides: list[reruns.Rerun], step: int, *, tier: int, level: str, bound: int,
                  reference: bool, strict: bool = True, ops_through: str | None = None, guide: bool = False) -> list | None:
    """Both sides captured at `step`; None (doc says why) when a side did not reproduce its trace:
    `strict`, that ends the search (not reproduced here); else only this capture is set aside."""
    # a side whose engine is loaded first: with one engine per process (vLLM) the other side's is let go once, not twice
    order = sorted(range(len(sides)), key=lambda i: not (sides[i].backend is not None and sides[i].backend.engine_loaded()))
    caught = {i: reruns.capture(sides[i], step, level=level, max_bytes=bound // 2, tier=tier, reference=reference,
                                ops_through=ops_through, guide=guide) for i in order}
    got = [caught[i] for i in range(len(sides))]
    for (cap, differs), r, key in zip(got, sides, ("left", "right")):
        if differs is not None and not strict:
            doc["not_captured"].append(f"the {level} capture changed the {key} side's outputs ({differs}): its {level} were "
                                       "not compared; the finding from the capture before stands")
            for r2, k2 in zip(sides, ("left", "right")):
                doc[k2]["reruns"] = r2.runs
            return None
    for (cap, differs), r, key in zip(got, sides, ("left", "right")):  # both sides' facts before a stop (each was re-run)
        doc[key].update(reruns=r.runs, level=cap.level, notes=r.notes + list(cap.notes), reproduced=differs is None)
    for (cap, differs), r, key in zip(got, sides, ("left", "right")):
        if r.warm or caches_across_batches(r.config):
            doc[key]["warmed_by"] = {"batches": len(r.warm), "recorded": r.warmed_by,
                                     "cached_prefix": next((e["cached_prefix"] for e in (cap.engine or {}).get("schedule", [])
                                                            if "cached_prefix" in e), 0)}
        if differs is not None:
            doc[key]["not_reproduced"] = differs
            apart = nextsteps.env_apart(r.side)
            doc.update(status="not_reproduced", line=f"not reproduced here: the {key} side's re-run differs from its "
                                                     f"own recorded trace at {differs}; nothing is located"
                                                     + (f"; its recorded environment differs from this one in {len(apart)} "
                                                        f"field(s), first {apart[0]['field']}" if apart else ""),
                       next=nextsteps.not_reproduced(key, apart, doc))
            return None
    return [cap for cap, _ in got]


def _search(doc: dict[str, Any], sides: list[reruns.Rerun], step: int, *, tier: int, layers_only: bool, bound: int, ops: bool,
            reference: bool) -> Found | None:
    """Capture both sides' modules at `step` and judge; go back once to the step that wrote differing
    K/V; then, with a re-run left and a backend that captures ops, descend into the ops."""
    level = "layers" if layers_only else "modules"
    while True:
        doc["steps_searched"].append(step)
        guide = _guide(sides, ops=ops, layers_only=layers_only)
        caps = _capture_both(doc, sides, step, tier=tier, level=level, bound=bound, reference=reference and not guide,
                             guide=guide)
        if caps is None:
            return None
        kv = "prefill" not in doc
        pairs, only_l, only_r = pair_up(caps[0].tensors, caps[1].tensors, _rows(sides), kv=kv)
        verdict = judge(pairs, evaluate=False)  # where to search next needs no float64: evaluated once the capture is final
        if verdict.back_to is not None and verdict.back_to < step and all(r.runs < 2 for r in sides):
            doc["not_captured"].append(f"step {step}: {verdict.first_differing.left.name} read cached K/V that differ "
                                       f"(written at step {verdict.back_to}); searched there")
            step = verdict.back_to
            continue
        if guide and not _descends(doc, verdict, caps):  # the guide would be final: the modules capture it stands for
            why = ("it passed the memory bound" if "layers" in {c.level for c in caps} else
                   "it names no module whose inputs agree and output differs")
            caps = _capture_both(doc, sides, step, tier=tier, level=level, bound=bound, reference=reference)
            if caps is None:
                return None
            pairs, only_l, only_r = pair_up(caps[0].tensors, caps[1].tensors, _rows(sides), kv=kv)
            verdict, guide = judge(pairs, evaluate=False), False
            doc["not_captured"].append(f"step {step}: no ops capture follows the guide capture ({why}): every module was "
                                       "captured again, in a re-run of its own")
        break
    asked = doc["step"]["what"] == "asked"
    if ops and not layers_only and all(r.runs < 2 and r.offers == "ops" for r in sides) and _descends(doc, verdict, caps):
        # ops only until the decoder layer holding the module found completes: the first op that differs is inside that
        # module or before it; the rest of its layer keeps the graft's next op at op level (docs/locate.md)
        module = verdict.first_bitwise.left.name if verdict.first_bitwise is not None else None
        through = _through(caps[0].tensors, module) if module is not None else None
        deeper = _capture_both(doc, sides, step, tier=tier, level="ops", bound=bound, reference=reference, strict=False,
                               ops_through=through)
        if deeper is not None:
            p2, l2, r2 = pair_up(deeper[0].tensors, deeper[1].tensors, _rows(sides), kv=kv)
            v2 = judge(p2, evaluate=False)
            if v2.first_bitwise is not None or asked:
                caps, pairs, only_l, only_r, verdict, guide = deeper, p2, l2, r2, v2, False
                if through is not None:
                    doc["captured"]["ops_through"] = through
                    doc["not_captured"].append(f"ops after {through} completed: modules only from there on ({module}, the first "
                                               "module whose inputs agree but output differs, completes by then)")
    if guide:  # the ops capture was set aside or named nothing, with no re-run left: the guide's finding stands
        doc["not_captured"].append("the guide capture's finding stands: inside each decoder layer only its attentions were "
                                   "captured, and no float64 inputs were kept (no tolerance)")
    verdict = judge(pairs)  # the verdict kept, now with its float64 tolerance (a capture set aside cost none)
    _conclude(doc, caps, pairs, only_l, only_r, verdict, step, bound)
    return Found(caps, pairs, verdict)


def _guide(sides: list[reruns.Rerun], *, ops: bool, layers_only: bool) -> bool:
    """Whether the modules capture about to run is a guide (CaptureSpec.guide): an ops capture may follow
    it (a re-run left on each side after it, a backend that captures ops). The ops capture records every
    module again, with its float64 inputs, and every op from the start until the decoder layer the guide
    names completes; so the guide needs no float64 inputs, and, inside a decoder layer, only the attentions
    (their cached K/V send the search back a step). A guide no ops capture follows is taken again as
    the modules capture it stands for (`_search`)."""
    return ops and not layers_only and all(r.runs == 0 and r.offers == "ops" for r in sides)


def _descends(doc: dict[str, Any], verdict: Any, caps: list) -> bool:
    """Whether an ops capture follows this modules capture: it names a module whose inputs agree and
    output differs (or the step was asked: "no op differs" is then claimed of the ops too), within the
    memory bound."""
    asked = doc["step"]["what"] == "asked"
    return (verdict.first_bitwise is not None or asked) and "layers" not in {c.level for c in caps}


def _through(tensors: list, name: str) -> str:
    """The module whose completion ends an ops capture: the decoder layer that holds module `name`
    (a capture's records name them, kind "layer"), else `name` itself (the embedding, the final norm)."""
    layers = {t.name for t in tensors if t.kind == "layer"}
    parts = name.split(".")
    return next((p for p in (".".join(parts[:i]) for i in range(len(parts), 0, -1)) if p in layers), name)


@dataclass
class Found:
    """What the last capture of a search holds: both captures, their pairs, the verdict (graft, category)."""

    caps: list
    pairs: list
    verdict: Any


def _rows(sides: list[reruns.Rerun]) -> tuple[int, int]:
    return len(sides[0].requests), len(sides[1].requests)


def _conclude(doc, caps, pairs, only_l, only_r, verdict, step: int, bound: int) -> None:
    prompt = doc["step"]["prompt"]
    doc["captured_step"] = step
    doc["first_bitwise_op"] = op_json(verdict.first_bitwise, prompt=prompt, step=step)
    doc["first_beyond_tolerance_op"] = op_json(verdict.first_beyond, prompt=prompt, step=step)
    first = verdict.first_differing
    doc["first_differing"] = None if first is None else {"module": first.left.name, "kind": first.left.kind,
                                                         "inputs_equal": first.inputs_equal}
    doc["layers"] = [row_json(p) for p in pairs]
    doc["growth"] = growth(pairs, verdict.first_bitwise or first)
    levels = {caps[0].level, caps[1].level}
    doc["captured"].update(level={"left": caps[0].level, "right": caps[1].level}, tensors=len(pairs),
                           only_left=only_l, only_right=only_r)
    if "layers" in levels and doc["captured"]["level_requested"] != "layers":
        doc["not_captured"].append(f"past the bound of {bound / 2**20:g} MB (both sides together), layer boundaries only were compared")
    if verdict.back_to is not None:
        doc["not_captured"].append(f"cached K/V differ from step {verdict.back_to}, but each side was already re-run twice")
    kept = [p.left.name for p in pairs if p.metrics.get("kept_whole")]
    if kept:
        doc["not_captured"].append(f"{len(kept)} op(s) kept whole on a side of several rows (no row of the prompt to cut, "
                                   f"e.g. {', '.join(kept[:3])}): not compared")
    doc["not_captured"] += [f"only on the left side: {n}" for n in only_l[:20]] + [f"only on the right side: {n}" for n in only_r[:20]]
    doc["status"], doc["line"] = _line(verdict, step, prompt, first, asked=doc["step"]["what"] == "asked")


def _line(verdict, step: int, prompt: int, first, *, asked: bool = False) -> tuple[str, str]:
    b, t = verdict.first_bitwise, verdict.first_beyond
    if b is None:
        if first is None and asked:
            return "not_located", f"prompt {prompt}, step {step} (asked): every captured output agrees bitwise: no op differs"
        if first is None:
            return "not_located", (f"prompt {prompt}, step {step}: every captured output agrees bitwise; the difference is "
                                   "in what was not captured (see not_captured)")
        return "not_located", (f"prompt {prompt}, step {step}: outputs differ from {first.left.name} on, but no captured op "
                               "has equal inputs and a different output; nothing is blamed")
    where = f"{b.left.name} ({b.left.kind}) at prompt {prompt}, step {step}"
    shapes = f"out {list(b.left.output_shape)} vs {list(b.right.output_shape)}"
    tol = (f"; beyond tolerance first at {t.left.name}" if t is not None and t is not b else
           "; beyond tolerance" if t is b else "; tolerance not evaluated (no float64 reference)" if tolerance(b) is None
           else "; within tolerance of both sides' float64 error")
    return "located", f"first op whose inputs agree but output differs: {where}, {shapes}, max |Δ| {_g(b.metrics['max_abs_diff'])}{tol}"


def _g(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)
