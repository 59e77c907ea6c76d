"""Rentals as the fleet runs them: created through the gate, told their reclaim_at, ended by
whoever may end them, reconciled with what a node reports, and watched.

The rental record itself (coordinator/core/rental.py) is pure; this module stores every change,
tells the watchers and the node, and keeps the node's booked GPUs current for placement.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence

from spotdrain.coordinator.core import messages as msg
from spotdrain.coordinator.core.admission import PlacementRequest
from spotdrain.coordinator.core.rental import Rental
from spotdrain.coordinator.fleet.placer import Gate
from spotdrain.coordinator.fleet.registry import FleetState, SendCommand
from spotdrain.runtime.watchers import Watchers

log = logging.getLogger("spotdrain.coordinator.core.rental")

# A running rental the node did not list when it registered: its stop report (queued on the
# agent, sent right after the registration) gets this long to arrive and say how it ended.
MISSING_RENTAL_GRACE_S = 5.0


class RentalBook:
    def __init__(
        self,
        state: FleetState,
        gate: Gate,
        send: SendCommand,
        start_timeout_s: float,
        gpus_freed: Callable[[str], Awaitable[None]],
    ) -> None:
        self.store, self.events, self.clock = state.store, state.events, state.clock
        self.nodes = state.nodes
        self.gate = gate
        self.send = send
        self.start_timeout_s = start_timeout_s
        # A node's GPUs came free (a rental's container gone): the capacity keeper's turn.
        self.gpus_freed = gpus_freed
        # Each rental's watchers (WatchRental streams): a queue of snapshots each.
        self.watchers: Watchers[str, Rental] = Watchers()

    # --- reading -----------------------------------------------------------------------------

    async def list(self, node_id: str | None = None, active_only: bool = False) -> list[Rental]:
        docs = await self.store.rental_docs(node_id, holding_only=active_only)
        rentals = [Rental.from_json(d) for d in docs]
        return [r for r in rentals if r.active] if active_only else rentals

    async def get(self, rental_id: str) -> Rental | None:
        doc = await self.store.rental_doc(rental_id)
        return Rental.from_json(doc) if doc is not None else None

    # --- what renters, providers and operators do --------------------------------------------

    async def create(self, node_id: str, renter: str, image: str, gpus: int) -> Rental:
        """A renter's container on a node, through the one placement gate."""
        request = PlacementRequest(kind="rental", gpus=gpus, path="rental")
        await self.gate.admit(node_id, request, {})
        node = self.nodes.rows[node_id]  # admitted, so known
        rental = Rental(
            rental_id=f"r-{uuid.uuid4().hex[:10]}",
            node_id=node_id,
            provider=node.owner,
            renter=renter,
            image=image,
            gpus=gpus,
            started_at=self.clock(),
            started_on_spot=node.spot,  # fixed now, for good (invariant 9)
        )
        await self.changed(rental)
        await self.events.record(
            "rental_created",
            node_id,
            {"rental_id": rental.rental_id, "renter": renter, "spot": node.spot, "gpus": gpus},
            "",
        )
        self._send_start(rental)
        return rental

    async def end(self, rental: Rental, ended_by: str) -> Rental:
        if rental.end(self.clock(), ended_by):
            await self.ended(rental)
            self._send_stop(rental, ended_by)
        return rental

    # --- reclamations ------------------------------------------------------------------------

    async def reclaim(self, node_id: str, reclaim_id: str, reason: str, grace: float) -> None:
        if not self.nodes.rental_gpus.get(node_id):
            return  # nothing booked on the node: no rental to tell (and no read on a Taint)
        for rental in await self.list(node_id, active_only=True):
            if rental.reclaim(reclaim_id, reason, grace):
                await self.changed(rental)
                await self.events.record(
                    "rental_reclaim_set",
                    node_id,
                    {"rental_id": rental.rental_id, "reclaim_at": rental.reclaim_at},
                    reclaim_id,
                )

    async def lift_reclaim(self, node_id: str, reclaim_id: str) -> None:
        """A pause resumed or a notice cancelled before G: its rentals go on."""
        for rental in await self.list(node_id, active_only=True):
            if rental.reclaim_lifted(reclaim_id, self.clock()):
                await self.changed(rental)
                await self.events.record(
                    "rental_reclaim_lifted", node_id, {"rental_id": rental.rental_id}, reclaim_id
                )

    # --- what nodes report -------------------------------------------------------------------

    async def report(self, node_id: str, report: msg.RentalReport) -> None:
        rental = await self.get(report.rental_id)
        if rental is None or rental.node_id != node_id:
            log.warning("node %s reported unknown rental %s", node_id, report.rental_id)
            if report.state == "started":  # not ours: it must not keep the node's GPUs
                self.send(node_id, msg.StopRental(rental_id=report.rental_id, reason="unknown"))
            return
        await self.found(rental.rental_id)
        if report.state == "started":
            if not rental.active:  # ended while the agent was away: stop what still runs
                self._send_stop(rental, "ended")
            elif rental.started(report.container):
                await self.changed(rental)
            return
        if report.reclaim_id and rental.active:
            # Stopped by a reclamation this coordinator may never have heard of (a pause the
            # agent applied on its own): the end is that reclamation's.
            rental.reclaim(report.reclaim_id, report.reclaim_reason or "notice", report.reclaim_at)
        was_active, was_releasing = rental.active, rental.releasing
        if rental.stopped(self.clock(), report.exit_code, report.reason):
            if was_active:
                await self.ended(rental)
            else:
                await self.changed(rental)
                if was_releasing:  # its container is gone: the GPUs are free now
                    await self.gpus_freed(rental.node_id)

    async def reconcile(
        self, node_id: str, running: Sequence[msg.RentalReport], complete: bool
    ) -> None:
        """A node (re)registered with the rentals it runs."""
        if not running and not self.nodes.rental_gpus.get(node_id):
            # Nothing booked on it and nothing running: no read at every node's registration
            # (a coordinator restart's reconnect storm is 10,000 of them). Every rental holds
            # at least one GPU while it is not over.
            return
        seen = {r.rental_id for r in running}
        for rental in await self.list(node_id, active_only=True):
            if rental.rental_id in seen:
                continue
            if rental.state == "starting":
                self._send_start(rental)  # the command may have been lost: it is idempotent
            elif complete:
                # Not ended yet: the agent's stop report, queued while it was away, comes
                # right after its registration and says how (recovery waits for it).
                await self.store.add_missing_rental(rental.rental_id, self.clock())
        for report in running:
            await self.report(node_id, report)

    async def found(self, rental_id: str) -> None:
        await self.store.drop_missing_rental(rental_id)

    # --- recovery ------------------------------------------------------------------------------

    async def recover(self, now: float, node_gone_s: float, started_at: float) -> None:
        """A rental never reported started is given up, like a worker; one whose node has been
        gone for `node_gone_s`, or that its node no longer runs (and reported no stop for), has
        ended without a trace."""
        for rental in await self.list(active_only=True):
            if rental.state == "starting" and now - rental.started_at > self.start_timeout_s:
                why = f"never reported started within {self.start_timeout_s:.0f} s"
                if rental.stopped(now, None, why):
                    await self.ended(rental)
                    self._send_stop(rental, "start timeout")
                    continue
            node = self.nodes.rows.get(rental.node_id)
            if rental.node_id in self.nodes.streams or node is None:
                continue
            gone_for = now - max(node.last_seen, started_at)
            why = f"its node has been gone for {gone_for:.0f} s"
            if gone_for > node_gone_s and rental.stopped(now, None, why, vanished=True):
                await self.ended(rental)
        for rental_id, since in (await self.store.missing_rentals()).items():
            if now - since < MISSING_RENTAL_GRACE_S:
                continue
            await self.found(rental_id)
            rental = await self.get(rental_id)
            why = "its container was gone when the node came back"
            if rental is not None and rental.stopped(now, None, why, vanished=True):
                await self.ended(rental)

    # --- effects -------------------------------------------------------------------------------

    async def ended(self, rental: Rental, reclaim_id: str = "") -> None:
        """Stored, told, and in its reclamation's timeline (its own, or `reclaim_id`'s: a lost
        node's record)."""
        await self.changed(rental)
        await self.events.record(
            "rental_ended",
            rental.node_id,
            {
                "rental_id": rental.rental_id,
                "ended_by": rental.ended_by,
                "started_on_spot": rental.started_on_spot,
                "exit_code": rental.exit_code,
                "reclaim_at": rental.reclaim_at,
            },
            reclaim_id or rental.reclaim_id,
        )
        if not rental.releasing:
            # Its GPUs are free: a worker the fleet wants goes back there first. (One still
            # releasing frees them when the agent reports its container stopped.)
            await self.gpus_freed(rental.node_id)

    async def changed(self, rental: Rental) -> None:
        store = self.store
        await store.save_rental(
            rental.rental_id,
            rental.node_id,
            None if rental.holds_gpus else rental.ended_at,
            rental.to_json(),
        )
        holding = await store.rental_docs(rental.node_id, holding_only=True)
        self.nodes.rental_gpus[rental.node_id] = sum(int(d["gpus"]) for d in holding)
        self.nodes.load_changed(rental.node_id)
        for queue in self.watchers.of(rental.rental_id):
            queue.put_nowait(Rental.from_json(rental.to_json()))

    def _send_start(self, rental: Rental) -> None:
        self.send(
            rental.node_id,
            msg.StartRental(
                rental_id=rental.rental_id,
                image=rental.image,
                gpus=rental.gpus,
                renter=rental.renter,
            ),
        )

    def _send_stop(self, rental: Rental, reason: str) -> None:
        self.send(rental.node_id, msg.StopRental(rental_id=rental.rental_id, reason=reason))

    def watch(self, rental_id: str) -> asyncio.Queue[Rental]:
        return self.watchers.add(rental_id, asyncio.Queue())

    def unwatch(self, rental_id: str, queue: asyncio.Queue[Rental]) -> None:
        self.watchers.remove(rental_id, queue)
