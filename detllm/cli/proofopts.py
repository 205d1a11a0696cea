"""check's options on what a PASS must show (pipeline/engagement.py, pipeline/fillprompts.py):
--require-engagement, --max-rate, --confidence, --fill-prompts; hidden on `run`, which compares nothing.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

RequireEngagement = Annotated[bool, typer.Option("--require-engagement", help="check: a comparison whose engagement the engine does not reveal is UNVERIFIED, not PASS (strict: exit 3).")]
MaxRate = Annotated[Optional[float], typer.Option("--max-rate", help="check: refuse (exit 2) unless the prompts are enough for a PASS to bound the per-prompt divergence rate below this (0.05 needs 59 prompts at 95%).")]
Confidence = Annotated[float, typer.Option("--confidence", help="check: the one-sided confidence of every PASS's bound and of --max-rate.")]
FillPrompts = Annotated[bool, typer.Option("--fill-prompts", help="check --max-rate: add seeded fillers from a built-in corpus up to the prompts needed; counted and bounded apart.")]
HIDDEN = {"require_engagement": Annotated[bool, typer.Option("--require-engagement", hidden=True)],
          "max_rate": Annotated[Optional[float], typer.Option("--max-rate", hidden=True)],
          "confidence": Annotated[float, typer.Option("--confidence", hidden=True)],
          "fill_prompts": Annotated[bool, typer.Option("--fill-prompts", hidden=True)]}

__all__ = ["Confidence", "FillPrompts", "HIDDEN", "MaxRate", "RequireEngagement"]
