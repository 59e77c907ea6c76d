"""The coordinator's live fleet: the one module that builds the parts, hands each what it uses
and wires the reactions between them, and the one executor of the worker machine's effects.

Each concern is a module of its own (placer, drains, rentals, contracts, agent_reports,
recovery here; keeper, replacement and risks in coordinator/capacity/). None of them imports
this module or reaches a sibling through it: each takes the store, the event log, the clock, the
in-memory indexes (coordinator/fleet/registry.py, coordinator/fleet/nodes.py) and the siblings it
calls, or a callback (`apply`, `send`, `gpus_freed`...) that this module binds. The worker
machine (coordinator/core/worker_machine.py) decides; `apply` carries out what it returns, and
what a state change sets off in capacity and drains is decided here. Nothing here lives only in
memory that `recovery.rebuild` cannot read back from the store (docs/design.md invariant 8).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from spotdrain.coordinator.capacity.acquirer import DEFAULT_AVOID_S, Acquirer
from spotdrain.coordinator.capacity.contracts import ContractPolicy, Contracts
from spotdrain.coordinator.capacity.keeper import CapacityKeeper
from spotdrain.coordinator.capacity.replacement import Replacement
from spotdrain.coordinator.capacity.risks import Risks
from spotdrain.coordinator.core import messages as msg
from spotdrain.coordinator.core import worker_effects as we
from spotdrain.coordinator.core import worker_machine as wm
from spotdrain.coordinator.fleet.agent_reports import AgentReports
from spotdrain.coordinator.fleet.drains import Drains
from spotdrain.coordinator.fleet.eventlog import EventLog
from spotdrain.coordinator.fleet.lost import LostNodes
from spotdrain.coordinator.fleet.nodes import NodeIndex
from spotdrain.coordinator.fleet.placer import Gate
from spotdrain.coordinator.fleet.recovery import Recovery
from spotdrain.coordinator.fleet.registry import FleetState, WorkerRegistry
from spotdrain.coordinator.fleet.rentals import RentalBook
from spotdrain.coordinator.fleet.route_table import RouteEntry, RouteTable
from spotdrain.coordinator.store import Store
from spotdrain.protocol import timing
from spotdrain.runtime.background import Background

log = logging.getLogger("spotdrain.coordinator.fleet.wiring")


class Fleet:
    def __init__(
        self,
        store: Store,
        events: EventLog,
        clock: Callable[[], float] = time.time,
        heartbeat_ttl_s: float = timing.HEARTBEAT_TTL_S,
        start_timeout_s: float = timing.START_TIMEOUT_S,
        acquirers: dict[str, Acquirer] | None = None,
        avoid_s: float = DEFAULT_AVOID_S,
        node_gone_s: float = timing.NODE_GONE_S,
        node_lost_s: float = timing.NODE_LOST_S,
        contract_policy: ContractPolicy | None = None,
    ) -> None:
        self.store = store
        self.events = events
        self.clock = clock
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.start_timeout_s = start_timeout_s
        self.registry = WorkerRegistry()
        self.nodes = NodeIndex(clock, self.registry.count)
        self.routes = RouteTable()
        # Work nothing waits for (acquisitions, capacity passes after a Taint's answer).
        self.background = Background()
        # Each part is handed what it uses (docs/contributing.md "Code map"); the reactions
        # between them are wired here and nowhere else.
        state = FleetState(store, events, clock, self.nodes, self.registry)
        self.contracts = Contracts(state, contract_policy)
        self.gate = Gate(
            state,
            save=self.save,
            send=self.send,
            keeps_off_spot=self.contracts.keeps_off_spot,
        )
        self.capacity = CapacityKeeper(
            state,
            gate=self.gate,
            apply=self.apply,
            background=self.background,
        )
        self.replacement = Replacement(
            state, background=self.background, acquirers=acquirers or {}, avoid_s=avoid_s
        )
        self.rentals = RentalBook(
            state,
            gate=self.gate,
            send=self.send,
            start_timeout_s=start_timeout_s,
            gpus_freed=self._gpus_freed,
        )
        self.drains = Drains(
            state,
            apply=self.apply,
            gate=self.gate,
            rentals=self.rentals,
            replacement=self.replacement,
            capacity=self.capacity,
        )
        self.risks = Risks(state, wanted=self.capacity.wanted)
        # What an agent's events set in motion.
        events.react(
            {
                "advisory_received": self.risks.received,
                "advisory_lifted": self.risks.lifted,
                "container_exited": self.contracts.ended,
                "overrun": self.contracts.ended,
            }
        )
        self.lost = LostNodes(
            state,
            apply=self.apply,
            send=self.send,
            drains=self.drains,
            rentals=self.rentals,
            replacement=self.replacement,
            capacity=self.capacity,
            node_lost_s=node_lost_s,
        )
        self.reports = AgentReports(
            state,
            routes=self.routes,
            apply=self.apply,
            send_drain=self.send_drain,
            gate=self.gate,
            drains=self.drains,
            rentals=self.rentals,
            lost=self.lost,
            heartbeat_ttl_s=heartbeat_ttl_s,
        )
        self.recovery = Recovery(
            state,
            apply=self.apply,
            publish=self.publish,
            gate=self.gate,
            drains=self.drains,
            rentals=self.rentals,
            capacity=self.capacity,
            replacement=self.replacement,
            risks=self.risks,
            contracts=self.contracts,
            lost=self.lost,
            heartbeat_ttl_s=heartbeat_ttl_s,
            start_timeout_s=start_timeout_s,
            node_gone_s=node_gone_s,
        )
        # The deadline heap follows every stream, worker event and worker save (apply, save).
        self.nodes.on_connection = self.recovery.connection_changed

    async def node_lost(self, node_id: str, why: str) -> str | None:
        """A node known gone now (a provider's `terminated`, heard by a queue source): lost at
        once unless a reclamation is open or it is lost already; its lost record's id."""
        return await self.lost.declare(node_id, why, self.clock(), need_work=False)

    async def _gpus_freed(self, node_id: str) -> None:
        """A rental's GPUs came free: a worker the fleet wants goes back there first."""
        await self.capacity.keep(path="rental_end_restart", prefer=node_id)

    def send(self, node_id: str, command: msg.Command) -> None:
        """To the node's stream once what led to it is stored. Not connected: registration
        reconciles, and recovery re-sends drains."""

        def put() -> None:
            queue = self.nodes.streams.get(node_id)
            if queue is not None:
                queue.put_nowait(command)

        self.store.after_commit(put)

    # --- the worker machine's effects ----------------------------------------------------------

    async def apply(self, worker: wm.Worker, event: wm.Event, save: bool = False) -> None:
        """One event into the worker's machine, and its effects carried out. Stored when the
        state changed or an effect came out; a heartbeat that only moved the expiry is not a
        write (liveness lives in memory)."""
        before = worker.state
        effects = worker.handle(event)
        self.registry.changed(worker)
        self.recovery.watch(worker)
        changed = worker.state != before
        if changed:
            self.nodes.load_changed(worker.node_id)
        if save or effects or changed:
            await self.save(worker)
        for effect in effects:
            match effect:
                case we.RouteAdded(route):
                    self.publish(worker, route)
                case we.RouteRemoved(worker_id):
                    self.routes.remove(worker_id)
                case we.DrainOnNode():
                    await self.send_drain(worker)
                case we.WorkerEvent(kind, details):
                    await self.events.record(kind, worker.node_id, dict(details), "")
                case _:
                    raise TypeError(effect)
        if changed and worker.state == wm.READY:
            await self.capacity.started(worker.model)
        if changed and worker.state == wm.STOPPED:
            if worker.story and worker.story[-1][2:] == (wm.STARTING, wm.STOPPED):
                await self.capacity.start_failed(worker)
            await self.drains.stopped(worker)

    def publish(self, worker: wm.Worker, route: we.Route | None = None) -> None:
        r = route or worker.route()
        self.routes.upsert(
            RouteEntry(
                r.worker_id, r.node_id, r.model, r.gate_address, worker.slots_in_use, r.capacity
            )
        )

    async def send_drain(self, worker: wm.Worker) -> None:
        # The node's reclamation, so what the drain cuts lands in that reclamation's timeline.
        current = self.drains.current(worker.node_id)
        reclaim_id = current.reclaim_id if current is not None else ""
        self.send(
            worker.node_id,
            msg.DrainWorker(
                worker_id=worker.worker_id,
                reason=worker.drain_reason,
                reclaim_id=reclaim_id,
                grace_deadline=worker.grace_deadline or 0.0,
                terminate_at=worker.terminate_at or 0.0,
            ),
        )

    async def save(self, worker: wm.Worker) -> None:
        self.recovery.watch(worker)  # a new worker's start timeout is armed here
        await self.store.save_worker(
            worker.worker_id,
            worker.node_id,
            worker.model,
            worker.state,
            worker.created_at,
            worker.to_json(),
        )

    def live_workers(self, node_id: str | None = None) -> list[wm.Worker]:
        return self.registry.live(node_id)

    async def all_workers(self, node_id: str = "") -> list[wm.Worker]:
        """Every worker the store knows (stopped ones too), the live ones as they are now."""
        docs = await self.store.worker_docs(node_id=node_id or None)
        return [self.registry.get(d["worker_id"]) or wm.Worker.from_json(d) for d in docs]

    async def close(self) -> None:
        await self.background.close()
        await self.events.flush()
