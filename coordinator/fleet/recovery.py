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
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from spotdrain.coordinator.core import worker_machine as wm
from spotdrain.coordinator.fleet.drains import LIFTED_KEEP_S
from spotdrain.coordinator.fleet.nodes import REFUSED_EXAMPLES, summarize_refusals
from spotdrain.coordinator.store import StoreUnavailable
from spotdrain.coordinator.store.backend import Fenced

if TYPE_CHECKING:
    from spotdrain.coordinator.fleet.wiring import Fleet

log = logging.getLogger("spotdrain.coordinator.fleet.recovery")

RECOVERY_EVERY_S = 2.0
YIELD_EVERY = 500  # workers looked at between two yields to the event loop


class Recovery:
    def __init__(self, fleet: Fleet, node_gone_s: float) -> None:
        self.fleet = fleet
        self.node_gone_s = node_gone_s
        # Silence before this coordinator started is its own absence, not the nodes'.
        self.started_at = fleet.clock()
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
        fleet, store = self.fleet, self.fleet.store
        now = fleet.clock()
        self.started_at = now
        rental_gpus: dict[str, int] = {}
        for doc in await store.rental_docs(holding_only=True):
            rental_gpus[doc["node_id"]] = rental_gpus.get(doc["node_id"], 0) + int(doc["gpus"])
        fleet.nodes.load(
            await store.nodes(),
            await store.all_taints(),
            await store.avoided_groups(0.0),
            rental_gpus,
        )
        for doc in await store.worker_docs(live_only=True):
            worker = wm.Worker.from_json(doc)
            worker.expires_at = now + fleet.heartbeat_ttl_s
            fleet.registry.add(worker)
            if worker.state == wm.READY:
                fleet.publish(worker)
        fleet.drains.load(
            await store.active_drains(), await store.lifted_drains(now - LIFTED_KEEP_S)
        )
        fleet.drains.replace_on_stop = set(await store.replace_on_stop())
        fleet.capacity.backoff = await store.start_backoffs()
        fleet.risks.load(await store.node_risks(now))
        fleet.contracts.load(await store.contracts())
        self._unasked = await fleet.replacement.unasked(now)

    async def recover(self) -> None:
        """Nodes whose workload is off (or that are draining) but still have workers: drain
        them again; ready workers whose node went silent: replace them. Each node's part is
        its own: one that fails is recorded and the others are still recovered."""
        fleet = self.fleet
        now = fleet.clock()
        self._failed_now = set()
        while self._unasked:
            node_id, reclaim_id, terminate_at = self._unasked.pop()
            await self._for_node(node_id, self._ask_replacement(node_id, reclaim_id, terminate_at))
        for i, worker in enumerate(fleet.live_workers()):
            if i % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)
            await self._for_node(worker.node_id, self._recover_worker(worker, now))
        for node_id in await fleet.store.nodes_needing_recovery():
            await self._for_node(node_id, self._drain_node(node_id, now))
        self._failing = self._failed_now
        await fleet.rentals.recover(now, self.node_gone_s, self.started_at)
        await fleet.capacity.keep(path="recovery")

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
            await self.fleet.record(
                "recovery_failed", node_id, {"error": f"{type(e).__name__}: {e}"[:500]}, ""
            )

    async def _ask_replacement(self, node_id: str, reclaim_id: str, terminate_at: float) -> None:
        fleet = self.fleet
        models = tuple(sorted({w.model for w in fleet.live_workers(node_id)}))
        log.info("recovery: asking for %s's replacement (notice %s)", node_id, reclaim_id)
        await fleet.replacement.request(node_id, reclaim_id, terminate_at, models)

    async def _recover_worker(self, worker: wm.Worker, now: float) -> None:
        fleet = self.fleet
        if worker.state == wm.STOPPED:
            return  # stopped while this pass yielded
        if worker.state == wm.STARTING and now - worker.created_at > fleet.start_timeout_s:
            # A start command lost with a broken stream, or an agent that never answered:
            # the worker must not hold its node's GPU forever.
            log.warning("recovery: worker %s on %s never started", worker.worker_id, worker.node_id)
            await fleet.record(
                "worker_start_timeout",
                worker.node_id,
                {"worker_id": worker.worker_id, "model": worker.model},
                "",
            )
            await fleet.apply(worker, wm.Stopped(now, None))
            return
        if (
            worker.state == wm.READY
            and worker.expired(now)
            and worker.node_id not in fleet.nodes.streams
        ):
            await self._replace_missing(worker, now)

    async def _drain_node(self, node_id: str, now: float) -> None:
        fleet = self.fleet
        drain = await fleet.drains.node_drain(node_id)
        if drain is None:
            return
        for worker in fleet.live_workers(node_id):
            if worker.state in (wm.STARTING, wm.READY):
                log.info("recovery: draining worker %s on %s", worker.worker_id, node_id)
                await fleet.apply(
                    worker, wm.Drain(now, drain.reason, drain.grace_deadline, drain.terminate_at)
                )

    async def _replace_missing(self, worker: wm.Worker, now: float) -> None:
        """A ready worker whose node stopped heartbeating and is gone: out of the routes, and a
        replacement on the connected node with the fewest workers that the gate admits."""
        fleet = self.fleet
        log.warning(
            "recovery: worker %s on %s missing since %.0f s",
            worker.worker_id,
            worker.node_id,
            now - (worker.expires_at or now),
        )
        await fleet.record("worker_missing", worker.node_id, {"worker_id": worker.worker_id}, "")
        await fleet.apply(worker, wm.Stopped(now, None))
        if await fleet.store.model(worker.model) is not None and worker.kind == "inference":
            return  # the model's desired capacity decides what replaces it (capacity keeper)
        request = fleet.gate.request_for(worker.image, worker.kind, "recovery")
        node_id, refused = fleet.nodes.pick(request)
        what = {"model": worker.model, "workload": worker.kind, "path": "recovery"}
        if len(refused) <= REFUSED_EXAMPLES:
            for other, why in refused.items():
                await fleet.record("placement_refused", other, {**what, "reason": why}, "")
        else:  # a fleet's worth of refusals is one event, not one a node
            await fleet.record(
                "placement_refused", "", {**what, "refused": summarize_refusals(refused)}, ""
            )
        if node_id is None:
            log.warning("recovery: no node admits a replacement for %s", worker.worker_id)
            return
        await fleet.gate.place_worker(
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
