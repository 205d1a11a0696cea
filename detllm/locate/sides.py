"""What `locate` compares: its two sides (two selections as `diff` takes them, or the sides of one
diff folder or failing check folder) and the step s, the first generated-token position where
anything the two sides recorded differs (token, or at tier >= 2 the chosen or top-k logprobs),
with the prompt it happens in. Reads artifacts only; re-runs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..runfolder import artifacts
from ..compare.causes import Side
from ..compare.engine import align, parse_label
from ..commands.diff import Selection, folder_sides, load_sides
from ..core.errors import UsageError


@dataclass(frozen=True)
class Step:
    """The first recorded difference between the two sides."""

    prompt_index: int  # the left side's prompt index of the prompt under test
    right_prompt_index: int  # the same prompt on the right side
    prompt_id: str
    step: int  # generated-token position (0: the token the prefill yields)
    what: str  # token | logprob | top_logprobs | length; asked: --step chose it, whatever was recorded
    left: Any  # what the left side recorded there
    right: Any


def resolve(a: str, b: str | None) -> tuple[Selection, Selection, str, str | None]:
    """Two selections (FOLDER, FOLDER::batch_8, ...), or the sides of one diff folder or check folder
    or pack; returns them with where they came from ("selections", "diff folder", "check folder") and,
    where locate chose the comparison, which one and why (else None)."""
    if b is not None:
        return Selection.parse(a), Selection.parse(b), "selections", None
    folder = Path(a)
    if "::" in a or not (folder.is_dir() or (folder.is_file() and a.endswith((".tar.gz", ".tgz")))):
        raise UsageError(f"locate needs two sides, or one diff folder, check folder or pack; got only {a!r}",
                         hint="detllm locate A B (FOLDER::batch_1 FOLDER::batch_8), or detllm locate DIFF_FOLDER")
    if folder.is_dir():
        artifacts.check_complete(folder)
        if artifacts.is_diff_folder(folder):
            _, left, right = folder_sides(folder)  # the diff folder's sides, each folder resolved
            return (Selection(Path(left["path"]), left["run_index"], left["batch_size"]),
                    Selection(Path(right["path"]), right["run_index"], right["batch_size"]), "diff folder", None)
    with artifacts.open_run_path(folder) as real:
        if not artifacts.is_detllm_folder(real):
            raise UsageError(f"{a!r} is neither a run folder nor a diff folder", hint="pass two run folders or selections")
        report = artifacts.read_json(real / artifacts.REPORT, "report") if (real / artifacts.REPORT).is_file() else {}
    comp, why = _comparison(report)
    if comp is None:
        raise UsageError(f"{a!r} is not a check whose comparisons recorded a difference, so it names no two sides to locate",
                         hint="pass two selections, e.g. detllm locate FOLDER::batch_1 FOLDER::batch_8")
    (lr, lb), (rr, rb) = parse_label(comp["left"]), parse_label(comp["right"])
    return Selection(folder, lr, lb), Selection(folder, rr, rb), "check folder", why


def _comparison(report: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """The check's comparison to locate: its first failing one; else, on a passing check, the first
    whose records differ although it did not fail the verdict (logprobs that moved with the batch size,
    recorded INFO), said so."""
    if report.get("command") != "check":
        return None, None
    comps = [c for c in report.get("comparisons", []) if c.get("first_divergence")]
    failing = [c for c in comps if c.get("status") == "FAIL"]
    if failing:
        return failing[0], None
    if not comps:
        return None, None
    c = comps[0]
    return c, (f"the check {report.get('status', '')} recorded no failing comparison; located the one it recorded as drifting: "
               f"{c.get('name', c['left'] + ' vs ' + c['right'])} ({c.get('prompts_diverged', '?')}/"
               f"{c.get('prompts_compared', '?')} prompts diverged, {c.get('status')})")


def load(left: Selection, right: Selection) -> tuple[Side, Side]:
    """Both sides with their records and recorded settings (diff.load_sides: the one loader)."""
    return load_sides(left, right)


def compared_tier(left: Side, right: Side) -> int:
    """2 when both sides recorded logprobs (tier >= 2 and a backend that returns them), else 1."""
    lp = all(s.applied["capabilities"]["logprobs"] and s.applied["tier_effective"] >= 2 for s in (left, right))
    return 2 if lp else 1


def first_step(left: Side, right: Side, *, tier: int, prompt: int | None = None) -> Step | None:
    """The earliest step where a prompt's two records differ (ties: the lowest prompt index), or
    None when everything recorded agrees. `prompt` restricts it to that (left) prompt index."""
    pairs, _, _ = align(left.records, right.records)
    best: Step | None = None
    for lrec, rrec in pairs:
        if prompt is not None and lrec["prompt_index"] != prompt:
            continue
        found = _record_step(lrec, rrec, tier, _budget(left), _budget(right))
        if found is not None and (best is None or (found[0], lrec["prompt_index"]) < (best.step, best.prompt_index)):
            best = Step(lrec["prompt_index"], rrec["prompt_index"], lrec["prompt_id"], *found)
    if prompt is not None and not any(l["prompt_index"] == prompt for l, _ in pairs):
        raise UsageError(f"--prompt {prompt}: the two sides hold no common record of that prompt index")
    return best


def forced_step(left: Side, right: Side, step: int, prompt: int | None) -> Step:
    """`--step N`: capture at step N of `prompt` (default: the first common prompt) whatever was recorded."""
    pairs, _, _ = align(left.records, right.records)
    pick = next(((l, r) for l, r in pairs if prompt is None or l["prompt_index"] == prompt), None)
    if pick is None:
        raise UsageError(f"--prompt {prompt}: the two sides hold no common record of that prompt index" if prompt is not None
                         else "the two sides hold no common prompt")
    l, r = pick
    if step >= min(len(l["token_ids"]), len(r["token_ids"])):
        raise UsageError(f"--step {step}: prompt {l['prompt_index']} has {min(len(l['token_ids']), len(r['token_ids']))} "
                         "generated tokens on both sides", hint="steps count from 0 (the prefill)")
    return Step(l["prompt_index"], r["prompt_index"], l["prompt_id"], step, "asked", None, None)


def _budget(side: Side) -> int | None:
    """The side's recorded --max-new-tokens (None: not recorded)."""
    return (side.run_config or {}).get("config", {}).get("decoding", {}).get("max_new_tokens")


def lengths_apart(left: Side, right: Side) -> str | None:
    """When the sides recorded different --max-new-tokens, the line that says locate compares only the
    steps both have (a record that stops at its own limit is no difference); else None."""
    a, b = _budget(left), _budget(right)
    if a is None or b is None or a == b:
        return None
    return (f"the sides recorded different --max-new-tokens ({a} vs {b}): only the steps both recorded are compared; "
            "a record that stopped at its own limit is not a difference")


def _record_step(a: dict[str, Any], b: dict[str, Any], tier: int, budget_a: int | None = None,
                 budget_b: int | None = None) -> tuple[int, str, Any, Any] | None:
    ta, tb = a["token_ids"], b["token_ids"]
    for i in range(min(len(ta), len(tb))):
        if ta[i] != tb[i]:
            return i, "token", ta[i], tb[i]
        if tier >= 2:
            la, lb = _at(a.get("logprobs"), i), _at(b.get("logprobs"), i)
            if not _same(la, lb):
                return i, "logprob", la, lb
            ka, kb = _at(a.get("top_logprobs"), i), _at(b.get("top_logprobs"), i)
            if not _same(ka, kb):
                return i, "top_logprobs", ka, kb
    if len(ta) != len(tb):
        short = min(len(ta), len(tb))
        if (budget_a if len(ta) == short else budget_b) == short:
            return None  # the shorter record stopped at its own --max-new-tokens: no step of it to compare
        return short, "length", len(ta), len(tb)
    return None


def _at(seq: Any, i: int) -> Any:
    return seq[i] if isinstance(seq, list) and i < len(seq) else None


def _same(a: Any, b: Any) -> bool:
    """Bitwise as recorded: JSON floats compare exactly; a NaN written as null equals null."""
    return a == b


def differs_up_to(recorded: dict[str, Any], here: Any, last: int, *, tier: int) -> str | None:
    """What a re-run's generation (`here`, a base.Generation) changed from `recorded` at steps
    0..last, in one line, or None when it reproduces it bitwise."""
    ids = list(here.token_ids)
    for i in range(last + 1):
        if i >= len(recorded["token_ids"]):
            break
        if i >= len(ids):
            return f"step {i}: recorded token {recorded['token_ids'][i]}, the re-run stopped after {len(ids)} tokens"
        if ids[i] != recorded["token_ids"][i]:
            return f"step {i}: recorded token {recorded['token_ids'][i]}, re-run {ids[i]}"
        if tier >= 2 and here.logprobs is not None:
            rec_lp, lp = _at(recorded.get("logprobs"), i), here.logprobs[i]
            if rec_lp is not None and rec_lp != lp:
                return f"step {i}: recorded logprob {rec_lp!r}, re-run {lp!r}"
            rec_top = _at(recorded.get("top_logprobs"), i)
            top = [[t, v] for t, v in here.top_logprobs[i]] if here.top_logprobs is not None else None
            if rec_top is not None and top is not None and rec_top != top:
                return f"step {i}: recorded top-k {rec_top[:3]!r}..., re-run {top[:3]!r}..."
    return None


def side_json(side: Side, sel: Selection) -> dict[str, Any]:
    cfg = side.run_config["config"]
    return {"label": side.label, "folder": str(sel.folder), "run_index": side.run_index, "batch_size": side.batch_size,
            "backend": cfg["backend"], "model": cfg["model"], "dtype": cfg["dtype"], "device": cfg["device"],
            "options": dict(cfg.get("options", {}))}
