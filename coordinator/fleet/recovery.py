"""Startup and the recovery loop share one path (docs/design.md invariant 8, Nomad's drainer the
model): `rebuild` reads back from the store everything the fleet keeps in memory, and
`recover` (at start and every few seconds) drains what must drain, replaces what is gone and
keeps desired capacity.

After a start, every live worker gets a full heartbeat TTL from now: the coordinator was away,
not the nodes, so a restart never replaces a fleet's workers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from spotdrain.coordinator.capacity.keeper import CapacityKeeper
from spotdrain.coordinator.capacity.replacement import Replacement
from spotdrain.coordinator.capacity.risks import Risks
from spotdrain.coordinator.core import worker_machine as wm
from spotdrain.coordinator.fleet.contracts import Contracts
from spotdrain.coordinator.fleet.drains import LIFTED_KEEP_S, Drains
from spotdrain.coordinator.fleet.nodes import REFUSED_EXAMPLES, summarize_refusals
from spotdrain.coordinator.fleet.placer import Gate
from spotdrain.coordinator.fleet.registry import ApplyEvent, FleetState
from spotdrain.coordinator.fleet.rentals import RentalBook
from spotdrain.coordinator.store import StoreUnavailable
from spotdrain.coordinator.store.backend import Fenced

log = logging.getLogger("spotdrain.coordinator.fleet.recovery")

RECOVERY_EVERY_S = 2.0
YIELD_EVERY = 500  # workers looked at between two yields to the event loop


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
        self.risks, self.contracts = risks, contracts
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
        for doc in await store.worker_docs(live_only=True):
            worker = wm.Worker.from_json(doc)
            worker.expires_at = now + self.heartbeat_ttl_s
            self.registry.add(worker)
            if worker.state == wm.READY:
                self.publish(worker)
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
        them again; ready workers whose node went silent: replace them. Each node's part is
        its own: one that fails is recorded and the others are still recovered."""
        now = self.clock()
        self._failed_now = set()
        while self._unasked:
            node_id, reclaim_id, terminate_at = self._unasked.pop()
            await self._for_node(node_id, self._ask_replacement(node_id, reclaim_id, terminate_at))
        for i, worker in enumerate(self.registry.live()):
            if i % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)
            await self._for_node(worker.node_id, self._recover_worker(worker, now))
        for node_id in await self.store.nodes_needing_recovery():
            await self._for_node(node_id, self._drain_node(node_id, now))
        self._failing = self._failed_now
        await self.rentals.recover(now, self.node_gone_s, self.started_at)
        await self.capacity.keep(path="recovery")

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

    async def _recover_worker(self, worker: wm.Worker, now: float) -> None:
        if worker.state == wm.STOPPED:
            return  # stopped while this pass yielded
        if worker.state == wm.STARTING and now - worker.created_at > self.start_timeout_s:
            # A start command lost with a broken stream, or an agent that never answered:
            # the worker must not hold its node's GPU forever.
            log.warning("recovery: worker %s on %s never started", worker.worker_id, worker.node_id)
            await self.events.record(
                "worker_start_timeout",
                worker.node_id,
                {"worker_id": worker.worker_id, "model": worker.model},
                "",
            )
            await self.apply(worker, wm.Stopped(now, None))
            return
        if (
            worker.state == wm.READY
            and worker.expired(now)
            and worker.node_id not in self.nodes.streams
        ):
            await self._replace_missing(worker, now)

    async def _drain_node(self, node_id: str, now: float) -> None:
        drain = await self.drains.node_drain(node_id)
        if drain is None:
            return
        for worker in self.registry.live(node_id):
            if worker.state in (wm.STARTING, wm.READY):
                log.info("recovery: draining worker %s on %s", worker.worker_id, node_id)
                await self.apply(
                    worker, wm.Drain(now, drain.reason, drain.grace_deadline, drain.terminate_at)
                )

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
        """Every RECOVERY_EVERY_S. A pass that fails (the store away) is logged and the next one
        runs; a node's own failure never gets this far (`_for_node`). Anything else ends the
        loop, and the supervisor with it."""
        while True:
            try:
                await self.recover()
            except Exception:  # noqa: BLE001
                log.exception("recovery pass failed")
            await asyncio.sleep(RECOVERY_EVERY_S)
