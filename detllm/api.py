"""The Python API: the same verbs as the CLI, one implementation.

    import detllm
    outcome = detllm.check(model="tiny", runs=3, vary_batch=(1, 2, 8))
    outcome.status, outcome.category, outcome.out_dir, outcome.details

The seed's calls work as written: `run(backend="hf", model="tiny", prompts=["Hello"],
tier=1, out_dir="artifacts/run1")`. Keyword arguments are RunConfig fields (see
config.py); `decoding` fields may be given flat (max_new_tokens=, temperature=, top_p=,
top_k= — top_k is the sampling filter, as on the CLI; logprobs= is the recorded count).
`prompts` is a list of strings or a prompt file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

from .core.config import Decoding, RunConfig
from .runfolder.env import Redaction
from .core.errors import UsageError
from .core.prompts import resolve_prompts
from .pipeline.runner import Outcome, execute

_DECODING = {f.name for f in dataclasses.fields(Decoding)}
_CONFIG = {f.name for f in dataclasses.fields(RunConfig)}

Prompts = "str | Path | Sequence[str] | None"


def make_config(base: RunConfig | None = None, **fields: Any) -> RunConfig:
    """RunConfig from keyword fields; an unknown name is a UsageError."""
    base = base or RunConfig()
    tokenizer_revision = fields.pop("tokenizer_revision", None)
    dec = {k: fields.pop(k) for k in list(fields) if k in _DECODING}
    unknown = set(fields) - _CONFIG
    if unknown:
        raise UsageError(f"unknown setting(s): {', '.join(sorted(unknown))}")
    if "vary_batch" in fields:
        fields["vary_batch"] = tuple(fields["vary_batch"] or ())
    if isinstance(fields.get("options"), dict):
        fields["options"] = tuple(sorted((str(k), str(v)) for k, v in fields["options"].items()))
    cfg = dataclasses.replace(base, **fields)
    if dec:
        cfg = dataclasses.replace(cfg, decoding=dataclasses.replace(cfg.decoding, **dec))
    if tokenizer_revision is not None:
        cfg = dataclasses.replace(cfg, revision=tokenizer_revision_of(cfg.revision, tokenizer_revision))
    return cfg


def tokenizer_revision_of(revision: str | None, tokenizer_revision: str) -> str:
    """The seed's --tokenizer-revision. detllm loads the tokenizer from the model's own snapshot,
    so it is the model's revision too; a different one from --revision is refused, not dropped."""
    if revision is not None and revision != tokenizer_revision:
        raise UsageError(f"--tokenizer-revision {tokenizer_revision!r} differs from --revision {revision!r}",
                         hint="detllm loads the tokenizer from the model's snapshot: give one revision")
    return tokenizer_revision


def _out(out: str | Path | None, out_dir: str | Path | None) -> Path | None:
    if out is not None and out_dir is not None and Path(out) != Path(out_dir):
        raise UsageError(f"out={str(out)!r} and out_dir={str(out_dir)!r} name different folders", hint="give one")
    chosen = out if out is not None else out_dir
    return Path(chosen) if chosen is not None else None


def _redaction(redact: bool, redact_env_vars: Sequence[str] | None) -> Redaction | None:
    if isinstance(redact_env_vars, str):
        redact_env_vars = [redact_env_vars]
    names = tuple(redact_env_vars or ())
    return Redaction(all_vars=bool(redact), names=names) if redact or names else None


def _execute(command: str, config: RunConfig | None, prompts: Any, out: Any, out_dir: Any, force: bool, progress,
             sign_key, redact: bool, redact_env_vars, fields: dict[str, Any]) -> Outcome:
    cfg = make_config(config, **fields)
    if command == "check":
        from .pipeline.cacheprobe import probe_config, wants_probe

        if wants_probe(cfg):  # check --cache-probe (backend openai): cold/warm runs; its verdict: checkverdict.py
            cfg = probe_config(cfg)
    cfg.validate(command=command)  # a bad setting is named before a bad prompt list
    prompt_set = resolve_prompts(prompts)
    if command == "check":  # --max-rate: enough prompts for the bound, or refused before anything is written
        from .pipeline.fillprompts import plan

        cfg, prompt_set = plan(cfg, prompt_set)
    return execute(cfg, command=command, prompt_set=prompt_set, out=_out(out, out_dir), force=force,
                   progress=progress, sign_key=sign_key, redaction=_redaction(redact, redact_env_vars))


def run(config: RunConfig | None = None, *, prompts: Prompts = None, out: str | Path | None = None,  # type: ignore[valid-type]
        out_dir: str | Path | None = None, force: bool = False, progress=None, sign_key: str | Path | None = None,
        redact: bool = False, redact_env_vars: Sequence[str] | None = None, validate_schema: bool = True,
        **fields: Any) -> Outcome:
    """Generate once per batch size and write a run folder (status RECORDED); `sign_key` signs its manifest.
    `redact` hides every recorded environment variable's value and the hostname in env.json,
    `redact_env_vars` the named ones. `validate_schema` is accepted for the seed's API: every
    artifact is always validated against its schema, whatever it says."""
    return _execute("run", config, prompts, out, out_dir, force, progress, sign_key, redact, redact_env_vars, fields)


def check(config: RunConfig | None = None, *, prompts: Prompts = None, out: str | Path | None = None,  # type: ignore[valid-type]
          out_dir: str | Path | None = None, force: bool = False, progress=None, sign_key: str | Path | None = None,
          redact: bool = False, redact_env_vars: Sequence[str] | None = None, validate_schema: bool = True,
          **fields: Any) -> Outcome:
    """Repeat runs (and vary batch size), compare, and write a run folder with the verdict.
    The other arguments as in run()."""
    if config is None:
        fields.setdefault("runs", 3)  # RunConfig's default of 1 suits `run`; a check compares repeats
    return _execute("check", config, prompts, out, out_dir, force, progress, sign_key, redact, redact_env_vars, fields)
