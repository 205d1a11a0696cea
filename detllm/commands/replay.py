"""Replay a repro pack: re-run its recorded config and prompts here, then diff against it.

Owns the order that keeps a replay honest: verify the pack, read its prompts (refused
when it was recorded with --no-prompt-text), check --out, load the backend ONCE and
compare its weights with the pack's before a token is generated (ModelChangedError,
nothing written, unless allowed), then run and diff with the one diff engine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..runfolder import artifacts
from ..backends.registry import create_backend
from ..core.config import RunConfig
from ..core.errors import DetllmError, IntegrityError, ModelChangedError, UsageError
from ..core.hashing import sha256_text
from ..runfolder.archive import open_run_path
from .verify import verify_folder
from ..core.prompts import PromptSet
from ..pipeline.runner import Outcome, Progress, execute
from ..runfolder.signing import load_signing_key


def replay(
    pack: str | Path,
    *,
    out: str | Path | None = None,
    force: bool = False,
    allow_model_change: bool = False,
    model: str | None = None,
    sign_key: str | Path | None = None,
    pubkey: str | Path | None = None,
    progress: Progress | None = None,
    base_url: str | None = None,
    api_key_env: str | None = None,
    allow_pack_options: tuple[str, ...] = (),
    sample: str | None = None,
    sample_seed: int | None = None,
    checkpoints: str | Path | None = None,
    script: str | None = None,
) -> Any:
    """Re-run `pack` (a sealed run folder or .tar.gz) on this machine into `out`; the outcome's
    report is the diff of the replay against the pack (PASS: the pack reproduced). With `pubkey`,
    only a pack whose manifest.sig verifies with that key is replayed. `allow_pack_options`
    names the code-loading options (RISKY_OPTIONS) the pack may set for this replay."""
    with open_run_path(Path(pack)) as folder:
        from ..training.pack import is_training_pack

        if is_training_pack(folder):  # re-run its steps, each landing on its committed h_t (training/replay.py)
            return _replay_training(folder, str(pack), out=out, force=force, sample=sample, sample_seed=sample_seed,
                                    checkpoints=checkpoints, model=model, allow_model_change=allow_model_change, script=script,
                                    allow_pack_options=allow_pack_options, pubkey=pubkey, sign_key=sign_key,
                                    served=(base_url, api_key_env))
        given = [flag for flag, v in (("--sample", sample), ("--sample-seed", sample_seed), ("--checkpoints", checkpoints),
                                      ("--script", script)) if v is not None]
        if given:
            raise UsageError(f"{given[0]} applies to a training pack (detllm train-check); {str(pack)!r} is a run pack")
        verify_folder(folder, pubkey=pubkey)  # a changed (or, with pubkey, unsigned) pack is refused before anything runs
        recorded = artifacts.load_run(folder, validate_records=False)  # verify already checked every record
        config = pack_options(RunConfig.from_json(recorded.run_config["config"]), allow=allow_pack_options)
        if model is not None:
            config = dataclasses.replace(config, model=model)
        config = served_options_given(config, base_url, api_key_env)
        prompts = recorded_prompts(recorded, label=str(pack))
        out = Path(out) if out is not None else artifacts.default_out_dir("replay")
        if out.exists() and out.resolve() == folder.resolve():
            raise UsageError(f"--out {str(out)!r} is the pack being replayed", hint="choose another --out")
        artifacts.check_out_dir(out, force=force)
        if sign_key is not None:
            load_signing_key(sign_key)  # refuse a bad key before the model loads
        before = local_identity(config)
        if before is not None:  # the weights on disk, hashed before any loader opens them
            check_model(recorded.run_config["model"], before, allow=allow_model_change)
        backend = create_backend(config)
        try:
            check_model(recorded.run_config["model"], backend.model_identity().to_json(), allow=allow_model_change)
            return execute(
                config, command="replay", out=out, force=force, backend=backend, progress=progress,
                prompt_set=prompts, sign_key=sign_key,
                make_report=lambda records, tier, floor, summary: replay_report(
                    pack, recorded, out, records, summary, config=config, tier=tier, floor=floor),
            )
        finally:
            backend.close()


def _replay_training(folder: Path, label: str, *, sign_key: str | Path | None, served: tuple[str | None, str | None], **kw: Any) -> Any:
    from ..runfolder.integrity import seal
    from ..runfolder.signing import load_signing_key
    from ..training.replay import replay_folder

    if any(v is not None for v in served):
        raise UsageError("--base-url and --api-key-env apply to packs of a served endpoint, not to a training pack")
    signer = load_signing_key(sign_key) if sign_key is not None else None  # a bad key is refused before anything runs
    outcome = replay_folder(folder, label=label, **kw)
    seal(outcome.out_dir, signer)  # train_replay.json and the segments' records: verify and pack take the folder
    return outcome


# Options through which a pack could make replay run code of its choosing. Replay takes none of
# them from a pack unless the user names it (--allow-pack-option NAME): trust_remote_code=true
# and an attention implementation outside SAFE_ATTENTION are refused (replaying without them
# would compute something else); a binary path (llamacpp bin) is dropped, so the local
# llama-server is found as always (DETLLM_LLAMA_BIN, PATH, the build cache).
RISKY_OPTIONS = {
    "trust_remote_code": "runs Python code from the model's repository",
    "attn_implementation": "loads attention code outside the built-in kernels",
    "bin": "is a program replay would execute",
}
SAFE_ATTENTION = ("eager", "sdpa")  # kernels inside torch/transformers: no code comes with the model
# Where a served backend (openai) sends requests and which variable's key it sends (base_url,
# api_key_env) are never taken from a pack: it must not send your key to its author's server.
# They come only from replay's own --base-url / --api-key-env.
SERVED_OPTIONS = frozenset({"base_url", "api_key_env"})


def is_risky(key: str, value: str) -> bool:
    v = value.strip().lower()
    if key == "trust_remote_code":
        return v in ("1", "true", "yes", "on")
    if key == "attn_implementation":
        return v not in SAFE_ATTENTION
    return key in RISKY_OPTIONS and v not in ("", "none", "null")


def pack_options(config: RunConfig, *, allow: tuple[str, ...] = ()) -> RunConfig:
    """The pack's --opt settings this replay may use: served endpoints dropped, a risky option
    refused (UsageError) or, for a binary path, dropped, unless named in `allow`."""
    unknown = sorted(set(allow) - set(RISKY_OPTIONS))
    if unknown:
        raise UsageError(f"--allow-pack-option {unknown[0]!r} is not an option replay guards",
                         hint=f"guarded: {', '.join(sorted(RISKY_OPTIONS))}")
    kept = []
    for key, value in config.options:
        if key in SERVED_OPTIONS:
            continue
        if is_risky(key, value) and key not in allow:
            if key == "bin":
                continue  # the local llama-server is found as always
            raise UsageError(f"the pack sets --opt {key}={value[:80]!r}, which {RISKY_OPTIONS[key]}; replay never takes it "
                             f"from a pack unasked", hint=f"pass --allow-pack-option {key} if you trust the pack's author")
        kept.append((key, value))
    return dataclasses.replace(config, options=tuple(kept))


def local_identity(config: RunConfig) -> dict[str, Any] | None:
    """The local model's identity from its files, before any engine loads it (hf and vllm read a
    local or cached folder); None where it is only known once the backend is up."""
    if config.backend not in ("hf", "vllm"):
        return None
    from ..core.hashing import folder_identity
    from ..models import local_folder, resolve_model

    try:
        resolved = resolve_model(config.model)
        folder = local_folder(resolved, config.revision)
    except DetllmError:  # not local, not cached: the backend reports it in its own words
        return None
    return folder_identity(resolved.id, folder, revision=config.revision).to_json()


def served_options_given(config: RunConfig, base_url: str | None, api_key_env: str | None) -> RunConfig:
    """replay --base-url / --api-key-env: the only way a served pack's endpoint and key reach a replay."""
    given = {k: v for k, v in (("base_url", base_url), ("api_key_env", api_key_env)) if v}
    if not given:
        if config.backend == "openai":
            raise UsageError("this pack was recorded against a served endpoint; replay never takes its URL from the pack",
                             hint="pass --base-url (and --api-key-env NAME if the server needs a key)")
        return config
    if config.backend != "openai":
        raise UsageError(f"--base-url/--api-key-env apply to packs of backend openai, this one is {config.backend!r}")
    return dataclasses.replace(config, options=tuple(sorted(dict(config.options, **given).items())))


def recorded_prompts(run: artifacts.RunFolder, *, label: str) -> PromptSet:
    """The pack's prompts in prompt-index order, from the trace's prompt_text."""
    count = run.run_config["prompts"]["count"]
    texts: dict[int, str] = {}
    for rec in run.records:
        text = rec["prompt_text"]
        if text is None:
            raise UsageError(f"{label} was recorded with --no-prompt-text: it holds only prompt hashes, so it cannot be replayed",
                             hint="re-record it with prompt text, or run the same prompts here and `detllm diff` against the pack")
        if sha256_text(text) != rec["prompt_id"]:
            raise IntegrityError(f"{label}: trace record of prompt {rec['prompt_index']} has a prompt_text that does not hash to its prompt_id")
        texts.setdefault(rec["prompt_index"], text)
    missing = sorted(set(range(count)) - set(texts))
    if missing:
        raise UsageError(f"{label}: the trace holds no record of prompt(s) {missing[:5]}, so they cannot be replayed")
    prompts = PromptSet(tuple(texts[i] for i in range(count)), f"replay of {label}")
    if prompts.sha256 != run.run_config["prompts"]["sha256"]:
        raise IntegrityError(f"{label}: the trace's prompts do not hash to run_config.json's prompts.sha256")
    return prompts


def check_model(recorded: dict[str, Any], local: dict[str, Any], *, allow: bool) -> None:
    """Refuse (ModelChangedError, exit 7) when the local weights are not the pack's."""
    # a pack without config_files_sha256 hashed the config files byte for byte (versions.REDEFINED)
    key = "config_sha256" if "config_files_sha256" in recorded else "config_files_sha256"
    config_same = recorded.get("config_sha256") in (None, local.get(key))
    if recorded["weights_sha256"] is None or local["weights_sha256"] is None:  # a served model: unknown, never "the same"
        if allow:
            return
        raise ModelChangedError(f"the model {local['id']!r} is served remotely: its weights were never hashed, so replay cannot "
                                "check they are the pack's", hint="pass --allow-model-change to replay against the server anyway")
    if (recorded["weights_sha256"] == local["weights_sha256"] and config_same) or allow:
        return
    if recorded["weights_sha256"] == local["weights_sha256"]:
        raise ModelChangedError(
            f"the local model {local['id']!r} has the pack's weights but a different config.json/generation_config.json "
            f"(config sha256 {str(local.get('config_sha256'))[:12]}…, the pack's {recorded['config_sha256'][:12]}…); refusing to replay",
            hint="pass --allow-model-change to replay anyway and see where the outputs move",
        )
    theirs = {w["file"]: w["sha256"] for w in recorded["weights"]}
    ours = {w["file"]: w["sha256"] for w in local["weights"]}
    changed = sorted(f for f in theirs.keys() | ours.keys() if theirs.get(f) != ours.get(f))
    raise ModelChangedError(
        f"the local model {local['id']!r} has weights sha256 {local['weights_sha256'][:12]}…, the pack's is "
        f"{recorded['weights_sha256'][:12]}… ({', '.join(changed[:3]) or 'file list'} differ); refusing to replay",
        hint="pass --allow-model-change to replay anyway and see where the outputs move",
    )


def replay_report(pack: Path | str, recorded: artifacts.RunFolder, out: Path, records: list[dict[str, Any]],
                  summary: dict[str, Any], *, config: RunConfig, tier: int, floor: float | None) -> dict[str, Any]:
    """The replay's report.json: `detllm diff` (diff.diff_report) of every (run, batch size) the
    pack recorded, pack on the left, replay on the right; the first failing one decides. Its
    summary.reproduction says, in the pack's terms, whether the pack's own verdict recurs here."""
    from ..compare.causes import Side
    from ..compare.engine import label, select
    from .diff import diff_report

    here = {name: artifacts.read_json(out / name, kind) for name, kind in
            ((artifacts.ENV, "env"), (artifacts.RUN_CONFIG, "run_config"), (artifacts.APPLIED, "determinism_applied"))}
    reports = []
    for run, batch in sorted({(r["run_index"], r["batch_size"]) for r in recorded.records}, key=lambda k: (k[1], k[0])):
        left = Side(f"pack::{label(run, batch)}", run, batch, select(recorded.records, run=run, batch=batch), str(pack),
                    recorded.env, recorded.run_config, recorded.applied)
        right = Side(f"replay::{label(run, batch)}", run, batch, select(records, run=run, batch=batch), str(out),
                     here[artifacts.ENV], here[artifacts.RUN_CONFIG], here[artifacts.APPLIED])
        reports.append(diff_report(left, right, atol=recorded.run_config["config"]["atol"]))
    decisive = next((r for r in reports if r["status"] == "FAIL"), reports[0])
    failed = sum(r["status"] == "FAIL" for r in reports)
    extra = {"reproduction": reproduction(recorded.report or {}, config, records, tier, floor, matches=not failed)}
    return {
        **decisive,
        "command": "replay",
        "status": "FAIL" if decisive["status"] == "FAIL" else "PASS",
        "comparisons": [c for r in reports for c in r["comparisons"]],
        "summary": {**summary, "pack": str(pack), "selections": len(reports), "failed": failed, **extra},
    }


def _verdict(report: dict[str, Any]) -> str:
    return report["status"] + ("" if report["category"] in ("PASS", report["status"]) else f" [{report['category']}]")


def reproduction(pack_report: dict[str, Any], config: RunConfig, records: list[dict[str, Any]], tier: int,
                 floor: float | None, *, matches: bool) -> dict[str, Any]:
    """Whether the pack's own verdict recurs here: the replay's records judged as the pack's check
    judged its own (checkverdict.check_verdict, the one verdict maker), in the reporter's terms
    ("the pack's FAIL [RUN_VARIANCE] reproduces here"). `matches`: every selection of the replay
    equals the pack's (the replay's PASS), which makes a reproduction exact."""
    if pack_report.get("command") != "check":
        return {"pack": None, "here": None, "reproduces": None, "matches_pack": matches,
                "line": f"the pack holds a detllm {pack_report.get('command', 'run')}, not a check: it has no verdict to reproduce; "
                        + ("this machine computes every output it recorded" if matches else "this machine computes other outputs (below)")}
    from ..pipeline.checkverdict import check_verdict

    mine = check_verdict(config, records, tier=tier, floor=floor, summary={}, drift=False)
    theirs, ours = _verdict(pack_report), _verdict(mine)
    same = (pack_report["status"], pack_report["category"]) == (mine["status"], mine["category"])
    exact = "exactly: every run and batch size computes the outputs the pack recorded" if matches else \
        "though with other outputs than the pack's (the differences below)"
    if pack_report["status"] == "FAIL":
        line = (f"the pack's {theirs} reproduces here, {exact}" if same else
                f"the pack's {theirs} does not reproduce here: the same check passes here at tier {tier}" if mine["status"] == "PASS" else
                f"the pack's {theirs} does not reproduce here as recorded: the same check gives {ours} here")
    else:
        line = (f"the pack's {theirs} still passes here, {exact}" if same else f"the pack's {theirs} no longer passes here: the same "
                                                                                 f"check gives {ours} here")
    return {"pack": theirs, "here": ours, "reproduces": same, "matches_pack": matches, "line": line}
