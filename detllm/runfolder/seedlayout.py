"""The seed detllm 0.1's folder layout, recognised so it can be refused in one line.

A light module (json and pathlib only): `verify`, `pack` and `report` call it before they
read anything, and must not pay for the runner or the comparison code to do so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..core.errors import ArtifactError

SEED_LAYOUT = ("written by the seed detllm 0.1 (traces/run_N.jsonl, trace rows with a `scores` field, "
               "schema_version 1.0); that layout is out of scope")
SEED_HINT = "re-run it with this detllm to get a run folder it can read"


def seed_layout(path: Path) -> bool:
    """A folder or file written by the seed: its check layout (traces/run_N.jsonl), its
    artifacts (schema_version "1.0" with a detllm_version header) or its trace rows."""
    path = Path(path)
    if path.is_dir():
        if (path / "traces").is_dir() and any((path / "traces").glob("run_*.jsonl")):
            return True
        return any(_seed_json(path / n) for n in ("run_config.json", "report.json", "env.json"))
    if path.suffix == ".jsonl":
        row = _first_row(path)
        return isinstance(row, dict) and "artifact_type" not in row and ("scores" in row or "generated_token_ids" in row)
    return path.suffix == ".json" and _seed_json(path)


def refuse_seed_layout(path: Path) -> None:
    if seed_layout(path):
        raise ArtifactError(f"{str(path)!r} was {SEED_LAYOUT}", hint=SEED_HINT)


def _seed_json(path: Path) -> bool:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and obj.get("schema_version") == "1.0" and "detllm_version" in obj


def _first_row(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    return json.loads(line)
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return None


__all__ = ["SEED_HINT", "SEED_LAYOUT", "refuse_seed_layout", "seed_layout"]
