"""Where desired capacity goes, and what goes when there is too much. Pure.

`pick_node` chooses among the nodes the placement gate admits (the gate itself decides; this
only orders): the node a caller prefers (the one a rental just freed), then the least loaded
(fewest GPUs in use), then by id so the choice is the same every time.

`surplus` picks the workers to drain when a model has more than its desired count: starting
ones first (they serve nobody yet), then the newest ready ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from spotdrain.coordinator.core import worker_machine as wm
from spotdrain.coordinator.core.admission import NodeView, PlacementRequest, admit


def pick_node(
    views: Iterable[NodeView], request: PlacementRequest, prefer: str = ""
) -> tuple[str | None, dict[str, str]]:
    """(the chosen node or None, why the gate refused each other node)."""
    admitted, refused = [], {}
    for view in views:
        why = admit(view, request)
        if why is None:
            admitted.append(view)
        else:
            refused[view.node_id] = why
    if not admitted:
        return None, refused
    best = min(admitted, key=lambda v: (v.node_id != prefer, v.gpus_in_use, v.node_id))
    return best.node_id, refused


def surplus(serving: Sequence[wm.Worker], replicas: int) -> list[wm.Worker]:
    extra = len(serving) - max(replicas, 0)
    if extra <= 0:
        return []
    order = sorted(serving, key=lambda w: (w.state != wm.STARTING, -w.created_at, w.worker_id))
    return order[:extra]
