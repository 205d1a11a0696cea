"""The cause classifier: runs every detector over two sides (`differences`) and makes what
they found the ranked causes of a failing comparison, RUN_VARIANCE when nothing recorded
differs, or information when the outputs agree (`explain`); a cause that cannot produce the
divergence seen ranks below every cause that can (explains.py). Detects nothing itself.
"""

from __future__ import annotations

from typing import Any

from ...core import versions
from ..engine import align
from ..represent import mixed
from .codes import rank
from .config import config_mismatch
from .environment import backend_mismatch, env_mismatch
from .explains import judge
from .inputs import model_mismatch, prompt_mismatch, tokenizer_mismatch
from .notes import Notes, schema_versions
from .sides import Routed, Side
from .variance import batch_variance, cache_variance, divergence_summary, process_variance

_VARIANCE = ("RUN_VARIANCE", "BATCH_VARIANCE", "CACHE_VARIANCE", "PROCESS_VARIANCE")


def differences(left: Side, right: Side, comp: dict[str, Any], notes: Notes | None = None) -> list[dict[str, Any]]:
    """Every recorded difference between two sides, as ranked {code, evidence}. `notes`
    collects what could not be compared and what is never a cause."""
    pairs = align(left.records, right.records)[0] if left.records is not None and right.records is not None else []
    full = all(s.run_config is not None and s.env is not None for s in (left, right))
    notes = notes if notes is not None else Notes()
    if "token representation" in mixed(pairs):
        notes.skip("trace_record.token_ids", "token strings on one side, ids on the other: compared as token texts, "
                   "the top-k only where every entry's text is known (compare/represent.py)")
    routed = Routed()
    if full:
        notes.versions = schema_versions(left, right)
        if notes.versions[0] != notes.versions[1]:
            for c in versions.changes_between(*notes.versions):
                if not c.field.startswith("report."):  # a diff reads run folders, never their reports
                    notes.skip(c.field, f"redefined in version {c.since}: {c.what}")
    model = model_mismatch(left, right, notes) if full else None
    tokenizer = tokenizer_mismatch(left, right, pairs, notes)
    config = config_mismatch(left, right, notes, routed) if full else None  # routes machine and batch values first
    found = [
        ("MODEL_MISMATCH", model),
        ("TOKENIZER_MISMATCH", tokenizer),
        ("PROMPT_MISMATCH", prompt_mismatch(left, right, comp)),
        ("CONFIG_MISMATCH", config),
        ("BACKEND_MISMATCH", backend_mismatch(left, right, notes, routed) if full else None),
        ("ENV_MISMATCH", env_mismatch(left, right, notes, routed) if full else None),
        ("BATCH_VARIANCE", batch_variance(left, right, routed)),
        ("CACHE_VARIANCE", cache_variance(left, right, pairs)),
        ("PROCESS_VARIANCE", process_variance(pairs)),
    ]
    return rank([{"code": code, "evidence": ev} for code, ev in found if ev is not None])


def explain(comp: dict[str, Any], left: Side, right: Side,
            notes: Notes | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(causes, info) of one comparison. A failing comparison's causes are the recorded
    differences, ranked, or RUN_VARIANCE when there are none. When the outputs agree
    (or differ where the tier does not require agreement) the differences are info."""
    notes = notes if notes is not None else Notes()
    found = differences(left, right, comp, notes)
    for c in found:
        c["evidence"] = {"comparisons": [comp["name"]], **c["evidence"]}
    if comp["status"] == "PASS":
        return [], found
    judge(found, comp, left, right)  # a cause that cannot produce the divergence seen says why, and ranks below
    found = rank(found)
    if not found:
        what = "none: model, tokenizer, prompts, config, backend, environment, batch, server cache and process agree"
        if notes.not_compared:
            what += f" (not compared across schema versions: {', '.join(n['field'] for n in notes.not_compared[:4])})"
        found = [{"code": "RUN_VARIANCE", "evidence": {"comparisons": [comp["name"]], "recorded_differences": what}}]
    moved = comp.get("prompts_moved") or {}
    for c in found:
        if c["code"] in _VARIANCE:
            c["evidence"].update(divergence_summary(comp))
        if moved.get("count") and c["code"] in (*_VARIANCE, "PROMPT_MISMATCH"):
            c["evidence"]["prompts_moved"] = moved  # sampled seeds follow content, but batches follow positions
    return (found, []) if comp["status"] == "FAIL" else ([], found)
