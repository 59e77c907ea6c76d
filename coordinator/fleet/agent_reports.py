"""What connected agents report: their registration, their workers' starts and stops, slot
counts and heartbeats.

A heartbeat that changes nothing but a worker's expiry and slots touches memory only (the
routing table and the registry); state changes are stored. Everything is by node and by
worker id: no report looks at another node.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from spotdrain.coordinator.core import messages as msg
from spotdrain.coordinator.core import worker_machine as wm
from spotdrain.coordinator.fleet.drains import Drains
from spotdrain.coordinator.fleet.lost import LostNodes
from spotdrain.coordinator.fleet.placer import Gate
from spotdrain.coordinator.fleet.registry import ApplyEvent, FleetState
from spotdrain.coordinator.fleet.rentals import RentalBook
from spotdrain.coordinator.fleet.route_table import RouteTable
from spotdrain.coordinator.store import NodeRow

log = logging.getLogger("spotdrain.coordinator.agents")


class AgentReports:
    def __init__(
        self,
        state: FleetState,
        routes: RouteTable,
        apply: ApplyEvent,
        send_drain: Callable[[wm.Worker], Awaitable[None]],
        gate: Gate,
        drains: Drains,
        rentals: RentalBook,
        lost: LostNodes,
        heartbeat_ttl_s: float,
    ) -> None:
        self.store, self.events, self.clock = state.store, state.events, state.clock
        self.nodes, self.registry = state.nodes, state.registry
        self.routes = routes
        self.apply = apply
        self.send_drain = send_drain
        self.gate = gate
        self.drains = drains
        self.rentals = rentals
        self.lost = lost
        self.heartbeat_ttl_s = heartbeat_ttl_s

    async def register(self, reg: msg.Registration, queue: asyncio.Queue[Any]) -> None:
        """A node's stream opened with its registration: its record, then `Registered` on the
        stream, then its workers and rentals reconciled with what it runs."""
        node_id = reg.node_id
        running = {w.worker_id for w in reg.workers}
        render = [
            w.worker_id
            for w in self.drains.render_jobs(node_id)
            if not reg.inventory_complete or w.worker_id in running
        ]
        known = self.nodes.rows.get(node_id)
        refused: dict[str, Any] = {}
        unchanged = known is not None and _claims_as_stored(known, reg)
        if unchanged:
            # Nothing it claims has changed (a reconnect, every node after a coordinator
            # restart): only its last_seen, a blind write that commits with the others, instead
            # of a read-modify-write transaction each: 10,000 of those in a row were most of a
            # reconnect storm.
            await self.store.touch_node(node_id)
            self.nodes.put(dataclasses.replace(known, last_seen=self.clock()))
        else:
            refused = await self.store.upsert_node(
                node_id,
                reg.spot,
                reg.node_group,
                reg.gpus,
                reg.provider,
                spot_locked=bool(render),
                managers=reg.managers,
                cloud=reg.cloud,
            )
            row = await self.store.node(node_id)
            if row is not None:
                self.nodes.put(row)
        # Invariant 9: a node cannot turn spot (or back), nor change hands, under a rental,
        # not even by restarting its agent with other settings.
        for field_name, kind in (
            ("spot", "spot_change_refused"),
            ("provider", "provider_change_refused"),
        ):
            if field_name in refused:
                await self.events.record(
                    kind, node_id, {field_name: refused[field_name], "via": "registration"}
                )
        self.nodes.connect(node_id, queue)
        # A reconnect that changes nothing (every node after a coordinator restart) is a debug
        # line: 10,000 info lines in a reconnect storm were a fifth of the event loop's time.
        # The connected count is in the metrics and the service status.
        log.log(
            logging.DEBUG if unchanged else logging.INFO,
            "node %s registered (%d GPUs, group %s, spot=%s, %d workers)",
            node_id,
            len(reg.gpus),
            reg.node_group,
            reg.spot,
            len(reg.workers),
        )
        queue.put_nowait(msg.Registered(node_id, tuple(self.nodes.node_taints(node_id))))
        returned = await self.lost.came_back(node_id, reg)
        await self.registered(node_id, reg.workers, reg.rentals, reg.inventory_complete)
        if returned:  # what the fleet wants goes back through the gate, this node first
            await self.lost.capacity.keep(path="node_returned", prefer=node_id)

    async def disconnected(self, node_id: str, queue: asyncio.Queue[Any]) -> None:
        if self.nodes.disconnect(node_id, queue):
            await self.store.touch_node(node_id)
            row = await self.store.node(node_id)
            if row is not None:
                self.nodes.put(row)

    async def registered(
        self,
        node_id: str,
        running: Sequence[msg.WorkerReport],
        rentals: Sequence[msg.RentalReport] = (),
        complete: bool = True,
    ) -> None:
        """A node (re)connected: reconcile its workers with what it says is running. With an
        incomplete inventory (Docker was down at the agent's start) nothing missing from the
        lists counts as gone: it is the list that is short."""
        seen = {r.worker_id for r in running}
        now = self.clock()
        lost = []
        for worker in self.registry.live(node_id):
            if complete and worker.worker_id not in seen and worker.state != wm.STARTING:
                # Gone while we were apart (reboot, crash): only a stop ends draining, and
                # this is one.
                if worker.state == wm.READY:
                    lost.append(worker)
                await self.apply(worker, wm.Stopped(now, None))
        # A node back from a reboot gets its serving workers again, through the one gate: a
        # node that came back paused or tainted gets none (docs/design.md invariant 4).
        for worker in lost:
            await self.gate.place_again(worker, "reregistration")
        for report in running:
            await self.worker_report(node_id, report)
        for worker in self.registry.live(node_id):
            if worker.state == wm.DRAINING:
                await self.send_drain(worker)
        await self.rentals.reconcile(node_id, rentals, complete)

    async def worker_report(self, node_id: str, report: msg.WorkerReport) -> None:
        worker = self.registry.get(report.worker_id)
        if worker is None or worker.node_id != node_id:
            log.warning(
                "node %s reported unknown worker %s (%s)", node_id, report.worker_id, report.state
            )
            return
        now = self.clock()
        if report.state == "started":
            if worker.expires_at is None:
                # Counted from the start: a node that vanishes before its first heartbeat
                # must not leave a worker "ready" for good.
                worker.expires_at = now + self.heartbeat_ttl_s
            await self.apply(
                worker,
                wm.Started(
                    now,
                    report.gate_address,
                    max(report.capacity, 1),
                    await self.drains.node_drain(node_id),
                    routed=worker.routed,
                ),
            )
        elif report.state in ("stopped", "refused"):
            if report.state == "refused":
                await self.events.record(
                    "worker_refused",
                    node_id,
                    {"worker_id": worker.worker_id, "reason": report.reason},
                    "",
                )
            await self.apply(worker, wm.Stopped(now, report.exit_code))

    async def slots(
        self, node_id: str, reports: Sequence[msg.WorkerSlots], heartbeat: bool
    ) -> None:
        now = self.clock()
        for slot in reports:
            worker = self.registry.get(slot.worker_id)
            if worker is None or worker.node_id != node_id:
                continue
            claimed = slot.claimed_state if slot.claimed_state in wm.STATES else wm.READY
            if heartbeat:
                event: wm.Event = wm.Heartbeat(
                    now, claimed, slot.slots_in_use, self.heartbeat_ttl_s
                )
            else:
                event = wm.SlotsChanged(now, slot.slots_in_use)
            await self.apply(worker, event, save=False)
            self.routes.set_slots(worker.worker_id, worker.slots_in_use)


def _claims_as_stored(row: NodeRow, reg: msg.Registration) -> bool:
    """A registration that would store exactly what the node's row holds already (and so can
    refuse nothing: a refusal is a claim that differs)."""
    return (
        row.spot == reg.spot
        and row.node_group == reg.node_group
        and row.provider == reg.provider
        and row.gpus == tuple(reg.gpus)
        and row.managers == tuple(reg.managers)
        and (reg.cloud is None or row.cloud == reg.cloud)
    )
