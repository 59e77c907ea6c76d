"""Nodes lost without notice, and their return.

A node whose stream closed, with work on it and no reclamation open, is `node_lost` once it
has been away `--node-lost-s` (the deadline heap fires it, coordinator/fleet/recovery.py): the
work it held is named, its live workers stopped (out of routing, as the heartbeat TTL does for
ready ones), a replacement requested, its rentals ended `lost`. The event opens a record of its
own (`lost-<node>-<since>`, reason and outcome `lost`), so reclamation listings count it apart
from drains and overruns. A lost node that registers again is `node_returned` in the same
record; what it still runs is reconciled as any registration is, and capacity goes back
through the one placement gate.

Which nodes are lost lives in the store (their records); `load` reads it back at rebuild.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from spotdrain.coordinator.capacity.keeper import CapacityKeeper
from spotdrain.coordinator.capacity.replacement import Replacement
from spotdrain.coordinator.core import messages as msg
from spotdrain.coordinator.core import worker_machine as wm
from spotdrain.coordinator.core.rental import Rental
from spotdrain.coordinator.fleet.drains import Drains
from spotdrain.coordinator.fleet.registry import ApplyEvent, FleetState, SendCommand
from spotdrain.coordinator.fleet.rentals import RentalBook

log = logging.getLogger("spotdrain.coordinator.fleet.lost")

LOST_PREFIX = "lost-"  # a lost node's record id: lost-<node>-<since, whole seconds>


class LostNodes:
    def __init__(
        self,
        state: FleetState,
        apply: ApplyEvent,
        send: SendCommand,
        drains: Drains,
        rentals: RentalBook,
        replacement: Replacement,
        capacity: CapacityKeeper,
        node_lost_s: float,
    ) -> None:
        self.store, self.events, self.clock = state.store, state.events, state.clock
        self.nodes, self.registry = state.nodes, state.registry
        self.apply, self.send = apply, send
        self.drains, self.rentals = drains, rentals
        self.replacement, self.capacity = replacement, capacity
        self.node_lost_s = node_lost_s
        self.lost: dict[str, str] = {}  # node -> its open lost record's id
        self.declared = 0  # since this coordinator started leading (/metrics)
        self.returned = 0

    async def load(self) -> None:
        self.lost = await self.store.open_lost_nodes(LOST_PREFIX)

    def reclamation_open(self, node_id: str) -> bool:
        return self.drains.current(node_id) is not None

    async def held(self, node_id: str, since: float) -> tuple[list[wm.Worker], list[Rental]]:
        """The work the node held when it went away: its live workers and those the
        coordinator itself stopped since (expired, start timed out: no exit code), and its
        active rentals."""
        workers = []
        for doc in await self.store.worker_docs(node_id=node_id):
            worker = self.registry.get(doc["worker_id"]) or wm.Worker.from_json(doc)
            if worker.state != wm.STOPPED or (
                (worker.stopped_at or 0.0) >= since and worker.exit_code is None
            ):
                workers.append(worker)
        return workers, await self.rentals.list(node_id, active_only=True)

    async def declare(self, node_id: str, why: str, since: float, need_work: bool) -> str | None:
        """The node lost now: its record's id, or None when it is not (a reclamation open,
        unknown, or no work when `need_work`). A node lost already keeps its record: nothing
        is recorded twice, and what a failed firing (or a coordinator that died in the
        middle) left undone is finished; the rest is idempotent."""
        reclaim_id = self.lost.get(node_id) or f"{LOST_PREFIX}{node_id}-{since:.0f}"
        if self.reclamation_open(node_id):
            return None
        if node_id not in self.nodes.rows:
            return None
        now = self.clock()
        workers, rentals = await self.held(node_id, since)
        if need_work and (node_id in self.nodes.streams or (not workers and not rentals)):
            return None  # nothing held, or back while the store was read
        if node_id not in self.lost:
            await self._record(node_id, reclaim_id, why, since, workers, rentals)
        for worker in workers:
            live = self.registry.get(worker.worker_id)
            if live is not None:
                await self.apply(live, wm.Stopped(now, None))
        for rental in rentals:
            if rental.lost(now, why):
                await self.rentals.ended(rental, reclaim_id)
        await self.capacity.keep(path="node_lost")
        return reclaim_id

    async def _record(
        self,
        node_id: str,
        reclaim_id: str,
        why: str,
        since: float,
        workers: Sequence[wm.Worker],
        rentals: Sequence[Rental],
    ) -> None:
        """`node_lost` stored and the replacement asked for, once per record."""
        # Claimed before the first write: a registration from here on is its return.
        self.lost[node_id] = reclaim_id
        log.warning("node %s lost: %s", node_id, why)
        try:
            await self.events.record(
                "node_lost",
                node_id,
                {
                    "why": why,
                    "since": since,
                    "workers": [_worker_doc(w) for w in workers],
                    "rentals": [
                        {"rental_id": r.rental_id, "renter": r.renter, "container": r.container}
                        for r in rentals
                    ],
                    "containers": sorted({r.container for r in rentals if r.container}),
                },
                reclaim_id,
            )
        except BaseException:
            self.lost.pop(node_id, None)  # not stored: the retry records it
            raise
        self.declared += 1
        models = sorted({w.model for w in workers})
        await self.replacement.request(node_id, reclaim_id, self.clock(), models, reason="lost")

    async def came_back(self, node_id: str, reg: msg.Registration) -> bool:
        """A lost node registered again: `node_returned`, naming what it still runs. Workers
        it runs that were stopped while it was lost (their replacements run elsewhere) are
        drained off it; its ended rentals are stopped when its registration is reconciled
        (RentalBook.report); what the fleet still wants goes back through the gate (the
        capacity keeper's pass, this node preferred)."""
        reclaim_id = self.lost.pop(node_id, None)
        if reclaim_id is None:
            return False
        self.returned += 1
        running = [w.worker_id for w in reg.workers if w.state == "started"]
        stale = [w for w in running if self.registry.get(w) is None]
        await self.events.record(
            "node_returned",
            node_id,
            {
                "workers": running,
                "stale_workers": stale,
                "rentals": [r.rental_id for r in reg.rentals],
            },
            reclaim_id,
        )
        self._drain_stale(node_id, reclaim_id, stale)
        return True

    def _drain_stale(self, node_id: str, reclaim_id: str, worker_ids: Sequence[str]) -> None:
        now = self.clock()
        for worker_id in worker_ids:
            self.send(
                node_id,
                msg.DrainWorker(
                    worker_id=worker_id,
                    reason="operator",
                    reclaim_id=reclaim_id,
                    grace_deadline=now,
                    terminate_at=now,
                ),
            )


def _worker_doc(worker: wm.Worker) -> dict[str, object]:
    return {
        "worker_id": worker.worker_id,
        "model": worker.model,
        "image": worker.image,
        "kind": worker.kind,
        "state": worker.state,
    }
