"""The fleet's nodes as placement and the critical path see them, in memory.

Rows, taints, avoided groups and booked rental GPUs are loaded once from the store
(recovery.rebuild) and updated on every write the coordinator makes, so a node's view is a few
dictionary lookups. Placement picks from a heap of (GPUs in use, node id) over the connected
nodes instead of viewing every node for every worker. Pure: no I/O.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from spotdrain.coordinator.placement import NodeView, PlacementRequest, admit
from spotdrain.coordinator.store import NodeRow, TaintRow

# A refusal summary in an event names at most this many nodes (plus counts by reason): one
# event must not carry a line per node of a 10,000-node fleet.
REFUSED_EXAMPLES = 20


class NodeIndex:
    def __init__(self, clock: Callable[[], float], workers_on: Callable[[str], int]) -> None:
        self.clock = clock
        self._workers_on = workers_on
        self.rows: dict[str, NodeRow] = {}
        self.taints: dict[str, dict[str, TaintRow]] = {}
        self.avoided: dict[str, float] = {}  # node group -> until
        self.rental_gpus: dict[str, int] = {}
        self.groups = Counter[str]()
        # One queue of commands per connected agent stream, and when each last spoke.
        self.streams: dict[str, asyncio.Queue[Any]] = {}
        self.connected: dict[str, float] = {}
        self._heap: list[tuple[int, str]] = []

    # --- loading and keeping up with writes ----------------------------------------------------

    def load(
        self,
        rows: Iterable[NodeRow],
        taints: dict[str, list[TaintRow]],
        avoided: dict[str, float],
        rental_gpus: dict[str, int],
    ) -> None:
        for row in rows:
            self.put(row)
        self.taints = {n: {t.reclaim_id: t for t in ts} for n, ts in taints.items()}
        self.avoided = dict(avoided)
        self.rental_gpus = dict(rental_gpus)

    def put(self, row: NodeRow) -> None:
        old = self.rows.get(row.node_id)
        if old is not None:
            self.groups[old.node_group] -= 1
        self.groups[row.node_group] += 1
        self.rows[row.node_id] = row

    def taint_added(self, row: TaintRow) -> None:
        self.taints.setdefault(row.node_id, {})[row.reclaim_id] = row

    def taint_removed(self, node_id: str, reclaim_id: str) -> None:
        taints = self.taints.get(node_id, {})
        taints.pop(reclaim_id, None)
        if not taints:
            self.taints.pop(node_id, None)

    def node_taints(self, node_id: str) -> list[TaintRow]:
        return sorted(self.taints.get(node_id, {}).values(), key=lambda t: (t.since, t.reclaim_id))

    def group_names(self) -> set[str]:
        return {g for g, n in self.groups.items() if n > 0}

    def avoided_now(self) -> dict[str, float]:
        now = self.clock()
        return {g: t for g, t in self.avoided.items() if t > now}

    # --- connection --------------------------------------------------------------------------

    def connect(self, node_id: str, queue: asyncio.Queue[Any]) -> None:
        self.streams[node_id] = queue
        self.connected[node_id] = self.clock()
        self.load_changed(node_id)

    def disconnect(self, node_id: str, queue: asyncio.Queue[Any]) -> bool:
        """Only the stream that is current: a reconnect may have replaced it already."""
        if self.streams.get(node_id) is not queue:
            return False
        del self.streams[node_id]
        self.connected.pop(node_id, None)
        return True

    # --- the view the gate judges, and the pick ---------------------------------------------

    def gpus_in_use(self, node_id: str) -> int:
        # One GPU per worker and a rental's own count: promised GPUs are in use from the moment
        # of placement, so nothing is double-booked.
        return self._workers_on(node_id) + self.rental_gpus.get(node_id, 0)

    def load_changed(self, node_id: str) -> None:
        if node_id in self.streams:
            heapq.heappush(self._heap, (self.gpus_in_use(node_id), node_id))
            if len(self._heap) > 4 * len(self.streams) + 64:
                self._compact()

    def _compact(self) -> None:
        self._heap = [(self.gpus_in_use(n), n) for n in self.streams]
        heapq.heapify(self._heap)

    def view(self, node_id: str) -> NodeView | None:
        row = self.rows.get(node_id)
        if row is None:
            return None
        until = self.avoided.get(row.node_group)
        return NodeView(
            node_id=node_id,
            workload_enabled=row.workload_enabled,
            tainted=bool(self.taints.get(node_id)),
            spot=row.spot,
            connected=node_id in self.streams,
            gpus_total=max(len(row.gpus), 1),
            gpus_in_use=self.gpus_in_use(node_id),
            group_avoided=until is not None and until > self.clock(),
        )

    def pick(self, request: PlacementRequest, prefer: str = "") -> tuple[str | None, dict]:
        """The node a placement goes to: `prefer` if the gate admits it, else the least loaded
        connected node the gate admits (ties by id); and why the nodes looked at refused."""
        refused: dict[str, str] = {}
        if prefer and (view := self.view(prefer)) is not None and view.connected:
            why = admit(view, request)
            if why is None:
                return prefer, refused
            refused[prefer] = why
        looked: list[tuple[int, str]] = []
        chosen = None
        seen: set[str] = set()
        while self._heap:
            load, node_id = heapq.heappop(self._heap)
            if node_id in seen or node_id not in self.streams:
                continue
            if load != self.gpus_in_use(node_id):
                continue  # stale: the node's load changed and a newer entry is in the heap
            seen.add(node_id)
            looked.append((load, node_id))
            view = self.view(node_id)
            why = "unknown_node" if view is None else admit(view, request)
            if why is None:
                chosen = node_id
                break
            refused[node_id] = why
        for entry in looked:
            heapq.heappush(self._heap, entry)
        return chosen, refused


def summarize_refusals(refused: dict[str, str]) -> dict[str, Any]:
    """Why nodes said no, bounded: every node when there are few, else counts and examples."""
    if len(refused) <= REFUSED_EXAMPLES:
        return dict(refused)
    by_reason = Counter(refused.values())
    examples = dict(sorted(refused.items())[:REFUSED_EXAMPLES])
    return {"nodes": len(refused), "by_reason": dict(by_reason), "examples": examples}
