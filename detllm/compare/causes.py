"""Why two selections of trace records differ: every recorded difference as a cause
with its evidence, ranked.

One implementation for `check` (selections of one folder) and `diff` (two folders).
A `Side` is what was recorded for one selection; `differences` finds what differs
between two sides; `explain` makes those the ranked causes of a failing comparison,
or information when the outputs agree. Reads artifacts only; docs/causes.md says what
each code means and what to do next.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from ..env import VOLATILE_KEYS
from .engine import align

# Most fundamental first: a different model, tokenizer or prompt set makes different
# output expected; config changes the computation asked for; backend and environment
# change the kernels that compute it; run and batch variance are left when nothing
# else was recorded differently. They meet only in `check`, where runs that vary at a
# fixed batch size also explain the batch comparisons, so RUN_VARIANCE comes first. A
# model difference that is only a format conversion (safetensors vs GGUF never hash
# alike) ranks just after BACKEND_MISMATCH.
RANK = ("MODEL_MISMATCH", "TOKENIZER_MISMATCH", "PROMPT_MISMATCH", "CONFIG_MISMATCH", "BACKEND_MISMATCH",
        "ENV_MISMATCH", "RUN_VARIANCE", "BATCH_VARIANCE")
TITLES = {
    "MODEL_MISMATCH": "the model weights (or its config) differ",
    "TOKENIZER_MISMATCH": "the tokenizer differs",
    "PROMPT_MISMATCH": "the prompt sets differ",
    "CONFIG_MISMATCH": "the run configuration differs",
    "BACKEND_MISMATCH": "the inference engine differs",
    "ENV_MISMATCH": "the environment differs",
    "BATCH_VARIANCE": "only the batch size or composition differs",
    "RUN_VARIANCE": "nothing recorded differs, yet the outputs do",
}
ADVICE = {
    "MODEL_MISMATCH": "compare against a run of the same weights (see evidence.files), or re-run both sides with one model folder",
    "TOKENIZER_MISMATCH": "use the same tokenizer files on both sides; evidence.examples shows the input ids that differ",
    "PROMPT_MISMATCH": "run both sides on the same prompt file; the prompts listed were compared with nothing",
    "CONFIG_MISMATCH": "re-run one side with the other's settings (evidence.fields) to see whether the difference follows them",
    "BACKEND_MISMATCH": "different engines or builds run different kernels; pin one engine version, or accept tier 1 across engines",
    "ENV_MISMATCH": "pin the libraries, drivers and thread settings listed in evidence.differences, or re-run on one machine",
    "BATCH_VARIANCE": "the kernels are not batch invariant: fix the batch size, or use an engine/tier that enforces batch invariance",
    "RUN_VARIANCE": "the engine is nondeterministic at this setting: raise --tier, set --threads, or check for atomics/async kernels",
}
# run_config.config fields judged elsewhere or not about generation
_NOT_CONFIG = ("backend", "model", "revision", "batch_size", "vary_batch", "runs", "atol", "record_prompt_text", "options")
_CAP = 20  # evidence lists keep this many entries; a count says how many there were
_ABSENT = "<absent>"


@dataclass(frozen=True)
class Side:
    """One selection of trace records and what its folder recorded. Within one folder
    (check) env/run_config/applied are None: there is nothing to compare them with."""

    label: str
    run_index: int
    batch_size: int
    records: list[dict[str, Any]] | None = None
    folder: str | None = None
    env: dict[str, Any] | None = None
    run_config: dict[str, Any] | None = None
    applied: dict[str, Any] | None = None


def flat_diff(a: Any, b: Any, prefix: str = "") -> list[dict[str, Any]]:
    """Leaf-by-leaf differences of two JSON values: [{field: "libraries.torch", left, right}]."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[dict[str, Any]] = []
        for k in sorted(set(a) | set(b), key=str):
            out += flat_diff(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{prefix}.{k}" if prefix else str(k))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and any(isinstance(x, dict) for x in a + b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in flat_diff(x, y, f"{prefix}[{i}]")]
    if a == b and type(a) is type(b):
        return []
    return [{"field": prefix, "left": a, "right": b}]


def _lr(a: Any, b: Any) -> dict[str, Any]:
    return {"left": a, "right": b}


def _cut(items: list[Any], cap: int = _CAP) -> list[Any]:
    return items[:cap]


# ------------------------------------------------------------------ detectors


def _model(left: Side, right: Side) -> dict[str, Any] | None:
    lm, rm = left.run_config["model"], right.run_config["model"]
    lc, rc = lm.get("config_sha256"), rm.get("config_sha256")
    config_differs = lc is not None and rc is not None and lc != rc
    if lm["weights_sha256"] == rm["weights_sha256"] and not config_differs:
        return None
    lw, rw = ({w["file"]: w["sha256"] for w in m["weights"]} for m in (lm, rm))
    files = [{"file": f, "left": lw.get(f), "right": rw.get(f)} for f in sorted(set(lw) | set(rw)) if lw.get(f) != rw.get(f)]
    ev: dict[str, Any] = {
        "weights_sha256": _lr(lm["weights_sha256"], rm["weights_sha256"]),
        "model": _lr(lm["id"], rm["id"]),
        "path": _lr(lm["path"], rm["path"]),
        "same_path": lm["path"] is not None and lm["path"] == rm["path"],
        "files": _cut(files),
        "files_differing": len(files),
    }
    for key in ("format", "quantization", "revision"):
        if lm[key] != rm[key]:
            ev[key] = _lr(lm[key], rm[key])
    if lm["format"] != rm["format"]:
        ev["converted"] = True  # weights in different formats never hash equal
    if config_differs:
        ev["config_sha256"] = _lr(lc, rc)  # the architecture or decoding defaults were edited
    return ev


def _tokenizer(left: Side, right: Side, pairs: list[tuple[dict, dict]]) -> dict[str, Any] | None:
    """Input ids first: they are what the engine saw, comparable across engines. The
    tokenizer hash is compared only where it is computed the same way (same engine and
    model format); identical tokenizer files at different paths hash the same."""
    differ = [(a, b) for a, b in pairs if a["input_ids_sha256"] != b["input_ids_sha256"]]
    ev: dict[str, Any] = {}
    if differ:
        examples = []
        for a, b in differ[:3]:
            la, lb = a.get("input_ids"), b.get("input_ids")
            first = None if la is None or lb is None else next(
                (i for i, (x, y) in enumerate(zip(la, lb)) if x != y), min(len(la), len(lb)))
            examples.append({"prompt_index": a["prompt_index"], "prompt_id": a["prompt_id"], "first_difference": first,
                             "left_input_ids": la, "right_input_ids": lb,
                             "input_ids_sha256": _lr(a["input_ids_sha256"], b["input_ids_sha256"])})
        ev.update({"prompts_with_different_input_ids": len(differ), "prompts_checked": len(pairs), "examples": examples})
    if left.run_config is not None and right.run_config is not None:
        lm, rm = left.run_config["model"], right.run_config["model"]
        comparable = left.run_config["config"]["backend"] == right.run_config["config"]["backend"] and lm["format"] == rm["format"]
        if lm["tokenizer_sha256"] != rm["tokenizer_sha256"] and (comparable or differ):
            ev["tokenizer_sha256"] = _lr(lm["tokenizer_sha256"], rm["tokenizer_sha256"])
            if not differ:
                ev.update({"prompts_with_different_input_ids": 0, "prompts_checked": len(pairs)})
    return ev or None


def _prompts(left: Side, right: Side, comp: dict[str, Any]) -> dict[str, Any] | None:
    lo, ro = comp["unmatched"]["left_only"], comp["unmatched"]["right_only"]
    if not lo and not ro:
        return None

    def describe(side: Side, indexes: list[int]) -> list[dict[str, Any]]:
        by_index = {r["prompt_index"]: r for r in side.records or ()}
        out = []
        for i in indexes[:_CAP]:
            r = by_index.get(i, {})
            text = r.get("prompt_text")
            out.append({"prompt_index": i, "prompt_id": r.get("prompt_id"), "prompt_text": text[:120] if text else None})
        return out

    ev: dict[str, Any] = {"left_only": describe(left, lo), "right_only": describe(right, ro),
                          "left_only_count": len(lo), "right_only_count": len(ro)}
    if left.run_config is not None and right.run_config is not None:
        ev["prompt_sets"] = _lr(left.run_config["prompts"], right.run_config["prompts"])
    return ev


def _config(left: Side, right: Side) -> dict[str, Any] | None:
    lc, rc = ({k: v for k, v in s.run_config["config"].items() if k not in _NOT_CONFIG} for s in (left, right))
    fields = flat_diff(lc, rc, "config")
    applied: list[dict[str, Any]] = []
    if left.run_config["config"]["backend"] == right.run_config["config"]["backend"]:
        # typed options with defaults filled in; another engine's options are not comparable
        fields += flat_diff(left.run_config["backend_options"], right.run_config["backend_options"], "backend_options")
        if left.applied is not None and right.applied is not None:
            la, ra = ({s["name"]: {"applied": s["applied"], "value": s["value"]} for s in a["settings"]}
                      for a in (left.applied, right.applied))
            applied = flat_diff({"tier_effective": left.applied["tier_effective"], "settings": la},
                                {"tier_effective": right.applied["tier_effective"], "settings": ra}, "applied")
    if not fields and not applied:
        return None
    return {"fields": _cut(fields), "applied": _cut(applied), "count": len(fields) + len(applied)}


def _backend(left: Side, right: Side) -> dict[str, Any] | None:
    ln, rn = left.run_config["config"]["backend"], right.run_config["config"]["backend"]
    lb, rb = left.env.get("backend") or {}, right.env.get("backend") or {}
    # settings the run config already records, and paths whose content hash agrees
    skip = {"device", "dtype"} | set(left.run_config["backend_options"]) | set(right.run_config["backend_options"])
    skip |= {k for k in lb if f"{k}_sha256" in lb and lb.get(f"{k}_sha256") == rb.get(f"{k}_sha256")}
    engine = flat_diff({k: v for k, v in lb.items() if k not in skip}, {k: v for k, v in rb.items() if k not in skip}, "backend")
    if ln == rn and not engine:
        return None
    ev: dict[str, Any] = {"backend": _lr(ln, rn), "engine": _cut(engine)}
    return ev


def _env(left: Side, right: Side) -> dict[str, Any] | None:
    ignore = set(VOLATILE_KEYS) | {"backend"}  # the engine's own report is BACKEND_MISMATCH's
    if left.env.get("torch") is None or right.env.get("torch") is None:
        ignore.add("torch")  # a side whose engine never loaded torch (llama.cpp) has no torch facts to compare
    fields = flat_diff({k: v for k, v in left.env.items() if k not in ignore},
                       {k: v for k, v in right.env.items() if k not in ignore})
    if "torch" in ignore:
        fields = [f for f in fields if not f["field"].startswith("threads.torch_")]
    if not fields:
        return None
    return {"differences": _cut(fields, 40), "count": len(fields),
            "fingerprint": _lr(left.env["fingerprint"], right.env["fingerprint"])}


def _batch_mates(records: list[dict[str, Any]]) -> dict[tuple[str, int], tuple[int, frozenset[str]]]:
    """(prompt_id, occurrence) -> (batch position, ids of the prompts sharing its batch),
    with the runner's batching: consecutive prompt indexes, batch_size at a time."""
    groups: dict[int, set[str]] = defaultdict(set)
    for r in records:
        groups[r["prompt_index"] // r["batch_size"]].add(r["prompt_id"])
    seen: dict[str, int] = defaultdict(int)
    out = {}
    for r in sorted(records, key=lambda r: r["prompt_index"]):
        out[(r["prompt_id"], seen[r["prompt_id"]])] = (r["batch_position"], frozenset(groups[r["prompt_index"] // r["batch_size"]]))
        seen[r["prompt_id"]] += 1
    return out


def _batch(left: Side, right: Side) -> dict[str, Any] | None:
    changed = None
    if left.records is not None and right.records is not None:
        lm, rm = _batch_mates(left.records), _batch_mates(right.records)
        changed = sum(1 for k in lm if k in rm and lm[k] != rm[k])
    if left.batch_size == right.batch_size and not changed:
        return None
    ev: dict[str, Any] = {"batch_size": _lr(left.batch_size, right.batch_size),
                          "batch_sizes": sorted({left.batch_size, right.batch_size})}
    if changed is not None:
        ev["composition_changed"] = changed  # aligned prompts whose batch position or batch mates differ
    return ev


def differences(left: Side, right: Side, comp: dict[str, Any]) -> list[dict[str, Any]]:
    """Every recorded difference between two sides, as ranked {code, evidence}."""
    pairs = align(left.records, right.records)[0] if left.records is not None and right.records is not None else []
    full = all(s.run_config is not None and s.env is not None for s in (left, right))
    found = [
        ("MODEL_MISMATCH", _model(left, right) if full else None),
        ("TOKENIZER_MISMATCH", _tokenizer(left, right, pairs)),
        ("PROMPT_MISMATCH", _prompts(left, right, comp)),
        ("CONFIG_MISMATCH", _config(left, right) if full else None),
        ("BACKEND_MISMATCH", _backend(left, right) if full else None),
        ("ENV_MISMATCH", _env(left, right) if full else None),
        ("BATCH_VARIANCE", _batch(left, right)),
    ]
    return rank([{"code": code, "evidence": ev} for code, ev in found if ev is not None])


def rank(causes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def key(c: dict[str, Any]) -> float:
        r = float(RANK.index(c["code"]))
        return RANK.index("BACKEND_MISMATCH") + 0.5 if c["code"] == "MODEL_MISMATCH" and c["evidence"].get("converted") else r
    return sorted(causes, key=key)


def _divergence_summary(comp: dict[str, Any]) -> dict[str, Any]:
    d = comp["first_divergence"]
    return {
        "prompts_diverged": comp["prompts_diverged"],
        "first": None if d is None else {"prompt_index": d["prompt_index"], "token_index": d["token_index"],
                                         "kind": d["kind"], "near_tie": d["near_tie"]},
    }


def explain(comp: dict[str, Any], left: Side, right: Side) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(causes, info) of one comparison. A failing comparison's causes are the recorded
    differences, ranked, or RUN_VARIANCE when there are none. When the outputs agree
    (or differ where the tier does not require agreement) the differences are info."""
    found = differences(left, right, comp)
    for c in found:
        c["evidence"] = {"comparisons": [comp["name"]], **c["evidence"]}
    if comp["status"] == "PASS":
        return [], found
    if not found:
        found = [{"code": "RUN_VARIANCE", "evidence": {
            "comparisons": [comp["name"]],
            "recorded_differences": "none: model, tokenizer, prompts, config, backend, environment and batch agree",
        }}]
    for c in found:
        if c["code"] in ("RUN_VARIANCE", "BATCH_VARIANCE"):
            c["evidence"].update(_divergence_summary(comp))
    return (found, []) if comp["status"] == "FAIL" else ([], found)


def merge(causes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Causes of several comparisons, one per code: comparisons listed, counts summed."""
    by_code: dict[str, dict[str, Any]] = {}
    for c in causes:
        have = by_code.get(c["code"])
        if have is None:
            by_code[c["code"]] = {"code": c["code"], "evidence": dict(c["evidence"])}
            continue
        ev, new = have["evidence"], c["evidence"]
        ev["comparisons"] = ev.get("comparisons", []) + [n for n in new.get("comparisons", []) if n not in ev.get("comparisons", [])]
        if "prompts_diverged" in new:
            ev["prompts_diverged"] = ev.get("prompts_diverged", 0) + new["prompts_diverged"]
        if "batch_sizes" in new:
            ev["batch_sizes"] = sorted(set(ev.get("batch_sizes", [])) | set(new["batch_sizes"]))
    return rank(list(by_code.values()))
