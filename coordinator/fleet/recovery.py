"""Startup and the recovery loop share one path (docs/design.md invariant 8, Nomad's drainer the
model): `rebuild` reads back from the store everything the fleet keeps in memory, and
`recover` (at start and every few seconds) drains what must drain and keeps desired capacity.

Start timeouts, heartbeat expiries and node-gone times are not found by looking at every
worker: they sit in one heap of deadlines (coordinator/core/deadlines.py), rebuilt from the
store by `rebuild`, kept current by `watch` (after every event a worker handles, every save)
and by `connection_changed`, and fired by one timer task that sleeps until the earliest. A
firing re-checks the worker or node as it is now before it acts.

After a start, every live worker gets a full heartbeat TTL from now: the coordinator was away,
not the nodes, so a restart never replaces a fleet's workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Coroutine
from typing import Any

from spotdrain.coordinator.capacity.contracts import Contracts
from spotdrain.coordinator.capacity.keeper import CapacityKeeper
from spotdrain.coordinator.capacity.replacement import Replacement
from spotdrain.coordinator.capacity.risks import Risks
from spotdrain.coordinator.core import worker_machine as wm
from spotdrain.coordinator.core.deadlines import Deadlines
from spotdrain.coordinator.fleet.drains import LIFTED_KEEP_S, Drains
from spotdrain.coordinator.fleet.lost import LostNodes
from spotdrain.coordinator.fleet.nodes import REFUSED_EXAMPLES, summarize_refusals
from spotdrain.coordinator.fleet.placer import Gate
from spotdrain.coordinator.fleet.registry import ApplyEvent, FleetState
from spotdrain.coordinator.fleet.rentals import RentalBook
from spotdrain.coordinator.store import StoreUnavailable
from spotdrain.coordinator.store.backend import Fenced

log = logging.getLogger("spotdrain.coordinator.fleet.recovery")

RECOVERY_EVERY_S = 2.0
YIELD_EVERY = 500  # deadlines fired between two yields to the event loop
# The timer's longest sleep: a wall clock that jumps, or a deadline set without a wake, waits
# at most this long.
TIMER_MAX_SLEEP_S = RECOVERY_EVERY_S
# A firing that failed (the store away, a record this code cannot handle) is tried again then.
RETRY_S = RECOVERY_EVERY_S

# The heap's keys: (kind, worker id) or (NODE_GONE / NODE_LOST, node id).
START = "start"  # a starting worker not started by created_at + start timeout
EXPIRY = "expiry"  # a ready worker's last heartbeat + ttl
# A disconnected node under a reclamation: its rentals end after node_gone_s.
NODE_GONE = "node_gone"
NODE_LOST = "node_lost"  # a disconnected node with work and no reclamation: lost (lost.py)
NODE_KEYS = (NODE_GONE, NODE_LOST)
Key = tuple[str, str]


class Recovery:
    def __init__(
        self,
        state: FleetState,
        *,
        apply: ApplyEvent,
        publish: Callable[[wm.Worker], None],
        gate: Gate,
        drains: Drains,
        rentals: RentalBook,
        capacity: CapacityKeeper,
        replacement: Replacement,
        risks: Risks,
        contracts: Contracts,
        lost: LostNodes,
        heartbeat_ttl_s: float,
        start_timeout_s: float,
        node_gone_s: float,
    ) -> None:
        self.store, self.events, self.clock = state.store, state.events, state.clock
        self.nodes, self.registry = state.nodes, state.registry
        self.apply = apply
        self.publish = publish
        # Every part whose memory `rebuild` reads back or whose work `recover` redoes.
        self.gate, self.drains, self.rentals = gate, drains, rentals
        self.capacity, self.replacement = capacity, replacement
        self.risks, self.contracts, self.lost = risks, contracts, lost
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.start_timeout_s = start_timeout_s
        self.node_gone_s = node_gone_s
        # Silence before this coordinator started is its own absence, not the nodes'.
        self.started_at = state.clock()
        # Notices whose replacement was never asked for (rebuild() finds them).
        self._unasked: list[tuple[str, str, float]] = []
        # Nodes whose part of the last pass failed: each recorded once, until a pass gets
        # through it (or it fails again after one did).
        self._failing: set[str] = set()
        self._failed_now: set[str] = set()
        self.deadlines: Deadlines[Key] = Deadlines()
        self._wake = asyncio.Event()  # a deadline earlier than the one the timer sleeps to
        self._firing_failed: set[str] = set()  # nodes a firing failed for, recorded once
        self.passes = 0

    async def rebuild(self) -> None:
        """Load the fleet from the store: nodes, taints, avoided groups, booked rental GPUs,
        live workers (the ready ones published), paused workers waiting to be replaced, start
        backoffs, and notices still waiting for their replacement request."""
        store = self.store
        now = self.clock()
        self.started_at = now
        rental_gpus: dict[str, int] = {}
        for doc in await store.rental_docs(holding_only=True):
            rental_gpus[doc["node_id"]] = rental_gpus.get(doc["node_id"], 0) + int(doc["gpus"])
        self.nodes.load(
            await store.nodes(),
            await store.all_taints(),
            await store.avoided_groups(0.0),
            rental_gpus,
        )
        # The heap is the store's, read back: a start timeout that fell due while no
        # coordinator ran fires at the timer's first pass.
        self.deadlines = Deadlines()
        for doc in await store.worker_docs(live_only=True):
            worker = wm.Worker.from_json(doc)
            worker.expires_at = now + self.heartbeat_ttl_s
            self.registry.add(worker)
            self.watch(worker)
            if worker.state == wm.READY:
                self.publish(worker)
        await self.lost.load()
        for node_id in self.nodes.rows:
            if node_id not in self.nodes.streams:
                self._arm((NODE_GONE, node_id), now + self.node_gone_s)
                self._arm((NODE_LOST, node_id), now + self.lost.node_lost_s)
        self._wake.set()
        self.drains.load(
            await store.active_drains(), await store.lifted_drains(now - LIFTED_KEEP_S)
        )
        self.drains.replace_on_stop = set(await store.replace_on_stop())
        self.capacity.backoff = await store.start_backoffs()
        self.risks.load(await store.node_risks(now))
        self.contracts.load(await store.contracts())
        self._unasked = await self.replacement.unasked(now)

    async def recover(self) -> None:
        """Nodes whose workload is off (or that are draining) but still have workers: drain
        them again (workers that time out are the deadline timer's, not this pass's). Each
        node's part is its own: one that fails is recorded and the others are still recovered."""
        now = self.clock()
        self._failed_now = set()
        while self._unasked:
            node_id, reclaim_id, terminate_at = self._unasked.pop()
            await self._for_node(node_id, self._ask_replacement(node_id, reclaim_id, terminate_at))
        for node_id in await self.store.nodes_needing_recovery():
            await self._for_node(node_id, self._drain_node(node_id, now))
        self._failing = self._failed_now
        # A node gone for good is the heap's (NODE_GONE), so the book's own node-gone test is
        # given an infinite wait; its start timeouts and missing rentals are still its own.
        await self.rentals.recover(now, math.inf, self.started_at)
        await self.capacity.keep(path="recovery")
        self.passes += 1  # a pass that ran to its end (/metrics: spotdrain_recovery_passes)

    async def _for_node(self, node_id: str, step: Coroutine[Any, Any, None]) -> None:
        """One node's step of a pass. A failure is that node's, never the fleet's: logged and
        recorded (`recovery_failed`) the first pass it fails in, and the pass goes on."""
        try:
            await step
        except (StoreUnavailable, Fenced):
            raise  # the store away, or the lead lost: the whole pass's, the loop's to log
        except Exception as e:  # noqa: BLE001 (a record this code cannot handle is data)
            if node_id in self._failing or node_id in self._failed_now:
                self._failed_now.add(node_id)
                return
            self._failed_now.add(node_id)
            log.exception("recovery: node %s failed; the other nodes go on", node_id)
            await self.events.record(
                "recovery_failed", node_id, {"error": f"{type(e).__name__}: {e}"[:500]}, ""
            )

    async def _ask_replacement(self, node_id: str, reclaim_id: str, terminate_at: float) -> None:
        models = tuple(sorted({w.model for w in self.registry.live(node_id)}))
        log.info("recovery: asking for %s's replacement (notice %s)", node_id, reclaim_id)
        await self.replacement.request(node_id, reclaim_id, terminate_at, models)

    # --- the deadline heap ------------------------------------------------------------------

    def watch(self, worker: wm.Worker) -> None:
        """Arm the worker's one deadline from its state as it is now: the start timeout while
        it starts; while it is ready, its expiry, but only when its node's stream is closed
        (a worker is missing when both hold, so a connected fleet's heartbeats arm nothing);
        none after. Called after every event it handles and every save."""
        start, expiry = (START, worker.worker_id), (EXPIRY, worker.worker_id)
        if worker.state == wm.STARTING:
            self._arm(start, worker.created_at + self.start_timeout_s)
            self.deadlines.cancel(expiry)
            return
        self.deadlines.cancel(start)
        if (
            worker.state == wm.READY
            and worker.expires_at is not None
            and worker.node_id not in self.nodes.streams
        ):
            self._arm(expiry, worker.expires_at)
        else:
            self.deadlines.cancel(expiry)

    def connection_changed(self, node_id: str, connected: bool) -> None:
        """A node's stream opened or closed (coordinator/fleet/nodes.py): its node-gone time
        cancelled or armed, and its ready workers' expiries with it (a few workers a node)."""
        gone, lost = (NODE_GONE, node_id), (NODE_LOST, node_id)
        if connected:
            self.deadlines.cancel(gone)
            self.deadlines.cancel(lost)
        else:
            self._arm(gone, self.clock() + self.node_gone_s)
            self._arm(lost, self.clock() + self.lost.node_lost_s)
        for worker in self.registry.live(node_id):
            self.watch(worker)

    def _arm(self, key: Key, at: float) -> None:
        if self.deadlines.set(key, at):
            self._wake.set()

    async def fire_due(self) -> int:
        """Every deadline due now, each re-checked against the worker or node as it is now.
        A firing that fails is that node's: recorded once (`recovery_failed`) and tried again
        after RETRY_S; the store away or the lead lost re-arms the rest and ends the pass."""
        now = self.clock()
        due = self.deadlines.pop_due(now)
        for i, key in enumerate(due):
            if i % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)
            node_id = self._node_of(key)
            try:
                await self._fire(key, now)
            except (StoreUnavailable, Fenced):
                for later in due[i:]:
                    self._arm(later, now + RETRY_S)
                raise
            except Exception as e:  # noqa: BLE001 (a record this code cannot handle is data)
                self._arm(key, now + RETRY_S)
                if node_id in self._firing_failed:
                    continue
                self._firing_failed.add(node_id)
                log.exception("recovery: %s for node %s failed; the others go on", key, node_id)
                await self.events.record(
                    "recovery_failed", node_id, {"error": f"{type(e).__name__}: {e}"[:500]}, ""
                )
            else:
                self._firing_failed.discard(node_id)
        return len(due)

    def _node_of(self, key: Key) -> str:
        kind, ident = key
        if kind in NODE_KEYS:
            return ident
        worker = self.registry.get(ident)
        return worker.node_id if worker is not None else ""

    async def _fire(self, key: Key, now: float) -> None:
        kind, ident = key
        if kind == NODE_GONE:
            await self._node_gone(ident, now)
            return
        if kind == NODE_LOST:
            await self._node_lost(ident, now)
            return
        worker = self.registry.get(ident)
        if worker is None:
            return  # stopped since: its deadline went with it
        if kind == START and worker.state == wm.STARTING:
            await self._start_timed_out(worker, now)
        elif kind == EXPIRY and worker.state == wm.READY:
            if not worker.expired(now) or worker.node_id in self.nodes.streams:
                self.watch(worker)  # refreshed, or its node back, at this very moment
            else:
                await self._replace_missing(worker, now)

    async def _start_timed_out(self, worker: wm.Worker, now: float) -> None:
        # A start command lost with a broken stream, or an agent that never answered: the
        # worker must not hold its node's GPU forever.
        log.warning("recovery: worker %s on %s never started", worker.worker_id, worker.node_id)
        await self.events.record(
            "worker_start_timeout",
            worker.node_id,
            {"worker_id": worker.worker_id, "model": worker.model},
            "",
        )
        await self.apply(worker, wm.Stopped(now, None))

    async def _node_lost(self, node_id: str, now: float) -> None:
        """A node away node_lost_s (counted like node_gone_s), with work and no reclamation
        open, is lost (coordinator/fleet/lost.py)."""
        row = self.nodes.rows.get(node_id)
        if node_id in self.nodes.streams or row is None:
            return
        since = max(row.last_seen, self.started_at)
        if now < since + self.lost.node_lost_s:
            self._arm((NODE_LOST, node_id), since + self.lost.node_lost_s)
            return
        why = f"no stream and no heartbeat for {now - since:.0f} s, and no notice"
        await self.lost.declare(node_id, why, since, need_work=True)

    async def _node_gone(self, node_id: str, now: float) -> None:
        """A node under a reclamation: its rentals end once it has been gone node_gone_s
        (`reclaim`: the reclamation's end), counted from when it was last seen or this
        coordinator started, whichever is later. A node with none is the lost path's."""
        row = self.nodes.rows.get(node_id)
        if node_id in self.nodes.streams or row is None:
            return
        if not self.lost.reclamation_open(node_id):
            return
        since = max(row.last_seen, self.started_at)
        if now < since + self.node_gone_s:
            self._arm((NODE_GONE, node_id), since + self.node_gone_s)  # seen since it was armed
            return
        why = f"its node has been gone for {now - since:.0f} s"
        for rental in await self.rentals.list(node_id, active_only=True):
            if rental.stopped(now, None, why, vanished=True):
                await self.rentals.ended(rental)

    async def _drain_node(self, node_id: str, now: float) -> None:
        drain = await self.drains.node_drain(node_id)
        if drain is None:
            return
        for worker in self.registry.live(node_id):
            if worker.state in (wm.STARTING, wm.READY):
                log.info("recovery: draining worker %s on %s", worker.worker_id, node_id)
                await self.apply(worker, wm.Drain(now, drain))

    async def _replace_missing(self, worker: wm.Worker, now: float) -> None:
        """A ready worker whose node stopped heartbeating and is gone: out of the routes, and a
        replacement on the connected node with the fewest workers that the gate admits."""
        log.warning(
            "recovery: worker %s on %s missing since %.0f s",
            worker.worker_id,
            worker.node_id,
            now - (worker.expires_at or now),
        )
        await self.events.record(
            "worker_missing", worker.node_id, {"worker_id": worker.worker_id}, ""
        )
        await self.apply(worker, wm.Stopped(now, None))
        if await self.store.model(worker.model) is not None and worker.kind == "inference":
            return  # the model's desired capacity decides what replaces it (capacity keeper)
        request = self.gate.request_for(worker.image, worker.kind, "recovery")
        node_id, refused = self.nodes.pick(request)
        what = {"model": worker.model, "workload": worker.kind, "path": "recovery"}
        if len(refused) <= REFUSED_EXAMPLES:
            for other, why in refused.items():
                await self.events.record("placement_refused", other, {**what, "reason": why}, "")
        else:  # a fleet's worth of refusals is one event, not one a node
            await self.events.record(
                "placement_refused", "", {**what, "refused": summarize_refusals(refused)}, ""
            )
        if node_id is None:
            log.warning("recovery: no node admits a replacement for %s", worker.worker_id)
            return
        await self.gate.place_worker(
            node_id, worker.model, worker.image, worker.capacity, path="recovery", kind=worker.kind
        )

    async def loop(self) -> None:
        """The pass every RECOVERY_EVERY_S and the deadline timer, side by side. A pass that
        fails (the store away) is logged and the next one runs; a node's own failure never gets
        this far (`_for_node`). Anything else ends the loop, and the supervisor with it."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.timer())
            while True:
                try:
                    await self.recover()
                except Exception:  # noqa: BLE001
                    log.exception("recovery pass failed")
                await asyncio.sleep(RECOVERY_EVERY_S)

    async def timer(self) -> None:
        """Sleeps until the earliest deadline (or a wake: an earlier one was armed), fires what
        is due, and again. Its cost is the deadlines due, not the fleet."""
        while True:
            try:
                await self.fire_due()
            except Exception:  # noqa: BLE001
                log.exception("deadline pass failed")
            self._wake.clear()
            next_at = self.deadlines.next_at()
            wait = TIMER_MAX_SLEEP_S
            if next_at is not None:
                wait = min(max(next_at - self.clock(), 0.0), TIMER_MAX_SLEEP_S)
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel that lands as
            # the wake is set (a stream closing as the process stops), and the timer ran on.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._wake.wait()
