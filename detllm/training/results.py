"""verify of the sealed folders the training commands write beside training packs: parity (its
per-path figures and verdict re-derived from the per-token logprobs it holds), train_diff (its
verdict against its first divergence; the two packs it compared are not in it), train-check
--axis (the base's repeat re-derived from its cells) and a training replay (its segments' heads). Reads JSON only, no torch. The seal itself is
integrity.py's; training packs are pack.py's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..core.errors import IntegrityError
from ..runfolder.schema_io import finite
from .paritystats import compare_path, verdict_of
from .verdict import first_divergence

PARITY, TRAIN_DIFF, AXES, TRAIN_REPLAY = "parity.json", "train_diff.json", "axes.json", "train_replay.json"
_EDITED = "the result does not follow from the sealed data"


def result_kind(folder: Path) -> str | None:
    """Which training result a sealed folder holds (its JSON file's artifact_type), or None."""
    for name, kind in ((PARITY, "parity"), (TRAIN_DIFF, "train_diff"), (AXES, "train_axes"), (TRAIN_REPLAY, "train_replay")):
        p = Path(folder) / name
        if p.is_file():
            try:
                if json.loads(p.read_bytes()).get("artifact_type") == kind:
                    return kind
            except (OSError, ValueError, AttributeError):
                return None
    return None


def _same(x: Any) -> Any:
    return json.loads(json.dumps(finite(x), sort_keys=True))  # as write_json stored it (non-finite numbers as null)


def rederive_parity(folder: Path) -> str:
    doc = json.loads((folder / PARITY).read_bytes())
    trainer = [s["trainer"] or [] for s in doc["sequences"]]
    for name, said in doc["paths"].items():
        got = [s[name] for s in doc["sequences"]]
        if not said["available"]:
            if any(g is not None for g in got):
                raise IntegrityError(f"{PARITY}: path {name} is recorded as not compared, but its logprobs are there", hint=_EDITED)
            continue
        again = _same(compare_path(trainer, got, atol=doc["atol"]))
        for key in sorted(said):
            if key in again and said[key] != again[key]:
                raise IntegrityError(f"{PARITY}: paths.{name}.{key} is {said[key]!r}, but the sealed per-token logprobs give "
                                     f"{again[key]!r}", hint=_EDITED)
    if verdict_of(doc["paths"]) != doc["verdict"]:
        raise IntegrityError(f"{PARITY}: verdict {doc['verdict']} does not follow from its paths", hint=_EDITED)
    n = sum(1 for p in doc["paths"].values() if p["available"])
    return f"parity verdict {doc['verdict']} and the figures of {n} path(s) re-derived from the {len(doc['sequences'])} sequences' logprobs"


def rederive_train_diff(folder: Path) -> str:
    doc = json.loads((folder / TRAIN_DIFF).read_bytes())
    if (doc["first_divergence"] is None) != (doc["verdict"] == "PASS"):
        raise IntegrityError(f"{TRAIN_DIFF}: verdict {doc['verdict']} does not follow from its first divergence", hint=_EDITED)
    return (f"train_diff verdict {doc['verdict']} follows from its first divergence; the two packs are not in the folder "
            f"(detllm diff {doc['a']} {doc['b']} compares them again)")


def rederive_axes(folder: Path) -> str:
    doc = json.loads((folder / AXES).read_bytes())
    cells = folder / "cells"

    def lines(name: str) -> list[dict[str, Any]]:
        p = cells / f"{name}.jsonl"
        if not p.is_file():
            raise IntegrityError(f"{AXES}: cells/{name}.jsonl is missing", hint=_EDITED)
        return [json.loads(line) for line in p.read_bytes().splitlines() if line.strip()]

    repeated = first_divergence(lines("base"), lines("base-repeat"), run=1, test_options={}) is None
    if ("PASS" if repeated else "FAIL") != doc["verdict"] or doc["cells"][0]["bits_changed"] is repeated:
        raise IntegrityError(f"{AXES}: verdict {doc['verdict']} does not follow from cells/base.jsonl and cells/base-repeat.jsonl",
                             hint=_EDITED)
    return f"axes verdict {doc['verdict']} (the base repeats itself) re-derived from its cells"


def rederive_replay(folder: Path) -> str:
    """A training replay's folder: each segment's head is the last h of its re-run records, landed only
    where that head is the committed one, PASS only when every segment landed (the pack is not in it)."""
    doc = json.loads((folder / TRAIN_REPLAY).read_bytes())
    for row in doc["segments"]:
        p = folder / f"segment_{row['start']:06d}_{row['stop']:06d}.jsonl"
        steps = [json.loads(line) for line in p.read_bytes().splitlines() if line.strip()] if p.is_file() else []
        last = next((r["h"] for r in reversed(steps) if r.get("artifact_type") == "train_step"), None)
        if last != row["head"] or (row["landed"] and row["head"] != row["committed_head"]):
            raise IntegrityError(f"{TRAIN_REPLAY}: segment {row['start']}..{row['stop'] - 1} does not follow from {p.name}", hint=_EDITED)
    if (doc["verdict"] == "PASS") != all(r["landed"] for r in doc["segments"]):
        raise IntegrityError(f"{TRAIN_REPLAY}: verdict {doc['verdict']} does not follow from its segments", hint=_EDITED)
    return (f"replay verdict {doc['verdict']} follows from the {len(doc['segments'])} segments' re-run records; the pack's "
            "commitments are not in the folder")


def rederive_result(folder: Path) -> str | None:
    """What verify prints for a training result folder after its bytes matched; None: not one."""
    kind = result_kind(folder)
    return None if kind is None else {"parity": rederive_parity, "train_diff": rederive_train_diff,
                                      "train_axes": rederive_axes, "train_replay": rederive_replay}[kind](Path(folder))


__all__ = ["rederive_result", "result_kind"]
