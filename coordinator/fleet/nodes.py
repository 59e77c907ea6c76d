"""The fleet's nodes as placement and the critical path see them, in memory.

Rows, taints, avoided groups and booked rental GPUs are loaded once from the store
(recovery.rebuild) and updated on every write the coordinator makes, so a node's view is a few
dictionary lookups. Placement picks from a heap of (GPUs in use, node id) over the connected
nodes instead of viewing every node for every worker. Pure: no I/O.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from spotdrain.coordinator.core.admission import NodeView, PlacementRequest, admit
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
        # Nodes whose agents reported an advisory: node -> {advisory key: until}.
        self.risks: dict[str, dict[str, float]] = {}
        self.rental_gpus: dict[str, int] = {}
        self.groups = Counter[str]()
        # One queue of commands per connected agent stream, and when each last spoke.
        self.streams: dict[str, asyncio.Queue[Any]] = {}
        self.connected: dict[str, float] = {}
        # Per node group: a heap of (GPUs in use, node id) over its connected nodes. A group
        # the gate avoids is skipped whole, not node by node.
        self._heaps: dict[str, list[tuple[int, str]]] = {}
        # Told when a node's stream opens (True) or closes (False): the deadline heap arms or
        # cancels the node's node-gone time there (coordinator/fleet/recovery.py).
        self.on_connection: Callable[[str, bool], None] = lambda node_id, connected: None

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
        self.on_connection(node_id, True)

    def disconnect(self, node_id: str, queue: asyncio.Queue[Any]) -> bool:
        """Only the stream that is current: a reconnect may have replaced it already."""
        if self.streams.get(node_id) is not queue:
            return False
        del self.streams[node_id]
        self.connected.pop(node_id, None)
        self.on_connection(node_id, False)
        return True

    # --- the view the gate judges, and the pick ---------------------------------------------

    def gpus_in_use(self, node_id: str) -> int:
        # One GPU per worker and a rental's own count: promised GPUs are in use from the moment
        # of placement, so nothing is double-booked.
        return self._workers_on(node_id) + self.rental_gpus.get(node_id, 0)

    def _group(self, node_id: str) -> str:
        row = self.rows.get(node_id)
        return row.node_group if row is not None else ""

    def load_changed(self, node_id: str) -> None:
        if node_id not in self.streams:
            return
        group = self._group(node_id)
        heap = self._heaps.setdefault(group, [])
        heapq.heappush(heap, (self.gpus_in_use(node_id), node_id))
        if len(heap) > 4 * self.groups.get(group, 0) + 64:
            self._compact(group)

    def _compact(self, group: str) -> None:
        heap = [(self.gpus_in_use(n), n) for n in self.streams if self._group(n) == group]
        heapq.heapify(heap)
        self._heaps[group] = heap

    def _valid(self, group: str, entry: tuple[int, str]) -> bool:
        load, node_id = entry
        # Stale entries (the node left, changed group or load) are dropped where they surface;
        # a current one was pushed when the change happened.
        return (
            node_id in self.streams
            and self._group(node_id) == group
            and load == self.gpus_in_use(node_id)
        )

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
            at_risk=self.at_risk(node_id),
        )

    def at_risk(self, node_id: str) -> bool:
        """Whether an advisory reported by the node's agent is still in force."""
        risks = self.risks.get(node_id)
        if not risks:
            return False
        now = self.clock()
        return any(until > now for until in risks.values())

    def risky(self) -> list[str]:
        """The nodes with an advisory in force (at_risk), from the few that ever reported one."""
        return [node_id for node_id in self.risks if self.at_risk(node_id)]

    def pick(self, request: PlacementRequest, prefer: str = "") -> tuple[str | None, dict]:
        """The node a placement goes to: `prefer` if the gate admits it, else the least loaded
        connected node the gate admits (ties by id); and why the nodes looked at refused."""
        refused: dict[str, str] = {}
        if prefer and (view := self.view(prefer)) is not None and view.connected:
            why = admit(view, request)
            if why is None:
                return prefer, refused
            refused[prefer] = why
        avoided = self.avoided_now()
        open_groups = []
        for group, heap in self._heaps.items():
            if group in avoided and request.kind != "render":
                # Render on spot is checked before the group (placement.admit's order).
                self._refuse_group(group, refused)
            elif heap:
                open_groups.append(group)
        looked: list[tuple[str, tuple[int, str]]] = []
        chosen = None
        seen: set[str] = set()
        while chosen is None:
            best: tuple[tuple[int, str], str] | None = None
            for group in open_groups:
                heap = self._heaps[group]
                while heap and (heap[0][1] in seen or not self._valid(group, heap[0])):
                    heapq.heappop(heap)
                if heap and (best is None or heap[0] < best[0]):
                    best = (heap[0], group)
            if best is None:
                break
            entry, group = best
            heapq.heappop(self._heaps[group])
            seen.add(entry[1])
            looked.append((group, entry))
            view = self.view(entry[1])
            why = "unknown_node" if view is None else admit(view, request)
            if why is None:
                chosen = entry[1]
            else:
                refused[entry[1]] = why
        for group, entry in looked:
            heapq.heappush(self._heaps[group], entry)
        return chosen, refused

    def _refuse_group(self, group: str, refused: dict[str, str]) -> None:
        """An avoided group's nodes, named when they are few (the event stays bounded)."""
        # The first few of its heap only: a group is a thousand nodes, and an avoided one is
        # passed over at every placement.
        heap = self._heaps.get(group, ())
        members = [n for _, n in itertools.islice(heap, REFUSED_EXAMPLES + 1)]
        for node_id in members[:REFUSED_EXAMPLES]:
            if node_id in self.streams:
                refused[node_id] = "group_avoided"
        if len(members) > REFUSED_EXAMPLES:
            refused[f"group:{group}"] = "group_avoided"


def summarize_refusals(refused: dict[str, str]) -> dict[str, Any]:
    """Why nodes said no, bounded: every node when there are few, else counts and examples."""
    if len(refused) <= REFUSED_EXAMPLES:
        return dict(refused)
    by_reason = Counter(refused.values())
    examples = dict(sorted(refused.items())[:REFUSED_EXAMPLES])
    return {"nodes": len(refused), "by_reason": dict(by_reason), "examples": examples}
