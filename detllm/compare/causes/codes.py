"""The cause codes: their rank (most fundamental first), title and advice, and the two ways
causes are put in order: `rank` and `merge` (one cause per code over several comparisons).
Finds no cause: the detectors do (inputs, config, environment, variance), run by classifier.
"""

from __future__ import annotations

from typing import Any

# Most fundamental first: a different model, tokenizer or prompt set makes different
# output expected; config changes the computation asked for; backend and environment
# change the kernels that compute it; run and batch variance are left when nothing
# else was recorded differently. They meet only in `check`, where runs that vary at a
# fixed batch size also explain the batch comparisons, so RUN_VARIANCE comes first. A
# model difference that is only a format conversion (safetensors vs GGUF never hash
# alike) ranks just after BACKEND_MISMATCH. A cache or process difference is recorded per record:
# variance in one process at one cache state explains those comparisons too, so they come last.
RANK = ("MODEL_MISMATCH", "TOKENIZER_MISMATCH", "PROMPT_MISMATCH", "CONFIG_MISMATCH", "BACKEND_MISMATCH",
        "ENV_MISMATCH", "RUN_VARIANCE", "BATCH_VARIANCE", "CACHE_VARIANCE", "PROCESS_VARIANCE")
TITLES = {
    "MODEL_MISMATCH": "the model weights (or its config) differ",
    "TOKENIZER_MISMATCH": "the tokenizer differs",
    "PROMPT_MISMATCH": "the prompt sets differ",
    "CONFIG_MISMATCH": "the run configuration differs",
    "BACKEND_MISMATCH": "the inference engine differs",
    "ENV_MISMATCH": "the environment differs",
    "BATCH_VARIANCE": "only the batch size or composition differs",
    "RUN_VARIANCE": "nothing recorded differs, yet the outputs do",
    "CACHE_VARIANCE": "only the server's prefix cache differs: cold and warm answers disagree",
    "PROCESS_VARIANCE": "only the process differs: a fresh process computes differently from the check's own",
}
ADVICE = {
    "MODEL_MISMATCH": "compare against a run of the same weights (see evidence.files), or re-run both sides with one model folder",
    "TOKENIZER_MISMATCH": "use the same tokenizer files on both sides; evidence.examples shows the input ids that differ",
    "PROMPT_MISMATCH": "run both sides on the same prompt file; the prompts listed were compared with nothing",
    "CONFIG_MISMATCH": "re-run one side with the other's settings (evidence.fields) to see whether the difference follows them",
    "BACKEND_MISMATCH": "different engines or builds run different kernels; pin one engine version, or accept tier 1 across engines",
    "ENV_MISMATCH": "pin the libraries, drivers and thread settings listed in evidence.differences, or re-run on one machine",
    "BATCH_VARIANCE": "the kernels are not batch invariant: fix the batch size, or use an engine/tier that enforces batch invariance",
    "RUN_VARIANCE": "the engine is nondeterministic at this setting: set --threads, or look for atomics/async kernels",
    "CACHE_VARIANCE": "a reused prefix is computed differently from a fresh one: turn prefix caching off (llama-server: "
                      "--opt cache_prompt=false, its per-request cache_prompt:false; vLLM: --no-enable-prefix-caching) or accept tier 1",
    "PROCESS_VARIANCE": "state fixed per process changed the result (engine load, kernel autotuning, thread pool): pin "
                        "the threads and kernels, or compare repeats within one process only",
}


def rank(causes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Causes that can produce the divergence seen first (those with evidence.cannot_explain after
    every one of them, explains.py), each group in RANK order; a model difference that is only a
    format conversion just after BACKEND_MISMATCH."""

    def key(c: dict[str, Any]) -> tuple[bool, float]:
        r = float(RANK.index(c["code"]))
        r = RANK.index("BACKEND_MISMATCH") + 0.5 if c["code"] == "MODEL_MISMATCH" and c["evidence"].get("converted") else r
        return "cannot_explain" in c["evidence"], r
    return sorted(causes, key=key)


def merge(causes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Causes of several comparisons, one per code: comparisons listed, counts summed."""
    by_code: dict[str, dict[str, Any]] = {}
    for c in causes:
        have = by_code.get(c["code"])
        if have is None:
            by_code[c["code"]] = {"code": c["code"], "evidence": dict(c["evidence"])}
            continue
        ev, new = have["evidence"], c["evidence"]
        if "cannot_explain" not in new:
            ev.pop("cannot_explain", None)  # it explains at least one of its comparisons
        ev["comparisons"] = ev.get("comparisons", []) + [n for n in new.get("comparisons", []) if n not in ev.get("comparisons", [])]
        if "prompts_diverged" in new:
            ev["prompts_diverged"] = ev.get("prompts_diverged", 0) + new["prompts_diverged"]
        merge_batch_sizes(ev, new)
        if "composition_changed" in new:
            ev["composition_changed"] = max(ev.get("composition_changed", 0), new["composition_changed"])
        if "sides" in new:  # CACHE_VARIANCE: every run's cache state, not only the first comparison's
            ev["sides"] = {**ev.get("sides", {}), **new["sides"]}
    return rank(list(by_code.values()))


def merge_batch_sizes(ev: dict[str, Any], new: dict[str, Any]) -> None:
    """Fold `new` evidence's batch sizes into `ev`: every size in `batch_sizes`, and `batch_size`
    (one left/right pair) dropped once the two name different pairs."""
    if "batch_sizes" in new:
        ev["batch_sizes"] = sorted(set(ev.get("batch_sizes", [])) | set(new["batch_sizes"]))
        if ev.get("batch_size") not in (None, new.get("batch_size")):
            del ev["batch_size"]  # one left/right pair no longer describes every comparison: batch_sizes does
