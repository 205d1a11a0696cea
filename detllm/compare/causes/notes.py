"""What a comparison of two folders could not compare, and the differences that are never
causes (`Notes`): fields redefined between two schema versions, or recorded by one version
only, are listed as not compared instead of being judged. Judges no difference itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...core import versions
from .sides import ABSENT, Side

_STAMPS = ("schema_version", "artifact_type")


@dataclass
class Notes:
    """What a comparison of two folders could not compare, and differences that are never
    causes. Filled while the detectors run; diff puts both in report.json."""

    versions: tuple[str, str] = ("2", "2")
    not_compared: list[dict[str, Any]] = field(default_factory=list)
    inert: list[dict[str, Any]] = field(default_factory=list)

    def skip(self, name: str, reason: str) -> None:
        if all(n["field"] != name for n in self.not_compared):
            self.not_compared.append({"field": name, "reason": reason})

    def note(self, d: dict[str, Any], why: str) -> None:
        if all(n["field"] != d["field"] for n in self.inert):
            self.inert.append({"field": d["field"], "left": d["left"], "right": d["right"], "why": why})

    def screen(self, diffs: list[dict[str, Any]], artifact: str) -> list[dict[str, Any]]:
        """Differences both sides recorded with the same meaning. Dropped: stamps; across
        schema versions, fields redefined between them (versions.REDEFINED) and fields one
        version does not record; each dropped field is listed in not_compared."""
        lv, rv = self.versions
        out = []
        for d in diffs:
            if d["field"] in _STAMPS:
                continue
            full = f"{artifact}.{d['field']}"
            if lv != rv:
                change = next((c for c in versions.changes_between(lv, rv) if _under(full, c.field)
                               or any(_under(full, w) for w in getattr(c, "was", ()) or ())), None)
                if change is not None:
                    self.skip(change.field, f"redefined in version {change.since}: {change.what}")
                    continue
                if ABSENT in (d["left"], d["right"]):
                    have = lv if d["right"] == ABSENT else rv
                    self.skip(full, f"recorded by version {have} only")
                    continue
            out.append(d)
        return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".") or name.startswith(prefix + "[")


def schema_versions(left: Side, right: Side) -> tuple[str, str]:
    return tuple(str((s.run_config or {}).get("schema_version", versions.CURRENT)) for s in (left, right))  # type: ignore[return-value]
