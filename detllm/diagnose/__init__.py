"""Diagnose and sweep: from a FAIL to the knob that causes it, with real probes as evidence.

Modules: probes (the plan per backend), core (`diagnose`), evidence (judging probe folders),
ranking (knob verdicts and the conclusion), recorded (a diff's recorded differences as knobs),
folder (the diagnosis folder's names and records, shared by core and recorded), needle and
prefill (special probes), worker/pool (each probe a real run in a child process), sweep and
sweep_render (grids with statistics), render (txt/md).
Nothing here imports an engine in the calling process.
"""

from __future__ import annotations

from .core import Budget, Diagnosis, diagnose

__all__ = ["Budget", "Diagnosis", "diagnose"]
