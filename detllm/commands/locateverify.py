"""verify of a sealed folder's locate.json (locate's own folder, or a run or diff folder it was written
into): the op it names against the per-module rows it records. Owns that check and the sentence
saying what is not re-derived (the captures themselves: locate re-ran the engine). Reads JSON only.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..core.errors import IntegrityError

LOCATE = "locate.json"
_EDITED = "locate.json was edited after it was written; run locate again"


def rederive_locate(folder: Path) -> str | None:
    """None without a locate.json; else what was re-derived, in words. Raises IntegrityError when the
    recorded first op does not follow from the rows recorded (the rule of locate/rule.py: the first row,
    in execution order, whose output differs while its inputs agree)."""
    p = Path(folder) / LOCATE
    if not p.is_file():
        return None
    doc = json.loads(p.read_bytes())
    rows = sorted(doc.get("layers") or [], key=lambda r: r["order"])
    said = doc.get("first_bitwise_op")
    own = [r for r in rows if r.get("output_equal") is False and r.get("inputs_equal") is True]
    tail = "; not re-derived: the captured tensors themselves (locate re-ran the engine; run it again to re-capture)"
    if said is None:
        if own and doc.get("status") == "located":
            raise IntegrityError(f"{LOCATE}: status is 'located' but it names no op", hint=_EDITED)
        return f"{LOCATE}: status {doc.get('status')!r}, no op named" + tail
    names = {r["module"] for r in rows}
    if said["module"] not in names:  # an op inside a module, from the op-granularity pass: its rows are not recorded
        return f"{LOCATE}: the op it names ({said['module']}) is below the recorded module rows, not re-derived" + tail
    if not own or own[0]["module"] != said["module"]:
        first = own[0]["module"] if own else "none"
        raise IntegrityError(f"{LOCATE}: first_bitwise_op is {said['module']!r}, but its recorded rows give {first!r} "
                             f"(the first whose output differs while its inputs agree)", hint=_EDITED)
    return f"{LOCATE}: first op {said['module']} re-derived from its {len(rows)} recorded module rows" + tail


__all__ = ["rederive_locate"]
