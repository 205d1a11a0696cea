"""The run folder's versioning rule, and what changed between versions.

Owns the answer to "can a field written by detllm version X be compared with the same
field written by version Y?". Does not own the schemas (schemas/, schemas/v<N>/) or
loading (artifacts.py); diff, report, verify and replay consult this table.

The rule (docs/artifacts.md#versions):
- `schema_version` is one number for the whole run folder. It is bumped whenever what a
  reader takes from a field would change: a field's meaning (a seed rule, what a hash
  covers, what an option means), a value an older reader of the same version would
  misread (a null, a string where ids were), or a field renamed or removed. Only an
  optional field whose absence keeps every old meaning is added without a bump. Nothing
  changes meaning within a version.
- Every version this detllm has ever written stays readable: its schemas are frozen in
  schemas/v<N>/ and each file is validated against the schemas of its own version;
  verify checks each folder by its own version's rule (the chain it names).
- A diff across versions compares only what both sides recorded with the same meaning.
  A field listed in REDEFINED for the step between the two versions is never used as a
  cause; the report names it under `not_compared` instead.
"""

from __future__ import annotations

from dataclasses import dataclass

CURRENT = "5"
READABLE = ("1", "2", "3", "4", "5")


@dataclass(frozen=True)
class Change:
    field: str  # dotted path in the artifact named first, e.g. "run_config.config.logprobs"
    what: str  # what changed, in plain words
    since: str  # the first schema_version with the new meaning
    was: tuple[str, ...] = ()  # the field's dotted name(s) before `since`, when it was renamed


# Field meanings that changed, per version step. diff/replay across the step must not
# compare these as if they meant the same thing on both sides.
REDEFINED: tuple[Change, ...] = (
    Change("run_config.config.logprobs", "named logprobs_top_k in version 1 (the number of (id, logprob) pairs "
           "recorded per step); --top-k now means the sampling filter, as in transformers, vLLM and llama.cpp", "2",
           was=("run_config.config.logprobs_top_k",)),
    Change("run_config.config.seed", "per-request seeds were derived from the prompt's position in version 1; from "
           "version 2 on from its content (prompt id and occurrence): sampled tokens across the step are not comparable", "2"),
    Change("run_config.model.config_sha256", "version 1 hashed config.json and generation_config.json byte for byte; "
           "version 2 hashes the fields that change the computation (a re-save that only changes transformers_version "
           "keeps it; the byte hash is config_files_sha256)", "2"),
    Change("run_config.model.tokenizer_sha256", "version 2 leaves the chat template out (no template is applied to "
           "prompts; it is hashed apart as chat_template_sha256)", "2"),
    Change("report.first_divergence.near_tie", "version 1: a side's top-1 minus top-2 margin was below the noise floor; "
           "version 2: magnitude.label is tie_flip (both sides' gaps between the two competing tokens are below it)", "2"),
    Change("run_config.model.config_sha256", "version 3 also leaves out _from_model_config (written by a re-save, "
           "not a computation) and hashes torch_dtype under its new name dtype", "3"),
    Change("report.sensitivity.max_abs_logprob_diff", "version 3: null means no comparison compared logprobs, 0 means "
           "compared and equal; a version-2 0 may mean either (the null came within version 2, breaking the rule)", "3"),
    Change("report.causes", "version 3: RUN_VARIANCE only when every per-record fact that can change the computation "
           "agrees (cached prompt tokens: CACHE_VARIANCE; the server's batch: BATCH_VARIANCE; a fresh process: "
           "PROCESS_VARIANCE, new); a cause that cannot produce the divergence seen ranks below every one that can "
           "(evidence.cannot_explain)", "3"),
    Change("report.first_divergence.magnitude.label", "version 3: a logprob divergence after which one side stops "
           "earlier is length at every tier; version 2 called it tokens_equal_logprobs_differ at tier 2 and above", "3"),
    Change("report.status", "version 4: a check PASSes only where every varied axis was shown engaged (or, where the "
           "engine reveals nothing, marked engagement not observable); a comparison whose axis was shown not engaged "
           "(one busy slot for a group of 8) makes the check UNVERIFIED, a new value (strict: exit 3 after sealing). "
           "A version-3 PASS may rest on an axis that never engaged", "4"),
)


# Meanings of diagnose's and sweep's conclusions (diagnosis.json, sweep.json) that changed. No diff,
# verify or replay reads these files across versions; listed so a reader of an old one reads it right.
CONCLUDED: tuple[Change, ...] = (
    Change("diagnosis.passing_settings", "version 3: a setting whose probe diverged nowhere and that passed every one "
           "of the --fresh-repeats fresh-process checks (else listed as failed or unconfirmed); version 2 could name "
           "a setting that failed some, or whose probe still diverged elsewhere (isolated likewise)", "3"),
    Change("diagnosis.baseline.max_abs_logprob_diff", "version 3: the largest |dlogprob| of the comparisons that diverged "
           "(each probe's evidence likewise; the drift of comparisons the tier accepts is passing_max_abs_logprob_diff); "
           "version 2 took it over every comparison, a passing batch comparison's drift included", "3"),
    Change("sweep.reference_cell", "version 3: the first cell that ran (null when none did); version 2 named the first "
           "cell even when it errored and the rates were measured against another", "3"),
    Change("sweep.cells.prompt_wilson_95", "version 3: the Wilson interval over prompts, the independent unit; version 2's "
           "wilson_95 counted prompts x repeats as independent trials (too narrow by about the square root of the "
           "repeats)", "3", was=("sweep.cells.wilson_95",)),
    # training conclusions (train_report.json, train_replay.json, train_diff.json); verify re-derives a
    # version-3 train_report by either rule
    Change("train_report.first_divergence.cause", "version 4 adds `unseeded`: the same seed, RNG state and batch, and the "
           "loss or gradient norm moved by 1000 or more roundings of the training dtype (|Δ|/|x|/ε), an unseeded random "
           "source or data-dependent code; `numerics` is left for smaller changes and its detail gives |Δloss|, "
           "|Δgrad_norm| and the roundings. Version 3 called both numerics", "4"),
    Change("train_report.first_divergence.where", "version 4: a difference in a figure recorded of a gradient (grad_l2, "
           "grad_max_abs, grad_norm) is `grad`, of a value (value_l2, value_max_abs) `value`, with that parameter; "
           "version 3 looked at the digests only", "4"),
    Change("train_replay.verdict", "version 4: PASS also needs every re-computed field of every re-run record equal "
           "(records_equal) and each segment to end on the RNG, optimizer and parameter state of the checkpoint at its "
           "stop boundary (end_state); a sampled segment from boundary 0 runs from genesis. Version 3 compared h_t only", "4"),
    Change("train_diff.verdict", "version 4: PASS when the two reference runs are bitwise equal at every step even where "
           "train_config.json differs (config_differs names the keys); version 3 failed on any configuration "
           "difference, H(config) in the genesis differing", "4"),
    Change("fleet.prompts.outliers", "version 4 (issue 31, C6): a prompt's majority is taken over the replicas that have "
           "the prompt and a replica without it is listed in `missing` only; version 3 counted it against every group "
           "and listed it as an outlier (so a 2-of-3 majority read NO_MAJORITY)", "4"),
    Change("locate.graft.into_right.outcome", "version 5 (issue 33): confirmed also when the logits still differ but "
           "the first divergent token no longer diverges (confirmed_by token) or, for a graft through cached K/V, when the "
           "grafted re-run's token and logprob at the step where the traces differ are the other side's bitwise "
           "(confirmed_by later_step); version 4 said confirmed only for bitwise-equal logits at the captured step", "5"),
    Change("locate.graft.into_left.outcome", "version 5: as into_right.outcome (confirmed_by)", "5"),
    Change("fleet.category", "version 4 (issue 31): MISSING_PROMPTS (the replicas agree where they overlap, some lack "
           "prompts) is new; every pair is compared at one tier chosen before grouping and a group's members all equal "
           "each other (`grouping`), where version 3 compared each pair at its own tier and a replica with a group's "
           "first member only, so its groups and category could depend on the order of the sides", "4"),
)


# What a seal covers, per version: verify checks each folder by the chain its manifest names
# (integrity.py), so no diff or replay reads these; listed for readers of old folders.
SEALED: tuple[Change, ...] = (
    Change("manifest.trace.genesis", "version 3 (chain detllm-trace-chain/2) binds determinism_applied.json too, every "
           "input verify's re-derivation reads (the effective tier, the applied settings); versions 1-2 (chain /1) bound "
           "run_config.json and env.json only, and their verdicts are not re-derived", "3"),
    Change("train_config.chain", "version 5 (issue 36): a training pack names its chain version; detllm-train/2 hashes "
           "each tensor's P by BLAKE3, so every value_sha256 / grad_sha256 of steps.jsonl, the params_sha256 and "
           "grads_sha256 over them, h_t and checkpoint.json's params_sha256 differ from detllm-train/1's (SHA-256), "
           "which is what a pack naming no chain is (every version-4 pack). verify and replay read each pack by the "
           "chain it names; diff refuses two packs of different chains", "5"),
)


# Fields that gained new values while every old value keeps its meaning: compared across versions
# as before, listed so readers of old folders know what a folder may hold. Since version 3 a new
# value comes with a bump (both below came within version 2, against the rule).
EXTENDED: tuple[Change, ...] = (
    Change("run_config.model.weights_sha256", "may be null, with model.remote saying why (backend openai: weights not "
           "hashed, remote); two nulls are unknown, never equal; the trace chain's genesis then takes integrity.UNHASHED "
           "in place of the digest (tokenizer_sha256 likewise)", "2"),
    Change("trace_record.token_ids", "may hold token strings (a served model that gives no ids; evidence.tokens_as says "
           "which), top_logprobs pairs [token string, logprob]; a record may carry an evidence object. Came within "
           "version 2, against the rule (an early version-2 reader takes every element for an id); a version-3 reader "
           "reads evidence.tokens_as in either version", "2"),
    Change("train_report.verdict", "may be RECORDED, with command train-run and runs holding run 0 alone and no "
           "comparison: one training run recorded to be compared with another pack by diff; never PASS, since nothing "
           "was compared (a version-3 reader knows only PASS and FAIL, and at least 2 runs)", "4"),
)


def verdict_rule_versions() -> frozenset[str]:
    """The versions whose fields all mean what this version's do (no REDEFINED change since): verify
    re-derives a check's verdict only for these (version 5 changed training and locate conclusions, not
    the check's)."""
    since = max(int(c.since) for c in REDEFINED)
    return frozenset(v for v in READABLE if int(v) >= since)


def changes_between(left: str, right: str) -> list[Change]:
    """Every redefinition that lies between two schema versions (either order)."""
    lo, hi = sorted((int(left), int(right)))
    return [c for c in REDEFINED if lo < int(c.since) <= hi]


def redefined_prefixes(left: str, right: str) -> tuple[str, ...]:
    """Dotted field prefixes that must not be compared across these two versions."""
    return tuple(c.field for c in changes_between(left, right))


def is_redefined(field: str, left: str, right: str) -> bool:
    """True when `field` (dotted, artifact first) changed meaning between the two versions."""
    names = redefined_prefixes(left, right) + tuple(w for c in changes_between(left, right) for w in c.was)
    return any(field == p or field.startswith(p + ".") or field.startswith(p + "[") for p in names)


__all__ = ["CONCLUDED", "CURRENT", "Change", "EXTENDED", "READABLE", "REDEFINED", "SEALED", "changes_between", "is_redefined", "redefined_prefixes",
           "verdict_rule_versions"]
