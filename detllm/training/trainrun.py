"""`detllm train-run`'s pack: one training run recorded alone (as `run` is to `check`), run 0 and
no repeat, to compare with another node's by `detllm diff A B`. Owns its verdict (RECORDED:
nothing was compared, so nothing passed), its words and verify's check of it; the run itself
(check.train_run), the pack and the chain are train-check's (check.py, chain.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..core.errors import IntegrityError

RECORDED = "RECORDED"


def recorded_summary(steps: int, head: str) -> str:
    return f"RECORDED: one run of {steps} steps (head {head[:16]}…); nothing compared: `detllm diff` it with another pack"


def recorded_scope(config: dict[str, Any]) -> str:
    return (f"run 0 alone in this process; threads {config['threads'] or 'torch default'}; no repeat, so this pack says "
            "nothing about repeatability by itself (train-check does)")


def rederive_recorded(folder: Path, report: dict[str, Any], head: str) -> str:
    """verify of a train-run pack's report: RECORDED, run 0 alone with the head its chain re-derived, no comparison."""
    runs = report["runs"]
    if report["verdict"] != RECORDED or report["comparisons"] or report["first_divergence"] is not None \
            or [r["run"] for r in runs] != [0] or runs[0]["file"] != "steps.jsonl":
        raise IntegrityError("train_report.json: a train-run report holds run 0 alone, nothing compared, verdict RECORDED",
                             hint="the report does not follow from the sealed steps files")
    if runs[0]["head"] != head:
        raise IntegrityError("train_report.json: run 0's head is not the head of steps.jsonl", hint="the report does not follow "
                             "from the sealed steps files")
    if (Path(folder) / "repeats").exists():
        raise IntegrityError("repeats/ is in a train-run pack, whose report names no repeat")
    return "verdict RECORDED (one run, nothing compared) follows from steps.jsonl"


def is_train_run(folder: Path) -> bool:
    p = Path(folder) / "train_report.json"
    try:
        return p.is_file() and json.loads(p.read_bytes()).get("command") == "train-run"
    except (OSError, ValueError, AttributeError):
        return False


__all__ = ["RECORDED", "is_train_run", "recorded_scope", "recorded_summary", "rederive_recorded"]
