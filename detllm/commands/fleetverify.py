"""The fleet verdict re-derived for `verify`: fleet.json's groups, majority, outliers and category
computed again by fleetverdict.fleet_verdict, from the sealed replica folders of a fleet check or,
for an N-way diff's folder, from the sides it names (outside the folder: re-derived when they are at
hand, said plainly when not). A replica's endpoint error is as sealed: it cannot be re-run offline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..core.errors import IntegrityError
from ..runfolder.artifacts import MANIFEST, PARTIAL
from ..runfolder.fleetseal import FLEET
from ..pipeline.rederive import as_written
from .diff import Selection, load_sides
from .fleetverdict import GROUPING, Replica, fleet_verdict, own_check, prompt_keys, side_own

# compared in this order, the verdict first; created_at and detllm_version are not derived
CHECKED = ("status", "category", "verdict", "tier", "atol", "reference", "outliers", "majority", "groups",
           "no_majority_prompts", "prompts", "identity", "variance", "replicas", "errors", "explanations", "pairs",
           "not_compared")
_EDITED = "the fleet verdict was edited after the fleet ran; re-run it"


def rederive_fleet(folder: Path) -> str:
    """Raise IntegrityError naming fleet.json's first field that does not follow from the replicas;
    return what was done, in words, for `verify` to print."""
    doc = json.loads((folder / FLEET).read_bytes())  # validated against its schema already
    if doc.get("grouping") != GROUPING:
        return "the fleet verdict is as sealed, not re-derived (written by a detllm that grouped replicas by an earlier rule)"
    if doc["command"] == "check":
        replicas = [_endpoint(folder, row) for row in doc["replicas"]]
    else:
        found = {row["index"]: side_at_hand(row["source"], folder) for row in doc["replicas"]}
        absent = [row["source"] for row in doc["replicas"] if found[row["index"]] is None]
        if absent:
            return (f"the fleet verdict is as sealed, not re-derived: side {absent[0]!r} is not at hand here "
                    "(an N-way diff's sides are outside its folder; verify it where they are)")
        replicas = [_side(row, found[row["index"]]) for row in doc["replicas"]]
    ref = (doc.get("reference") or {}).get("replica")
    expected = fleet_verdict(replicas, command=doc["command"], atol=doc["atol"], tier=doc["tier"]["requested"], reference=ref)
    for name in CHECKED:
        if as_written(doc.get(name)) != as_written(expected.get(name)):
            raise IntegrityError(f"{FLEET}: {name} is {_show(doc.get(name))}, but the replicas give {_show(expected.get(name))}",
                                 hint=_EDITED)
    whence = "the replica folders" if doc["command"] == "check" else "the sides it names"
    return f"fleet verdict re-derived from {whence}: {expected['status']} {expected['category']}"


def _endpoint(folder: Path, row: dict[str, Any]) -> Replica:
    """A fleet check's replica: a sealed, complete replica folder answered; any other failed, with the
    error fleet.json recorded (an endpoint's error cannot be re-derived offline)."""
    rep = Replica(index=row["index"], name=row["name"], source=row["source"], folder=row["folder"])
    path = folder / row["folder"] if row["folder"] else None
    if path is None or not (path / MANIFEST).is_file() or (path / PARTIAL).exists():
        if row["error"] is None:
            raise IntegrityError(f"{FLEET}: replica {row['index']} is recorded as answering, but its folder "
                                 f"{row['folder']!r} is not a sealed run", hint=_EDITED)
        rep.error = row["error"]
        return rep
    (rep.side,) = load_sides(Selection(path))
    rep.keys = prompt_keys(rep.side.records or [])
    rep.own = own_check(json.loads((path / "report.json").read_bytes())) if (path / "report.json").is_file() else None
    return rep


def side_at_hand(source: str, folder: Path) -> str | None:
    """An N-way diff's side as it was given, read from here, else beside the diff folder (where a
    relative path given to diff points when diff ran next to its --out); None when neither exists."""
    path, sep, sel = source.rpartition("::") if "::" in source else (source, "", "")
    for base in (Path(path), Path(folder).parent / path):
        if base.exists():
            return f"{base}{sep}{sel}"
    return None


def _side(row: dict[str, Any], where: str) -> Replica:
    sel = Selection.parse(where)
    (side,) = load_sides(sel)
    moved = where != row["source"]  # read from beside the diff folder: its label and folder as diff recorded them
    return Replica(index=row["index"], name=row["name"] if moved else side.label, source=row["source"], side=side,
                   folder=row["folder"] if moved else str(sel.folder), own=side_own(side, sel), keys=prompt_keys(side.records or []))


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


__all__ = ["rederive_fleet", "side_at_hand"]
