"""`detllm report --format kld FLEET [--reference replica_N]`: llama-perplexity's KLD block of each
replica of a fleet folder against one reference replica (default: the first member of the majority
group, or the reference a check was given with --reference-url). Reads the fleet folder (or its
unpacked pack); each block is handed in by report.py (compare/kld's statistics, render/kld's text).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.errors import UsageError
from ..runfolder import artifacts
from ..runfolder.fleetseal import FLEET
from .diff import Selection
from .fleetverify import side_at_hand


def fleet_kld(folder: Path, reference: str | None, block: Callable[[Selection, Selection], str]) -> str:
    """Each answering replica's KLD block against the reference, in replica order; `block(reference,
    replica)` renders one (report.py: render/kld of report.kld_document)."""
    doc = artifacts.read_json(folder / FLEET, "fleet")
    ref = _reference(doc, reference)
    out = [f"detllm fleet KLD: each replica against the reference, replica {ref['index']} {ref['name']} "
           f"({ref['source']}); fleet verdict {doc['status']} {doc['category']}", ""]
    for r in doc["replicas"]:
        if r["index"] == ref["index"]:
            continue
        head = f"== replica {r['index']} {r['name']} ({r['source']}) vs replica {ref['index']}"
        if r["status"] != "ok":
            out += [head, f"not compared: it failed ({r['error']['kind']}: {r['error']['message']})", ""]
            continue
        out += [head, block(_selection(folder, doc, ref), _selection(folder, doc, r)).rstrip("\n"), ""]
    return "\n".join(out)


def _reference(doc: dict[str, Any], given: str | None) -> dict[str, Any]:
    rows = doc["replicas"]
    if given is not None:
        name = given.strip()
        row = next((r for r in rows if name in (r["name"], f"replica_{r['index']}", str(r["index"]), r["source"])), None)
        if row is None:
            raise UsageError(f"--reference {given!r} names no replica of this fleet",
                             hint="give replica_N (N from 0 to " + str(len(rows) - 1) + ") or a replica's name")
        if row["status"] != "ok":
            raise UsageError(f"--reference {given!r} failed in this fleet ({row['error']['kind']}): it has no trace",
                             hint="choose a replica that answered")
        return row
    ref = doc.get("reference") or {}
    if ref.get("used"):
        return rows[ref["replica"]]
    if doc["majority"]:
        return next(r for r in rows if r["index"] == doc["majority"]["replicas"][0])
    raise UsageError("this fleet has no majority group to take the reference from", hint="name one: --reference replica_N")


def _selection(folder: Path, doc: dict[str, Any], row: dict[str, Any]) -> Selection:
    """A fleet check's replica folder (inside the fleet folder); an N-way diff's side as it was given."""
    if doc["command"] == "check":
        return Selection(folder / row["folder"])
    where = side_at_hand(row["source"], folder)
    if where is None:
        raise UsageError(f"the N-way diff's side {row['source']!r} is not at hand here (a diff folder holds no trace)",
                         hint="run it where the sides are, or detllm report --format kld LEFT RIGHT")
    return Selection.parse(where)


__all__ = ["fleet_kld"]
