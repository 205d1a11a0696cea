"""The Python API: the same verbs as the CLI, one implementation.

    import detllm
    outcome = detllm.check(model="tiny", runs=3, vary_batch=(1, 2, 8))
    outcome.status, outcome.out_dir, outcome.report

Keyword arguments are RunConfig fields (see config.py); `decoding` fields may be
given flat (max_new_tokens=, temperature=, top_p=, top_k=).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from .config import Decoding, RunConfig
from .errors import UsageError
from .runner import Outcome, execute

_DECODING = {f.name for f in dataclasses.fields(Decoding)}
_CONFIG = {f.name for f in dataclasses.fields(RunConfig)}


def make_config(base: RunConfig | None = None, **fields: Any) -> RunConfig:
    """RunConfig from keyword fields; an unknown name is a UsageError."""
    base = base or RunConfig()
    dec = {k: fields.pop(k) for k in list(fields) if k in _DECODING}
    unknown = set(fields) - _CONFIG
    if unknown:
        raise UsageError(f"unknown setting(s): {', '.join(sorted(unknown))}")
    if "vary_batch" in fields:
        fields["vary_batch"] = tuple(fields["vary_batch"])
    if isinstance(fields.get("options"), dict):
        fields["options"] = tuple(sorted((str(k), str(v)) for k, v in fields["options"].items()))
    cfg = dataclasses.replace(base, **fields)
    if dec:
        cfg = dataclasses.replace(cfg, decoding=dataclasses.replace(cfg.decoding, **dec))
    return cfg


def run(config: RunConfig | None = None, *, prompts: str | Path | None = None, out: str | Path | None = None,
        force: bool = False, progress=None, sign_key: str | Path | None = None, **fields: Any) -> Outcome:
    """Generate once per batch size and write a run folder (status RECORDED); `sign_key` signs its manifest."""
    cfg = make_config(config, **fields)
    return execute(cfg, command="run", prompts_path=prompts, out=Path(out) if out else None, force=force, progress=progress,
                   sign_key=sign_key)


def check(config: RunConfig | None = None, *, prompts: str | Path | None = None, out: str | Path | None = None,
          force: bool = False, progress=None, sign_key: str | Path | None = None, **fields: Any) -> Outcome:
    """Repeat runs (and vary batch size), compare, and write a run folder with the verdict."""
    if config is None:
        fields.setdefault("runs", 3)  # RunConfig's default of 1 suits `run`; a check compares repeats
    cfg = make_config(config, **fields)
    return execute(cfg, command="check", prompts_path=prompts, out=Path(out) if out else None, force=force, progress=progress,
                   sign_key=sign_key)
