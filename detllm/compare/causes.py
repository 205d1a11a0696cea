"""Why two selections of trace records differ: every recorded difference as a cause
with its evidence, ranked.

One implementation for `check` (selections of one folder) and `diff` (two folders).
A `Side` is what was recorded for one selection; `differences` finds what differs
between two sides; `explain` makes those the ranked causes of a failing comparison,
or information when the outputs agree. Reads artifacts only; docs/causes.md says what
each code means and what to do next.

Each recorded difference is routed by what it is, not by which file holds it: what the
user requested is CONFIG; what the machine or the engine chose where nothing was
requested (threads in effect, dtype "auto" resolved, hardware, kernel paths) is ENV;
what follows from the batch sizes (llama.cpp slots, vLLM max_num_seqs) is batch
evidence; what never changes the computation (tier, mode, ports, timeouts) and fields
recorded with different meanings by two schema versions are never causes (`Notes`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .. import versions
from ..env import HARDWARE_KEYS, KERNEL_ENV_PREFIXES, VOLATILE_KEYS
from .divergence import FLOAT_GGUF
from .engine import align

# Most fundamental first: a different model, tokenizer or prompt set makes different
# output expected; config changes the computation asked for; backend and environment
# change the kernels that compute it; run and batch variance are left when nothing
# else was recorded differently. They meet only in `check`, where runs that vary at a
# fixed batch size also explain the batch comparisons, so RUN_VARIANCE comes first. A
# model difference that is only a format conversion (safetensors vs GGUF never hash
# alike) ranks just after BACKEND_MISMATCH.
RANK = ("MODEL_MISMATCH", "TOKENIZER_MISMATCH", "PROMPT_MISMATCH", "CONFIG_MISMATCH", "BACKEND_MISMATCH",
        "ENV_MISMATCH", "RUN_VARIANCE", "BATCH_VARIANCE", "CACHE_VARIANCE")
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
    "CACHE_VARIANCE": "a reused prefix is computed differently from a fresh one: turn prefix caching off on the server "
                      "(llama-server cache_prompt:false, vLLM --no-enable-prefix-caching) or accept tier 1",
}
# run_config.config fields judged elsewhere or not about generation
_NOT_CONFIG = ("backend", "model", "revision", "batch_size", "vary_batch", "runs", "atol", "record_prompt_text", "options",
               "dtype", "fresh_process")
# recorded settings that never change the computation: listed in report.inert_differences, never a cause
INERT_CONFIG = {
    "tier": "the tier selects checks and settings; the settings it applied are compared one by one (determinism_applied)",
    "mode": "strict or best-effort decides whether a run is refused, not how it computes",
}
INERT_OPTIONS = {
    "port": "the loopback port a server listens on",
    "startup_timeout": "how long detllm waits for the server",
    "request_timeout": "how long detllm waits for a request",
    "bin": "the binary's path; its build is compared by content (env.json backend.binary_sha256)",
    "gpu_memory_utilization": "how much GPU memory vLLM may reserve, not how it computes",
    "api_key_env": "the name of the variable holding an API key",
    "connect_timeout": "how long detllm waits for a connection",
    "retries": "how often a request the server did not take is resent (each record counts its retries)",
    "sample_interval": "how often detllm asks the server about its batch",
}
# settings whose value follows the run's largest batch unless the user set them
BATCH_DERIVED = ("slots", "max_num_seqs")
# engines whose computation depends on how many (id, logprob) pairs are asked for: llama.cpp
# sorts and softmaxes n_probs candidates itself, so their number changes the sum order
LOGPROBS_COUNT_MATTERS = ("llamacpp",)
# llama-server argv flags that mirror a recorded setting or identity (compared there) or a port
_ARGV_MIRRORED = {"-m", "--host", "--port", "-np", "-c", "-t", "-tb", "-b", "-ub", "-fa", "-ctk", "-ctv", "--device",
                  "-ngl", "--cache-ram", "-sps"}
# engine-report keys that follow the batch size or mirror recorded settings (llama-server /props)
_ENGINE_MIRRORED = {"n_ctx", "total_slots", "argv"}
_CAP = 20  # evidence lists keep this many entries; a count says how many there were
_ABSENT = "<absent>"
_STAMPS = ("schema_version", "artifact_type")


@dataclass
class Notes:
    """What a comparison of two folders could not compare, and differences that are never
    causes. Filled while the detectors run; diff puts both in report.json."""

    versions: tuple[str, str] = ("2", "2")
    not_compared: list[dict[str, Any]] = field(default_factory=list)
    inert: list[dict[str, Any]] = field(default_factory=list)

    def skip(self, name: str, reason: str) -> None:
        if all(n["field"] != name for n in self.not_compared):
            self.not_compared.append({"field": name, "reason": reason})

    def note(self, d: dict[str, Any], why: str) -> None:
        if all(n["field"] != d["field"] for n in self.inert):
            self.inert.append({"field": d["field"], "left": d["left"], "right": d["right"], "why": why})

    def screen(self, diffs: list[dict[str, Any]], artifact: str) -> list[dict[str, Any]]:
        """Differences both sides recorded with the same meaning. Dropped: stamps; across
        schema versions, fields redefined between them (versions.REDEFINED) and fields one
        version does not record; each dropped field is listed in not_compared."""
        lv, rv = self.versions
        out = []
        for d in diffs:
            if d["field"] in _STAMPS:
                continue
            full = f"{artifact}.{d['field']}"
            if lv != rv:
                change = next((c for c in versions.changes_between(lv, rv) if _under(full, c.field)
                               or any(_under(full, w) for w in getattr(c, "was", ()) or ())), None)
                if change is not None:
                    self.skip(change.field, f"redefined in version {change.since}: {change.what}")
                    continue
                if _ABSENT in (d["left"], d["right"]):
                    have = lv if d["right"] == _ABSENT else rv
                    self.skip(full, f"recorded by version {have} only")
                    continue
            out.append(d)
        return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".") or name.startswith(prefix + "[")


def schema_versions(left: "Side", right: "Side") -> tuple[str, str]:
    return tuple(str((s.run_config or {}).get("schema_version", versions.CURRENT)) for s in (left, right))  # type: ignore[return-value]


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


def _model(left: Side, right: Side, notes: Notes) -> dict[str, Any] | None:
    lm, rm = left.run_config["model"], right.run_config["model"]
    if lm["weights_sha256"] is None or rm["weights_sha256"] is None:  # a served model's weights: unknown, never equal or different
        notes.skip("run_config.model.weights_sha256", "unknown, neither equal nor different: "
                   + "; ".join(m.get("remote") or "not hashed" for m in (lm, rm) if m["weights_sha256"] is None))
        return None
    lc, rc = lm.get("config_sha256"), rm.get("config_sha256")
    config_differs = lc is not None and rc is not None and lc != rc
    if config_differs and notes.screen([{"field": "model.config_sha256", "left": lc, "right": rc}], "run_config") == []:
        config_differs = False  # hashed differently by the two versions: not compared
    lf, rf = lm.get("config_files_sha256"), rm.get("config_files_sha256")
    if not config_differs and lc is not None and lc == rc and lf and rf and lf != rf:
        notes.note({"field": "run_config.model.config_files_sha256", "left": lf, "right": rf},
                   "config.json/generation_config.json differ only in fields that do not change the computation "
                   "(a version stamp, a name): config_sha256, over the fields that do, agrees")
    lt, rt = lm.get("chat_template_sha256"), rm.get("chat_template_sha256")
    if lt != rt:
        notes.note({"field": "run_config.model.chat_template_sha256", "left": lt, "right": rt},
                   "no chat template is applied: the prompts are tokenized as given")
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


def _tokenizer(left: Side, right: Side, pairs: list[tuple[dict, dict]], notes: Notes) -> dict[str, Any] | None:
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
        hashes = notes.screen([{"field": "model.tokenizer_sha256", "left": lm["tokenizer_sha256"], "right": rm["tokenizer_sha256"]}],
                              "run_config")
        if None in (lm["tokenizer_sha256"], rm["tokenizer_sha256"]):  # a served model's tokenizer: unknown
            notes.skip("run_config.model.tokenizer_sha256", "unknown, neither equal nor different: not hashed (remote)")
            hashes = []
        if hashes and hashes[0]["left"] != hashes[0]["right"] and (comparable or differ):
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


@dataclass
class _Routed:
    """Differences found outside their own detector, by where they belong."""

    machine: list[dict[str, Any]] = field(default_factory=list)  # ENV: chosen by the machine or engine
    batch: list[dict[str, Any]] = field(default_factory=list)  # BATCH: follows the batch sizes
    dtype: dict[str, Any] | None = None  # the dtype in effect differs: {left, right, requested}


def _settings(applied: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in (applied or {}).get("settings", ())}


def _origin(setting: dict[str, Any], user_keys: set[str]) -> str:
    """Who chose a setting's value: "user" (requested), "batch" (follows the batch sizes) or
    "machine" (nothing was requested: the machine or engine chose it)."""
    by = setting.get("chosen_by")
    if by:
        return by
    if setting["name"] in user_keys:
        return "user"
    if setting["name"] in BATCH_DERIVED:
        return "batch"
    return "machine" if setting.get("requested") in (None, "auto") else "user"


def dtype_in_effect(side: Side) -> str | None:
    """The dtype a side computed in (a float GGUF's F32 spelled float32, so engines compare)."""
    value = _settings(side.applied).get("dtype", {}).get("value")
    value = value if isinstance(value, str) and value else (side.run_config or {}).get("config", {}).get("dtype")
    return FLOAT_GGUF.get(value.upper(), value) if isinstance(value, str) else value


def _config(left: Side, right: Side, notes: Notes, routed: _Routed) -> dict[str, Any] | None:
    """What the user requested: run_config.config, the backend options the user set, and
    the determinism settings whose value the user asked for (requested vs in effect)."""
    lcfg, rcfg = left.run_config["config"], right.run_config["config"]
    backends = {lcfg["backend"], rcfg["backend"]}
    la, ra = _settings(left.applied), _settings(right.applied)
    fields = []
    for d in notes.screen(flat_diff(*({k: v for k, v in c.items() if k not in _NOT_CONFIG} for c in (lcfg, rcfg)), "config"),
                          "run_config"):
        key = d["field"].split(".")[1]
        full = {**d, "field": "run_config." + d["field"]}
        if key in INERT_CONFIG:
            notes.note(full, INERT_CONFIG[key])
        elif key == "logprobs" and not backends & set(LOGPROBS_COUNT_MATTERS):
            notes.note(full, "how many (id, logprob) pairs are recorded does not change this engine's computation; "
                             "top-k lists are compared over the common top-min(k)")
        elif key in la and key in ra and la[key].get("value") == ra[key].get("value") and la[key].get("applied") == ra[key].get("applied"):
            notes.note(full, f"requested differently, but the same {key} was in effect on both sides")
        else:
            fields.append(d)
    # the dtype: compared in effect, on every backend; requested differently -> CONFIG
    ld, rd = dtype_in_effect(left), dtype_in_effect(right)
    if ld != rd:
        routed.dtype = {"left": ld, "right": rd, "requested": _lr(lcfg.get("dtype"), rcfg.get("dtype"))}
        if lcfg.get("dtype") != rcfg.get("dtype"):
            fields.append({"field": "config.dtype", "left": lcfg.get("dtype"), "right": rcfg.get("dtype")})
    elif lcfg.get("dtype") != rcfg.get("dtype"):
        notes.note({"field": "run_config.config.dtype", "left": lcfg.get("dtype"), "right": rcfg.get("dtype")},
                   f"requested differently, but both ran in {ld}")
    applied: list[dict[str, Any]] = []
    if lcfg["backend"] == rcfg["backend"]:
        user_keys = set(lcfg.get("options") or {}) | set(rcfg.get("options") or {})
        for d in notes.screen(flat_diff(left.run_config["backend_options"], right.run_config["backend_options"], "backend_options"),
                              "run_config"):
            key = d["field"].split(".")[1]
            if key in INERT_OPTIONS:
                notes.note({**d, "field": "run_config." + d["field"]}, INERT_OPTIONS[key])
            elif key in user_keys:
                fields.append(d)
            elif key in BATCH_DERIVED:
                routed.batch.append(d)
            else:
                routed.machine.append({**d, "field": "run_config." + d["field"] + " (default)"})
        for name in sorted(set(la) | set(ra)):
            a, b = la.get(name), ra.get(name)
            if name == "dtype" or (a and b and a.get("applied") == b.get("applied") and a.get("value") == b.get("value")):
                continue
            diffs = notes.screen(flat_diff(*({"applied": s.get("applied"), "value": s.get("value")} if s else _ABSENT for s in (a, b)),
                                           f"settings.{name}"), "determinism_applied")
            origin = _origin(a or b, user_keys)
            if name in INERT_OPTIONS:
                for d in diffs:
                    notes.note({**d, "field": "determinism_applied." + d["field"]}, INERT_OPTIONS[name])
            elif origin == "user":
                applied += diffs
            elif origin == "batch":
                routed.batch += diffs
            else:
                routed.machine += [{**d, "field": "determinism_applied." + d["field"] + " (chosen by the machine)"} for d in diffs]
        te = (left.applied or {}).get("tier_effective"), (right.applied or {}).get("tier_effective")
        if te[0] != te[1]:
            notes.note({"field": "determinism_applied.tier_effective", "left": te[0], "right": te[1]}, INERT_CONFIG["tier"])
    if not fields and not applied:
        return None
    ev: dict[str, Any] = {"fields": _cut(fields), "applied": _cut(applied), "count": len(fields) + len(applied)}
    if routed.dtype is not None and lcfg.get("dtype") != rcfg.get("dtype"):
        ev["dtype_in_effect"] = _lr(ld, rd)
    return ev


def _argv_flags(argv: Any) -> dict[str, Any]:
    """llama-server argv as {flag: value} (a flag without a value maps to True)."""
    out: dict[str, Any] = {}
    if not isinstance(argv, list):
        return out
    i = 0
    while i < len(argv):
        a = str(argv[i])
        if a.startswith("-") and i + 1 < len(argv) and not str(argv[i + 1]).startswith("-"):
            out[a], i = argv[i + 1], i + 2
        else:
            out[a], i = True, i + 1
    return out


def _backend(left: Side, right: Side, notes: Notes, routed: _Routed) -> dict[str, Any] | None:
    ln, rn = left.run_config["config"]["backend"], right.run_config["config"]["backend"]
    lb, rb = left.env.get("backend") or {}, right.env.get("backend") or {}
    # settings the run config already records, paths whose content hash agrees, hardware (ENV)
    skip = {"device", "dtype"} | set(left.run_config["backend_options"]) | set(right.run_config["backend_options"])
    same_content = {k for k in lb if f"{k}_sha256" in lb and lb.get(f"{k}_sha256") == rb.get(f"{k}_sha256")}
    for k in sorted(same_content):
        if lb.get(k) != rb.get(k):
            notes.note({"field": f"env.backend.{k}", "left": lb.get(k), "right": rb.get(k)},
                       f"another path, the same content (backend.{k}_sha256 agrees)")
    skip |= same_content
    skip |= set(_ENGINE_MIRRORED) | set(HARDWARE_KEYS)
    engine = flat_diff({k: v for k, v in lb.items() if k not in skip}, {k: v for k, v in rb.items() if k not in skip}, "backend")
    if ln == rn:
        la, ra = _argv_flags(lb.get("argv")), _argv_flags(rb.get("argv"))
        engine += flat_diff({k: v for k, v in la.items() if k not in _ARGV_MIRRORED},
                            {k: v for k, v in ra.items() if k not in _ARGV_MIRRORED}, "backend.argv")
    for key in HARDWARE_KEYS:
        if key in lb or key in rb:
            routed.machine += flat_diff(lb.get(key, _ABSENT), rb.get(key, _ABSENT), f"backend.{key}")
    engine = notes.screen(engine, "env")
    dtype = routed.dtype if ln != rn else None
    if ln == rn and not engine:
        return None
    ev: dict[str, Any] = {"backend": _lr(ln, rn), "engine": _cut(engine)}
    if dtype is not None and dtype["requested"]["left"] == dtype["requested"]["right"]:
        ev["dtype_in_effect"] = _lr(dtype["left"], dtype["right"])  # each engine resolved the same request its own way
    return ev


def _kernel_first(d: dict[str, Any]) -> int:
    """Sort key: what selects kernels first (capability in effect, the variables that steer
    it, ISA flags, GPUs), then the rest."""
    f = d["field"]
    if f.startswith(("kernels.", "backend.")) or f.startswith(tuple(f"env_vars.{p}" for p in KERNEL_ENV_PREFIXES)):
        return 0
    if f.startswith(("cpu.", "gpus", "torch.")):
        return 1
    return 2


def _env(left: Side, right: Side, notes: Notes, routed: _Routed) -> dict[str, Any] | None:
    ignore = set(VOLATILE_KEYS) | {"backend"}  # the engine's own report is BACKEND_MISMATCH's
    if left.env.get("torch") is None or right.env.get("torch") is None:
        ignore.add("torch")  # a side whose engine never loaded torch (llama.cpp) has no torch facts to compare
    fields = flat_diff({k: v for k, v in left.env.items() if k not in ignore},
                       {k: v for k, v in right.env.items() if k not in ignore})
    if "torch" in ignore:
        fields = [f for f in fields if not f["field"].startswith("threads.torch_")
                  and not (f["field"].startswith("kernels.torch_") and _ABSENT in (f["left"], f["right"]))]
    same_backend = left.run_config["config"]["backend"] == right.run_config["config"]["backend"]
    if not same_backend:
        # a kernel fact only one engine reports (llama.cpp's CPU features, torch's capability) is
        # part of that engine's record, not a difference of the machine: BACKEND_MISMATCH owns it
        fields = [f for f in fields if not (f["field"].startswith("kernels.") and _ABSENT in (f["left"], f["right"]))]
    fields = notes.screen(fields, "env")
    if routed.dtype is not None and same_backend and routed.dtype["requested"]["left"] == routed.dtype["requested"]["right"]:
        fields.append({"field": "dtype in effect (chosen by the machine)", "left": routed.dtype["left"], "right": routed.dtype["right"]})
    fields = sorted(fields + routed.machine, key=_kernel_first)
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


def _batch(left: Side, right: Side, routed: _Routed | None = None) -> dict[str, Any] | None:
    changed = None
    if left.records is not None and right.records is not None:
        lm, rm = _batch_mates(left.records), _batch_mates(right.records)
        changed = sum(1 for k in lm if k in rm and lm[k] != rm[k])
    derived = routed.batch if routed is not None else []
    if left.batch_size == right.batch_size and not changed and not derived:
        return None
    ev: dict[str, Any] = {"batch_size": _lr(left.batch_size, right.batch_size),
                          "batch_sizes": sorted({left.batch_size, right.batch_size})}
    if changed is not None:
        ev["composition_changed"] = changed  # aligned prompts whose batch position or batch mates differ
    if derived:
        ev["derived"] = _cut(derived)  # settings that follow the batch sizes (slots, max_num_seqs)
    served = {side: server_batching(s.records) for side, s in (("left", left), ("right", right))}
    if any(served.values()):
        ev["server_batching"] = served  # backend openai: what the server itself reported while the requests were in flight
    return ev


def add_server_evidence(report: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """A check of a served backend (openai): a check's sides carry no records, so the server's own
    account is added here from the trace's evidence: BATCH_VARIANCE gets what the server said about
    its batch (server_batching), RUN_VARIANCE the prompt tokens it served from its prefix cache on
    each side (server_cache: different counts point at CACHE_VARIANCE, see check --cache-probe)."""
    from .engine import parse_label, select

    if not records or not isinstance(records[0].get("evidence"), dict):
        return
    by_name = {c["name"]: c for c in report.get("comparisons", [])}
    for cause in report.get("causes", []) + report.get("info", []):
        comps = [by_name[n] for n in cause["evidence"].get("comparisons", []) if n in by_name]
        if not comps or cause["code"] not in ("BATCH_VARIANCE", "RUN_VARIANCE"):
            continue
        sides = {}
        for side in ("left", "right"):  # a cause merged over several levels sums up all of their sides
            labels = {parse_label(c[side]) for c in comps}
            sides[side] = [r for run, batch in sorted(labels) for r in select(records, run=run, batch=batch)]
        if cause["code"] == "BATCH_VARIANCE":
            served = {side: server_batching(recs) for side, recs in sides.items()}
            if any(served.values()):
                cause["evidence"]["server_batching"] = served
            continue
        cached = {side: sum((r.get("evidence") or {}).get("cached_prompt_tokens") or 0 for r in recs) for side, recs in sides.items()}
        if cached["left"] != cached["right"]:
            cause["evidence"]["server_cache"] = {"cached_prompt_tokens": cached,
                                                 "note": "the server reused cached prompt tokens on one side: likely CACHE_VARIANCE "
                                                         "(detllm check --cache-probe tells)"}


def server_batching(records: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """A served backend's batching evidence over a selection (trace evidence.server_batch): requests
    in flight and the most the server reported computing at once. None when nothing was recorded."""
    groups = {(r["run_index"], r["batch_size"], r["prompt_index"] // r["batch_size"]): r["evidence"]["server_batch"]
              for r in records or () if isinstance(r.get("evidence"), dict) and isinstance(r["evidence"].get("server_batch"), dict)}
    batches = list(groups.values())  # one per group of requests sent together (its records share it)
    if not batches:
        return None
    busy = [b["server_busy_max"] for b in batches if "server_busy_max" in b]
    return {"in_flight": max(b["in_flight"] for b in batches), "source": batches[0].get("source"),
            "samples": sum(b.get("samples", 0) for b in batches), "server_busy_max": max(busy) if busy else None}


def differences(left: Side, right: Side, comp: dict[str, Any], notes: Notes | None = None) -> list[dict[str, Any]]:
    """Every recorded difference between two sides, as ranked {code, evidence}. `notes`
    collects what could not be compared and what is never a cause."""
    pairs = align(left.records, right.records)[0] if left.records is not None and right.records is not None else []
    full = all(s.run_config is not None and s.env is not None for s in (left, right))
    notes = notes if notes is not None else Notes()
    routed = _Routed()
    if full:
        notes.versions = schema_versions(left, right)
        if notes.versions[0] != notes.versions[1]:
            for c in versions.changes_between(*notes.versions):
                if not c.field.startswith("report."):  # a diff reads run folders, never their reports
                    notes.skip(c.field, f"redefined in version {c.since}: {c.what}")
    model = _model(left, right, notes) if full else None
    tokenizer = _tokenizer(left, right, pairs, notes)
    config = _config(left, right, notes, routed) if full else None  # routes machine and batch values first
    found = [
        ("MODEL_MISMATCH", model),
        ("TOKENIZER_MISMATCH", tokenizer),
        ("PROMPT_MISMATCH", _prompts(left, right, comp)),
        ("CONFIG_MISMATCH", config),
        ("BACKEND_MISMATCH", _backend(left, right, notes, routed) if full else None),
        ("ENV_MISMATCH", _env(left, right, notes, routed) if full else None),
        ("BATCH_VARIANCE", _batch(left, right, routed)),
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
                                         "kind": d["kind"], "near_tie": d["near_tie"],
                                         "magnitude": (d.get("magnitude") or {}).get("label", "unclassified")},
    }


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
    if not found:
        what = "none: model, tokenizer, prompts, config, backend, environment and batch agree"
        if notes.not_compared:
            what += f" (not compared across schema versions: {', '.join(n['field'] for n in notes.not_compared[:4])})"
        found = [{"code": "RUN_VARIANCE", "evidence": {"comparisons": [comp["name"]], "recorded_differences": what}}]
    moved = comp.get("prompts_moved") or {}
    for c in found:
        if c["code"] in ("RUN_VARIANCE", "BATCH_VARIANCE"):
            c["evidence"].update(_divergence_summary(comp))
        if moved.get("count") and c["code"] in ("RUN_VARIANCE", "BATCH_VARIANCE", "PROMPT_MISMATCH"):
            c["evidence"]["prompts_moved"] = moved  # sampled seeds follow content, but batches follow positions
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
