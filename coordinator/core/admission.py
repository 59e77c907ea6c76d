"""The one placement gate (docs/design.md invariant 4).

Every path that can put a workload on a node calls `admit`: an operator's scheduling request, a
rental's creation, a worker restarted after a rental ends, the recovery loop (a missing worker
replaced, desired capacity kept), a node reporting its hardware after a reboot, an owner's
resume. The rules are the same for every path; the path is part of the request so that a refusal
can be logged with it, never to relax a rule.

Pure and quick: a view of the node and a request in, a refusal reason (a stable code) or None.
"""

from __future__ import annotations

from dataclasses import dataclass

from spotdrain.protocol import kinds

PATHS = (
    "operator",
    "rental",
    "rental_end_restart",
    "recovery",
    "reregistration",
    "resume",
    "node_lost",  # capacity a lost node held, placed elsewhere (coordinator/fleet/lost.py)
    "node_returned",  # a lost node back: what the fleet wants, this node first
)

# Refusal reasons, checked in this order: the node's switches first (the owner's pause and a
# provider's notice win over everything), then policy, then reachability, then capacity.
WORKLOAD_DISABLED = "workload_disabled"
TAINTED = "tainted"
AT_RISK = "at_risk"  # its agent reported an advisory: replacements go elsewhere, nothing new here
RENDER_ON_SPOT = "render_on_spot"
# Its image cannot honour the workload contract (coordinator/capacity/contracts.py) and the
# coordinator runs with --no-spot-for-flagged.
CONTRACT_FLAGGED = "contract_flagged"
GROUP_AVOIDED = "group_avoided"  # its group was reclaimed recently (acquirer.AvoidanceWindow)
NOT_CONNECTED = "not_connected"
NOT_ENOUGH_GPUS = "not_enough_gpus"


@dataclass(frozen=True)
class NodeView:
    """What placement needs to know of a node, as the coordinator stores it now."""

    node_id: str
    workload_enabled: bool
    tainted: bool
    spot: bool
    connected: bool
    gpus_total: int
    gpus_in_use: int  # includes GPUs promised to placements not yet started: no double booking
    group_avoided: bool = False
    at_risk: bool = False


@dataclass(frozen=True)
class PlacementRequest:
    kind: str
    gpus: int = 1
    path: str = "operator"
    off_spot: bool = False  # policy keeps this workload off spot nodes (a flagged contract)

    def __post_init__(self) -> None:
        if self.kind not in kinds.ALL:
            raise ValueError(f"workload kind must be one of {kinds.ALL}, got {self.kind!r}")
        if self.path not in PATHS:
            raise ValueError(f"placement path must be one of {PATHS}, got {self.path!r}")
        if self.gpus < 0:
            raise ValueError(f"a placement cannot ask for {self.gpus} GPUs")


def admit(node: NodeView, request: PlacementRequest) -> str | None:
    """None when `request` may be placed on `node`; otherwise why not (one of the codes above)."""
    if not node.workload_enabled:
        return WORKLOAD_DISABLED
    if node.tainted:
        return TAINTED
    if node.at_risk:
        return AT_RISK
    if request.kind == "render" and node.spot:
        return RENDER_ON_SPOT
    if request.off_spot and node.spot:
        return CONTRACT_FLAGGED
    if node.group_avoided:
        return GROUP_AVOIDED
    if not node.connected:
        return NOT_CONNECTED
    if request.gpus > max(0, node.gpus_total - node.gpus_in_use):
        return NOT_ENOUGH_GPUS
    return None
