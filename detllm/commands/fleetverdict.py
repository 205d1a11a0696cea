"""The N-way verdict: N replicas' traces grouped per prompt, the majority and the outliers, an
identity mismatch named first, and replicas that agree with each other but move with their own
batch, concurrency or cache (their own check's verdict). Every pair is compared by diff.diff_report
at one tier chosen before grouping; this module only groups what it found. Reads sides, writes
nothing; here, below fleet/, so that `verify` re-derives a fleet verdict with the same function.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

from ..runfolder import artifacts
from ..compare.causes import Side
from ..compare.causes.codes import TITLES
from ..compare.fleetidentity import NOT_IDENTITY_OPTIONS as ADDRESS_FIELDS
from ..compare.fleetidentity import identity_groups
from ..runfolder.env import detllm_version
from .diff import Selection, diff_report

# most fundamental first: the category a fleet report leads with (docs/fleet.md)
CATEGORIES = ("IDENTITY_MISMATCH", "UNSTABLE", "OUTLIER", "NO_MAJORITY", "MISSING_PROMPTS", "ENDPOINT_ERROR",
              "AGREE_BUT_VARIANT", "AGREE")
# fleet.json's "grouping": the rule its groups were made by. Its presence says the verdict can be
# re-derived by this module (verify); a fleet.json without it was grouped by an earlier rule
GROUPING = "one_tier_every_member"
VERDICTS = {
    "IDENTITY_MISMATCH": "replicas differ in what they serve (model, build or server settings); see identity",
    "UNSTABLE": "most replicas differ from their own repeats at this setting: differences between replicas are not "
                "attributed to any of them (see each one's own check)",
    "OUTLIER": "the named replicas disagree with the majority",
    "NO_MAJORITY": "the replicas split with no majority: no outlier can be named; see the groups",
    "MISSING_PROMPTS": "the replicas agree where they overlap, but some have no record of prompts others have "
                       "(see each prompt's missing)",
    "ENDPOINT_ERROR": "the replicas that answered agree, but some failed or timed out",
    "AGREE_BUT_VARIANT": "all replicas agree with each other, but batch, concurrency, cache or repeats move each of them",
    "AGREE": "all replicas agree",
}

REFERENCE_OUTLIER = "the named replicas disagree with the reference replica (--reference-url)"

# an outlier whose recorded identity and settings equal the majority's: what is left is unrecorded
UNEXPLAINED = ("nothing recorded explains it: the identities match and the pairwise diff names no cause that tells "
               "replicas apart (see set_aside); what differs is not visible to a client (launch flags such as flash "
               "attention, hardware, or corrupted data)")


@dataclass
class Replica:
    """One side of the fleet: an endpoint's run folder or a folder given to diff."""

    index: int
    name: str  # replica_<i> for an endpoint; the side's label for a folder
    source: str  # the endpoint URL (credential-free) or the side as given
    side: Side | None = None  # None: the replica failed
    folder: str | None = None
    error: dict[str, Any] | None = None  # {"kind": unreachable|timeout|error, "exit_code", "message"}
    own: dict[str, Any] | None = None  # its own check's {"status", "category", "repeats_differ"}, when it ran a check
    keys: dict[int, tuple[str, int]] = field(default_factory=dict)  # prompt_index -> (prompt_id, occurrence)


def own_check(report: dict[str, Any]) -> dict[str, Any] | None:
    """A check's own verdict, and whether its repeats at its base batch size differ (its comparisons of
    kind "run"): None for anything but a check."""
    if report.get("command") != "check":
        return None
    runs = [c for c in report.get("comparisons", []) if c.get("kind") == "run"]
    return {"status": report.get("status"), "category": report.get("category"),
            "repeats_differ": any(c["status"] != "PASS" for c in runs) if runs else None}


def side_own(side: Side, sel: Selection) -> dict[str, Any] | None:
    """A check folder's own verdict (status, category), to tell replica variance apart. Whether its
    repeats differ is judged only for a side given as the whole folder (run 0 at the base batch size):
    a side that selects run_N or batch_B is itself one of the repeats being compared."""
    try:
        rep = json.loads((Path(side.folder) / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return None
    own = own_check(rep) if isinstance(rep, dict) else None
    if own is not None and (sel.run is not None or sel.batch is not None):
        own["repeats_differ"] = None
    return own


def prompt_keys(records: list[dict[str, Any]]) -> dict[int, tuple[str, int]]:
    """Each record's prompt as (prompt_id, occurrence): how compare.engine.align pairs them."""
    seen: dict[str, int] = {}
    out = {}
    for r in sorted(records, key=lambda r: r["prompt_index"]):
        n = seen.get(r["prompt_id"], 0)
        seen[r["prompt_id"]] = n + 1
        out[r["prompt_index"]] = (r["prompt_id"], n)
    return out


def _pair(a: Replica, b: Replica, atol: float, tier: int | None) -> tuple[dict[str, Any], set[tuple[str, int]]]:
    """diff_report(a, b) and the prompts (keys) where the two differ or one lacks the prompt."""
    assert a.side is not None and b.side is not None
    report = diff_report(a.side, b.side, atol=atol, tier=tier)
    comp = report["comparisons"][0]
    differ = {a.keys[d["prompt_index"]] for d in comp["divergences"]}
    differ |= {a.keys[i] for i in comp["unmatched"]["left_only"]} | {b.keys[i] for i in comp["unmatched"]["right_only"]}
    return report, differ


class _Pairs:
    """The pairs compared so far, each once (diff.diff_report, as `detllm diff A B --tier T` would),
    all at the one tier chosen before grouping, so "equal" is the same relation for every pair."""

    def __init__(self, replicas: dict[int, Replica], atol: float, tier: int | None) -> None:
        self.replicas, self.atol, self.tier = replicas, atol, tier
        self.done: dict[tuple[int, int], tuple[dict[str, Any], set[tuple[str, int]]]] = {}

    def _get(self, x: int, y: int) -> tuple[dict[str, Any], set[tuple[str, int]]]:
        key = (min(x, y), max(x, y))
        if key not in self.done:
            self.done[key] = _pair(self.replicas[key[0]], self.replicas[key[1]], self.atol, self.tier)
        return self.done[key]

    def differ(self, x: int, y: int) -> set[tuple[str, int]]:
        return self._get(x, y)[1]

    def report(self, x: int, y: int) -> dict[str, Any]:
        return self._get(x, y)[0]

    def summaries(self) -> list[dict[str, Any]]:
        return [_pair_summary(self.replicas[a], self.replicas[b], self.done[(a, b)][0]) for a, b in sorted(self.done)]


def common_tier(sides: list[Side], tier: int | None) -> tuple[int | None, int | None]:
    """(requested, effective) for every pair: --tier, else the lowest tier any side was recorded at;
    logprobs only where every side recorded them. Chosen before grouping, whatever the order."""
    if not sides:
        return tier, None
    requested = tier if tier is not None else max(1, min(s.applied["tier_effective"] for s in sides))
    logprobs = all(s.applied["capabilities"]["logprobs"] for s in sides)
    return requested, requested if requested < 2 or logprobs else 1


def _labels(n: int) -> list[str]:
    letters = string.ascii_uppercase
    return [letters[i] if i < 26 else f"G{i}" for i in range(n)]


def _cluster(members: list[int], equal) -> tuple[list[list[int]], list[int]]:
    """(groups, chained): the replicas that are equal to each other, whatever their order. Groups are
    the connected parts of the "equal" relation in which every pair is equal (compared with every
    member, not the first); a part where some pair differs (a chain within --atol: a~b, b~c, a!~c)
    is not a group: each of its replicas stands alone and is listed in `chained`. Largest first."""
    parts: list[list[int]] = []
    for m in sorted(members):
        joined = [p for p in parts if any(equal(x, m) for x in p)]
        for p in joined:
            parts.remove(p)
        parts.append(sorted([m, *[x for p in joined for x in p]]))
    groups, chained = [], []
    for p in parts:
        if all(equal(x, y) for i, x in enumerate(p) for y in p[i + 1:]):
            groups.append(p)
        else:
            groups.extend([x] for x in p)
            chained.extend(p)
    return sorted(groups, key=lambda g: (-len(g), g[0])), sorted(chained)


def _majority(groups: list[list[int]], present: int, reference: int | None = None) -> list[int] | None:
    """The group holding more than half of the `present` replicas; with a reference replica, the
    group holding the reference (None when the reference is not among them)."""
    if reference is not None:
        return next((g for g in groups if reference in g), None)
    return groups[0] if groups and 2 * len(groups[0]) > present else None


def _first(groups: list[list[int]], major: list[int] | None) -> list[list[int]]:
    """The majority (or the reference's) group first, so that it is labelled A."""
    return ([major] + [g for g in groups if g is not major]) if major else groups


def fleet_verdict(replicas: list[Replica], *, command: str, atol: float = 0.0, tier: int | None = None,
                  reference: int | None = None) -> dict[str, Any]:
    """fleet.json's body: per-prompt groups, replica groups, majority, outliers, identity, pairs.
    `reference`: the index of the replica the others are judged against (check --reference-url);
    None: the majority of the replicas that have each prompt."""
    ok = [r for r in replicas if r.side is not None]
    ref = reference if reference is not None and any(r.index == reference for r in ok) else None
    requested, effective = common_tier([r.side for r in ok if r.side is not None], tier)
    pairs = _Pairs({r.index: r for r in ok}, atol, effective)
    order: list[tuple[str, int]] = []
    for r in ok:
        for k in (r.keys[i] for i in sorted(r.keys)):
            if k not in order:
                order.append(k)
    held = {r.index: set(r.keys.values()) for r in ok}
    first_index = {k: i for i, k in sorted(ok[0].keys.items(), reverse=True)} if ok else {}  # the reference's prompt_index
    prompts = []
    for key in order:
        present = [r.index for r in ok if key in held[r.index]]
        groups, chained = _cluster(present, lambda x, y, key=key: key not in pairs.differ(x, y))
        missing = [r.index for r in ok if r.index not in present]  # reported as missing, never as an outlier
        major = _majority(groups, len(present), ref)  # over the replicas that have the prompt (docs/fleet.md)
        groups = _first(groups, major)
        index = first_index.get(key)
        entry = {"prompt_id": key[0], "occurrence": key[1], "prompt_index": index,
                 "groups": [{"label": lab, "replicas": g} for lab, g in zip(_labels(len(groups)), groups)],
                 "majority": "A" if major else None,
                 "outliers": sorted(m for g in groups[1:] for m in g) if major else [],
                 "missing": missing}
        if chained:
            entry["chained"] = chained
        prompts.append(entry)
    # replicas with the same group at every prompt hold identical traces: one replica group
    sig = {r.index: tuple(next((g["label"] for g in p["groups"] if r.index in g["replicas"]), "-") for p in prompts) for r in ok}
    rgroups, _ = _cluster([r.index for r in ok], lambda x, y: sig[x] == sig[y])
    rmajor = _majority(rgroups, len(ok), ref)
    rgroups = _first(rgroups, rmajor)
    # a replica whose own repeats differ at the compared setting: most such, and no difference between
    # replicas can be told from run-to-run variation, so no outlier is named
    unstable = [r.index for r in ok if r.own and r.own.get("repeats_differ")]
    too_unstable = 2 * len(unstable) > len(ok)
    if too_unstable:
        for p in prompts:
            p["outliers"] = []
    outliers = sorted({m for p in prompts for m in p["outliers"]})
    split = [p["prompt_index"] if p["prompt_index"] is not None else p["prompt_id"] for p in prompts
             if len(p["groups"]) > 1 and not p["majority"]]
    missing = any(p["missing"] for p in prompts)
    ident = identity_groups({r.index: r.side for r in ok})
    errors = [r for r in replicas if r.error is not None]
    variant = [{"replica": r.index, **r.own} for r in ok if r.own and r.own.get("status") == "FAIL"]
    if ident["mismatched"] or (len(ident["groups"]) > 1 and len(ok) > 1):
        category = "IDENTITY_MISMATCH"
    elif too_unstable and any(len(p["groups"]) + bool(p["missing"]) > 1 for p in prompts):
        category = "UNSTABLE"
    elif outliers:
        category = "OUTLIER"
    elif split:
        category = "NO_MAJORITY"
    elif missing:
        category = "MISSING_PROMPTS"
    elif errors:
        category = "ENDPOINT_ERROR"
    elif variant:
        category = "AGREE_BUT_VARIANT"
    else:
        category = "AGREE"
    if len(ok) < 2 and category == "AGREE":
        category = "ENDPOINT_ERROR"  # nothing was compared: fewer than two replicas answered
    explained = _explain(rgroups, rmajor, pairs)
    rows = []
    for r in replicas:
        grp = next((lab for lab, g in zip(_labels(len(rgroups)), rgroups) if r.index in g), None)
        rows.append({"index": r.index, "name": r.name, "source": r.source, "folder": r.folder,
                     "status": "ok" if r.side is not None else "error", "error": r.error, "group": grp,
                     "outlier": r.index in outliers, "identity_mismatch": r.index in ident["mismatched"], "unstable": r.index in unstable,
                     "own_check": r.own, "records": len(r.side.records or ()) if r.side is not None else 0,
                     "prompts_outside_majority": [p["prompt_index"] for p in prompts if r.index in p["outliers"]]})
    summaries = pairs.summaries()
    return artifacts.stamp("fleet", {
        "detllm_version": detllm_version(), "created_at": artifacts.utc_now(), "command": command,
        "status": "PASS" if category == "AGREE" else "FAIL", "category": category,
        "verdict": REFERENCE_OUTLIER if ref is not None and category == "OUTLIER" else VERDICTS[category],
        "tier": {"requested": requested, "effective": effective}, "atol": atol, "grouping": GROUPING,
        **({} if reference is None else {"reference": {"replica": reference, "used": ref is not None}}),
        "replicas": rows,
        "groups": [{"label": lab, "replicas": g} for lab, g in zip(_labels(len(rgroups)), rgroups)],
        "majority": ({"label": "A", "replicas": rmajor} if rmajor else None),
        "outliers": outliers, "no_majority_prompts": split,
        "prompts": prompts, "identity": ident, "variance": variant,
        "errors": [{"replica": r.index, **(r.error or {})} for r in errors],
        "explanations": explained, "pairs": summaries,
        "not_compared": [f"replica {r.index} ({r.name}): {r.error['kind']}" for r in errors if r.error],
    })


def _pair_summary(a: Replica, b: Replica, rep: dict[str, Any]) -> dict[str, Any]:
    comp = rep["comparisons"][0]
    d = comp["first_divergence"]
    drift = comp["drift"]
    return {"left": a.index, "right": b.index, "status": rep["status"], "tier_effective": rep["tier"]["effective"],
            "prompts_compared": comp["prompts_compared"], "prompts_diverged": comp["prompts_diverged"],
            "first_divergence": ({"prompt_index": d["prompt_index"], "token_index": d["token_index"], "kind": d["kind"]} if d else None),
            "max_abs_logprob_diff": drift.get("max_abs_logprob_diff") if drift.get("available") else None,
            "magnitude": rep["magnitude"]["label"], "top_cause": rep["causes"][0]["code"] if rep["causes"] else None}


def _set_aside(cause: dict[str, Any]) -> str | None:
    """Why a pairwise cause explains nothing between replicas, or None when it may. Every replica has
    its own address (--base-url); and a batch cause whose sides ran the same batch size with the same
    composition rests only on the servers' sampled busy counts (/slots, /metrics), which a sampler
    that missed a short request reads as 0."""
    ev = cause.get("evidence", {})
    fields = ev.get("fields")
    if fields and all(str(f.get("field", "")).rsplit(".", 1)[-1] in ADDRESS_FIELDS for f in fields) and not ev.get("applied"):
        return "only the replicas' addresses differ"
    size = ev.get("batch_size") or {}
    if cause["code"] == "BATCH_VARIANCE" and size.get("left") == size.get("right") and not ev.get("composition_changed"):
        return "the same batch size and composition on both replicas; only the sampled server busy counts differ"
    return None


def _explain(rgroups: list[list[int]], rmajor: list[int] | None, pairs: _Pairs) -> list[dict[str, Any]]:
    """What the pairwise diff's causes say about each minority group against the majority (its first
    members): the ranked cause codes, as `detllm diff MAJORITY GROUP` would rank them."""
    if not rmajor:
        return []
    out = []
    for lab, g in zip(_labels(len(rgroups))[1:], rgroups[1:]):
        rep = pairs.report(rmajor[0], g[0])
        why = {id(c): _set_aside(c) for c in rep["causes"]}
        causes = [c for c in rep["causes"] if why[id(c)] is None]
        out.append({"group": lab, "replicas": g, "against": rmajor[0],
                    "causes": [{"code": c["code"], "title": TITLES.get(c["code"], "")} for c in causes[:3]],
                    "set_aside": [{"code": c["code"], "why": why[id(c)]} for c in rep["causes"] if why[id(c)] is not None],
                    "note": None if causes else UNEXPLAINED, "magnitude": rep["magnitude"]["label"],
                    "max_abs_logprob_diff": _pair_summary(pairs.replicas[rmajor[0]], pairs.replicas[g[0]], rep)["max_abs_logprob_diff"]})
    return out


__all__ = ["CATEGORIES", "GROUPING", "VERDICTS", "Replica", "common_tier", "fleet_verdict", "own_check", "prompt_keys", "side_own"]
