"""Where the checks of `check --ray --per …` run: one target per alive node (`node`, pinned by node id,
hard), per accelerator type (`accelerator_type`: each `accelerator_type:<T>` resource, requested in a
sliver so the task lands on a node of that type) or per `resource:NAME` (each `NAME:<V>` resource, or
each node holding NAME itself). Reads the node table ray.nodes() gives; imports no ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core.errors import UsageError

SLIVER = 0.001  # of a label resource: enough to select its nodes, never enough to queue behind another task
ACCELERATOR = "accelerator_type"


@dataclass(frozen=True)
class Target:
    """One replica's placement: a node id (hard affinity) or a resource to request."""

    label: str  # what the fleet report names it by
    node_id: str | None = None
    resources: dict[str, float] = field(default_factory=dict)


def parse_per(per: str) -> tuple[str, str | None]:
    """`node`, `accelerator_type` or `resource:NAME` → (kind, NAME)."""
    if per in ("node", ACCELERATOR):
        return per, None
    if per.startswith("resource:") and per.split(":", 1)[1]:
        return "resource", per.split(":", 1)[1]
    raise UsageError(f"--per must be node, accelerator_type or resource:NAME, got {per!r}")


def accelerator_of(resources: dict[str, Any]) -> str | None:
    """A node's accelerator type: its accelerator_type:<T> resource (Ray sets it for GPU nodes)."""
    kinds = sorted(k.split(":", 1)[1] for k in resources if k.startswith(ACCELERATOR + ":"))
    return ",".join(kinds) or None


def plan(nodes: list[dict[str, Any]], per: str, num_cpus: float, num_gpus: float = 0) -> list[Target]:
    """The targets over the alive nodes of ray.nodes() that can hold one task (so none waits forever
    for resources no node has); fewer than two: a usage error naming what the cluster has."""
    kind, name = parse_per(per)
    alive = [n for n in nodes if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) >= num_cpus
             and n.get("Resources", {}).get("GPU", 0) >= num_gpus]
    if kind == "node":
        targets = [Target(f"node {n['NodeID'][:12]} {n.get('NodeManagerAddress', '?')}"
                          + (f" accelerator_type:{acc}" if (acc := accelerator_of(n["Resources"])) else ""), node_id=n["NodeID"])
                   for n in sorted(alive, key=lambda n: n["NodeID"])]
    else:
        prefix = (ACCELERATOR if kind == ACCELERATOR else name) + ":"
        labels = sorted({k for n in alive for k in n["Resources"] if k.startswith(prefix)})
        targets = [Target(label, resources={label: SLIVER}) for label in labels]
        if not targets and kind == "resource":
            targets = [Target(f"node {n['NodeID'][:12]} {n.get('NodeManagerAddress', '?')} {name}", node_id=n["NodeID"],
                              resources={name: SLIVER}) for n in sorted(alive, key=lambda n: n["NodeID"]) if name in n["Resources"]]
    if len(targets) < 2:
        have = sorted({k for n in alive for k in n["Resources"] if ":" in k and not k.startswith("node:")})
        raise UsageError(f"--per {per} finds {len(targets)} target(s) on the cluster ({len(alive)} alive node(s) with "
                         f"{num_cpus:g} CPU and {num_gpus:g} GPU to give a task); a comparison needs two or more",
                         hint=f"its labelled resources: {', '.join(have) or 'none'}")
    return targets


__all__ = ["Target", "accelerator_of", "parse_per", "plan"]
