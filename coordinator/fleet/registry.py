"""The live workers, in memory, with the indexes the hot paths need.

Rebuilt from the store at start (recovery.rebuild); every lookup a Taint, a heartbeat or a
placement makes is by node, by model or by port, never a scan of the fleet. Pure: no I/O.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from spotdrain.coordinator.core import messages as msg
from spotdrain.coordinator.core import worker_machine as wm
from spotdrain.coordinator.fleet.eventlog import EventLog
from spotdrain.coordinator.fleet.nodes import NodeIndex
from spotdrain.coordinator.store import Store

FIRST_WORKER_PORT = 20000
WORKER_PORTS = 1000  # a worker's slot gate listens on its port + the agent's gate offset


class NoFreePort(Exception):
    pass


@dataclass(frozen=True)
class FleetState:
    """What every part of the fleet reads and writes: the store, the event log, the clock and
    the in-memory indexes. No part in it: a part's siblings are handed to it one by one
    (coordinator/fleet/wiring.py)."""

    store: Store
    events: EventLog
    clock: Callable[[], float]
    nodes: NodeIndex
    registry: WorkerRegistry


# What the fleet's parts are handed instead of the fleet (coordinator/fleet/wiring.py makes
# them): one event into a worker's machine with its effects carried out, a worker stored, a
# command queued for a node's stream once what led to it is committed.
class ApplyEvent(Protocol):
    async def __call__(self, worker: wm.Worker, event: wm.Event, save: bool = False) -> None: ...


SaveWorker = Callable[[wm.Worker], Awaitable[None]]
SendCommand = Callable[[str, msg.Command], None]


class WorkerRegistry:
    def __init__(self) -> None:
        self.workers: dict[str, wm.Worker] = {}
        self._by_node: dict[str, dict[str, wm.Worker]] = {}
        # Starting or ready inference workers of each model: what counts toward its capacity.
        self._serving: dict[str, dict[str, wm.Worker]] = {}
        self._ports = Counter[int]()
        # Ports unused anywhere in the fleet, smallest first (entries go stale when a port is
        # taken; they are dropped when they surface).
        self._free = list(range(FIRST_WORKER_PORT, FIRST_WORKER_PORT + WORKER_PORTS))

    def __len__(self) -> int:
        return len(self.workers)

    def get(self, worker_id: str) -> wm.Worker | None:
        return self.workers.get(worker_id)

    def add(self, worker: wm.Worker) -> None:
        self.workers[worker.worker_id] = worker
        self._by_node.setdefault(worker.node_id, {})[worker.worker_id] = worker
        self._ports[worker.port] += 1
        self.changed(worker)

    def changed(self, worker: wm.Worker) -> None:
        """After every event the worker handled: its state decides the indexes it is in."""
        if worker.state == wm.STOPPED:
            self._remove(worker)
            return
        serving = self._serving.setdefault(worker.model, {})
        if worker.kind == "inference" and worker.state in (wm.STARTING, wm.READY):
            serving[worker.worker_id] = worker
        else:
            serving.pop(worker.worker_id, None)

    def _remove(self, worker: wm.Worker) -> None:
        if self.workers.pop(worker.worker_id, None) is None:
            return
        on_node = self._by_node.get(worker.node_id, {})
        on_node.pop(worker.worker_id, None)
        if not on_node:
            self._by_node.pop(worker.node_id, None)
        self._serving.get(worker.model, {}).pop(worker.worker_id, None)
        self._ports[worker.port] -= 1
        if self._ports[worker.port] <= 0:
            del self._ports[worker.port]
            if FIRST_WORKER_PORT <= worker.port < FIRST_WORKER_PORT + WORKER_PORTS:
                heapq.heappush(self._free, worker.port)

    def live(self, node_id: str | None = None) -> list[wm.Worker]:
        if node_id is None:
            return list(self.workers.values())
        return list(self._by_node.get(node_id, {}).values())

    def count(self, node_id: str) -> int:
        return len(self._by_node.get(node_id, ()))

    def serving(self, model: str) -> list[wm.Worker]:
        return list(self._serving.get(model, {}).values())

    def slots_in_use_by_model(self) -> dict[str, int]:
        """Slots in use over each model's ready workers (the gates' counts): a walk of the
        serving workers only, with one total per model out."""
        return {
            model: sum(w.slots_in_use for w in workers.values() if w.state == wm.READY)
            for model, workers in list(self._serving.items())
        }

    def serving_count(self, model: str) -> int:
        return len(self._serving.get(model, ()))

    def is_serving(self, worker: wm.Worker) -> bool:
        return worker.worker_id in self._serving.get(worker.model, {})

    def free_port(self, node_id: str) -> int:
        """A worker port free on the node. Ports unused anywhere in the fleet come first, so
        several agents sharing one host (a lab, the demo) never collide while the range lasts;
        only a port in use on this node itself is ruled out."""
        while self._free and self._ports[self._free[0]] > 0:
            heapq.heappop(self._free)
        if self._free:
            return self._free[0]
        on_node = {w.port for w in self.live(node_id)}
        for port in range(FIRST_WORKER_PORT, FIRST_WORKER_PORT + WORKER_PORTS):
            if port not in on_node:
                return port
        raise NoFreePort(node_id)
