"""The coordinator's live view of nodes and workers: the workload flags, the worker registry,
the routing table, the commands to agents, and the recovery loop.

The worker machine (`workers.py`) decides; this module carries out its effects (routes, drain
commands, events) and stores every worker after every change. Startup and the recovery loop
share one path (`rebuild`): nothing here lives only in memory that the store cannot rebuild
(DESIGN.md invariant 8).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from spotdrain.coordinator import workers as wm
from spotdrain.coordinator.placement import NodeView, PlacementRequest, admit
from spotdrain.coordinator.routes import RouteEntry, RouteTable
from spotdrain.coordinator.store import Store
from spotdrain.v1 import spotdrain_pb2 as pb

log = logging.getLogger("spotdrain.coordinator.fleet")

HEARTBEAT_TTL_S = 15.0  # three missed heartbeats
START_TIMEOUT_S = 300.0  # image pull and model load included
RECOVERY_EVERY_S = 2.0
FIRST_WORKER_PORT = 20000
PAUSE_TAINT_KEY = "spotdrain.io/paused"

Record = Callable[[str, str, dict[str, Any]], Awaitable[None]]


def _worker(doc: dict[str, Any]) -> wm.Worker:
    return wm.Worker.from_json(doc)


class PlacementRefused(Exception):
    def __init__(self, node_id: str, reason: str) -> None:
        super().__init__(f"placement on {node_id} refused: {reason}")
        self.node_id = node_id
        self.reason = reason


class Fleet:
    def __init__(
        self,
        store: Store,
        record: Record,
        clock: Callable[[], float] = time.time,
        heartbeat_ttl_s: float = HEARTBEAT_TTL_S,
        start_timeout_s: float = START_TIMEOUT_S,
    ):
        self.store = store
        self.start_timeout_s = start_timeout_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.record = record  # (kind, node_id, details) into the event log
        self.clock = clock
        self.workers: dict[str, wm.Worker] = {}
        self.routes = RouteTable()
        self.connected: dict[str, float] = {}
        # One queue of commands per connected agent stream.
        self.streams: dict[str, asyncio.Queue[pb.CoordinatorMessage]] = {}
        # Paused workers still draining when the owner resumed: replaced once they stop.
        self._replace_on_stop: dict[str, wm.Worker] = {}

    # --- rebuild and recovery ----------------------------------------------------------------

    def rebuild(self) -> None:
        """Load every live worker from the store and publish the ready ones."""
        now = self.clock()
        for doc in self.store.worker_docs(live_only=True):
            worker = _worker(doc)
            # The coordinator was away, not the nodes: give every agent a full ttl to
            # reconnect before any worker counts as missing.
            worker.expires_at = now + self.heartbeat_ttl_s
            self.workers[worker.worker_id] = worker
            if worker.state == wm.READY:
                self._publish(worker)

    async def recover(self) -> None:
        """Nodes whose workload is off (or that are draining) but still have workers: drain
        them again; ready workers whose node went silent: replace them. Run at start and every
        few seconds (DESIGN.md invariant 8)."""
        now = self.clock()
        for worker in self.live_workers():
            if worker.state == wm.STARTING and now - worker.created_at > self.start_timeout_s:
                # A start command lost with a broken stream, or an agent that never answered:
                # the worker must not hold its node's GPU forever.
                log.warning(
                    "recovery: worker %s on %s never started", worker.worker_id, worker.node_id
                )
                await self.record(
                    "worker_start_timeout",
                    worker.node_id,
                    {"worker_id": worker.worker_id, "model": worker.model},
                )
                await self.apply(worker, wm.Stopped(now, None))
                continue
            if (
                worker.state == wm.READY
                and worker.expired(now)
                and worker.node_id not in self.streams
            ):
                await self._replace_missing(worker, now)
        for node_id in self.store.nodes_needing_recovery():
            drain = self.node_drain(node_id)
            if drain is None:
                continue
            for worker in self.live_workers(node_id):
                if worker.state in (wm.STARTING, wm.READY):
                    log.info("recovery: draining worker %s on %s", worker.worker_id, node_id)
                    await self.apply(
                        worker,
                        wm.Drain(now, drain.reason, drain.grace_deadline, drain.terminate_at),
                    )

    async def recovery_loop(self) -> None:
        while True:
            try:
                await self.recover()
            except Exception:  # noqa: BLE001 (one bad record must not stop recovery)
                log.exception("recovery pass failed")
            await asyncio.sleep(RECOVERY_EVERY_S)

    # --- the node's switches -----------------------------------------------------------------

    def node_drain(self, node_id: str) -> wm.NodeDrain | None:
        """The drain the node is under, if any: the earliest deadlines of its active drains."""
        drains = self.store.active_drains(node_id)
        node = self.store.node(node_id)
        if not drains:
            if node is not None and not node.workload_enabled:
                # Disabled with no recorded drain (an operator's switch): drain with no grace
                # beyond the default owner's promise.
                now = self.clock()
                return wm.NodeDrain("pause", now + 110, now + 120)
            return None
        first = min(drains, key=lambda d: d.grace_deadline)
        reason = first.reason if first.reason in wm.DRAIN_REASONS else "operator"
        return wm.NodeDrain(reason, first.grace_deadline, min(d.terminate_at for d in drains))

    async def begin_drain(
        self, node_id: str, reclaim_id: str, reason: str, terminate_at: float, grace_deadline: float
    ) -> None:
        """A pause or a notice: (for a pause) the flag off; every worker on the node draining."""
        if reason == "pause" and self.store.set_workload(node_id, False):
            await self.record("workload_disabled", node_id, {"reclaim_id": reclaim_id})
        if terminate_at <= 0:  # an agent that sent no deadlines: the defaults from now
            terminate_at = self.clock() + 120
            grace_deadline = terminate_at - 10
        drain = self.store.start_drain(node_id, reclaim_id, reason, terminate_at, grace_deadline)
        now = self.clock()
        for worker in self.live_workers(node_id):
            await self.apply(
                worker,
                wm.Drain(
                    now,
                    reason if reason in wm.DRAIN_REASONS else "operator",
                    drain.grace_deadline,
                    drain.terminate_at,
                ),
            )

    async def end_pause(self, node_id: str, reclaim_id: str) -> None:
        """The owner's resume: flag on, pause drains ended, paused workers placed again."""
        ended = []
        for drain in self.store.active_drains(node_id):
            if drain.reason == "pause" and (not reclaim_id or drain.reclaim_id == reclaim_id):
                self.store.end_drain(node_id, drain.reclaim_id)
                ended.append(drain)
        # The pause's taints go, including one whose drain ended before (a repeated resume).
        for taint in self.store.taints(node_id):
            drain = self.store.drain(node_id, taint.reclaim_id)
            if taint.reason == "pause" and (drain is None or drain.ended_at is not None):
                self.store.remove_taint(node_id, taint.reclaim_id)
        # The owner's flag is the owner's: back on once no pause holds it (a provider's notice
        # in progress keeps the node tainted, not disabled).
        pauses = [d for d in self.store.active_drains(node_id) if d.reason == "pause"]
        if not pauses and self.store.set_workload(node_id, True):
            await self.record("workload_enabled", node_id, {"reclaim_id": reclaim_id})
        # The workers this pause took away come back, through the one gate. Only in the call
        # that ends the pause, so a repeated resume places nothing twice.
        graces = {d.grace_deadline for d in ended}
        for doc in self.store.worker_docs(node_id=node_id):
            worker = _worker(doc)
            if worker.drain_reason != "pause" or worker.grace_deadline not in graces:
                continue
            live = self.workers.get(worker.worker_id)
            if live is not None and live.state != wm.STOPPED:
                # Still draining: it holds its GPU until it stops; place the new one then.
                self._replace_on_stop[worker.worker_id] = worker
                continue
            await self._replace(worker)

    async def _replace_missing(self, worker: wm.Worker, now: float) -> None:
        """A ready worker whose node stopped heartbeating and is gone: out of the routes, and a
        replacement on the connected node with the fewest workers that the gate admits."""
        log.warning(
            "recovery: worker %s on %s missing since %.0f s",
            worker.worker_id,
            worker.node_id,
            now - (worker.expires_at or now),
        )
        await self.record("worker_missing", worker.node_id, {"worker_id": worker.worker_id})
        await self.apply(worker, wm.Stopped(now, None))
        candidates = sorted(self.streams, key=lambda n: (len(self.live_workers(n)), n))
        for node_id in candidates:
            try:
                await self.place_worker(
                    node_id, worker.model, worker.image, worker.capacity, path="recovery"
                )
                return
            except PlacementRefused:
                continue
        log.warning("recovery: no node admits a replacement for %s", worker.worker_id)

    async def _replace(self, worker: wm.Worker) -> None:
        try:
            await self.place_worker(
                worker.node_id, worker.model, worker.image, worker.capacity, path="resume"
            )
        except PlacementRefused as e:
            log.info("resume of %s: %s", worker.node_id, e)

    # --- the one placement gate --------------------------------------------------------------

    def node_view(self, node_id: str) -> NodeView | None:
        node = self.store.node(node_id)
        if node is None:
            return None
        busy = len(self.live_workers(node_id))
        return NodeView(
            node_id=node_id,
            workload_enabled=node.workload_enabled,
            tainted=bool(self.store.taints(node_id)),
            spot=node.spot,
            connected=node_id in self.streams,
            gpus_total=max(len(node.gpus), 1),
            gpus_in_use=busy,
        )

    async def place_worker(
        self,
        node_id: str,
        model: str,
        image: str,
        capacity: int,
        port: int = 0,
        path: str = "operator",
    ) -> wm.Worker:
        """Every path that puts a worker on a node comes through here (DESIGN.md invariant 4)."""
        view = self.node_view(node_id)
        why = (
            "unknown_node"
            if view is None
            else admit(view, PlacementRequest(kind="inference", gpus=1, path=path))
        )
        if why is not None:
            await self.record(
                "placement_refused", node_id, {"model": model, "path": path, "reason": why}
            )
            raise PlacementRefused(node_id, why)
        used = {w.port for w in self.live_workers(node_id)}
        if not port:
            port = next(
                p for p in range(FIRST_WORKER_PORT, FIRST_WORKER_PORT + 1000) if p not in used
            )
        worker = wm.Worker(
            worker_id=f"w-{uuid.uuid4().hex[:10]}",
            node_id=node_id,
            model=model,
            image=image,
            port=port,
            capacity=max(capacity, 1),
            created_at=self.clock(),
        )
        self.workers[worker.worker_id] = worker
        self._save(worker)
        await self.record(
            "worker_starting",
            node_id,
            {"worker_id": worker.worker_id, "model": model, "path": path},
        )
        self.send(
            node_id,
            pb.CoordinatorMessage(
                start_worker=pb.StartWorker(
                    worker_id=worker.worker_id,
                    model=model,
                    image=image,
                    port=port,
                    capacity=worker.capacity,
                )
            ),
        )
        return worker

    # --- what agents report ------------------------------------------------------------------

    async def worker_report(self, node_id: str, report: pb.WorkerReport) -> None:
        worker = self.workers.get(report.worker_id)
        if worker is None or worker.node_id != node_id:
            log.warning(
                "node %s reported unknown worker %s (%s)", node_id, report.worker_id, report.state
            )
            return
        now = self.clock()
        if report.state == "started":
            await self.apply(
                worker,
                wm.Started(
                    now, report.gate_address, max(report.capacity, 1), self.node_drain(node_id)
                ),
            )
        elif report.state in ("stopped", "refused"):
            if report.state == "refused":
                await self.record(
                    "worker_refused",
                    node_id,
                    {"worker_id": worker.worker_id, "reason": report.reason},
                )
            await self.apply(worker, wm.Stopped(now, report.exit_code))

    async def slots(self, node_id: str, reports: list[pb.WorkerSlots], heartbeat: bool) -> None:
        now = self.clock()
        for slot in reports:
            worker = self.workers.get(slot.worker_id)
            if worker is None or worker.node_id != node_id:
                continue
            claimed = slot.claimed_state if slot.claimed_state in wm.STATES else wm.READY
            if heartbeat:
                event: wm.Event = wm.Heartbeat(
                    now, claimed, slot.slots_in_use, self.heartbeat_ttl_s
                )
            else:
                event = wm.SlotsChanged(now, slot.slots_in_use)
            await self.apply(worker, event, save=heartbeat)
            self.routes.set_slots(worker.worker_id, worker.slots_in_use)

    async def registered(self, node_id: str, running: list[pb.WorkerReport]) -> None:
        """A node (re)connected: reconcile its workers with what it says is running."""
        seen = {r.worker_id for r in running}
        now = self.clock()
        lost = []
        for worker in self.live_workers(node_id):
            if worker.worker_id not in seen and worker.state != wm.STARTING:
                # Gone while we were apart (reboot, crash): only a stop ends draining, and
                # this is one.
                if worker.state == wm.READY:
                    lost.append(worker)
                await self.apply(worker, wm.Stopped(now, None))
        # A node back from a reboot gets its serving workers again, through the one gate: a
        # node that came back paused or tainted gets none (DESIGN.md invariant 4).
        for worker in lost:
            try:
                await self.place_worker(
                    node_id, worker.model, worker.image, worker.capacity, path="reregistration"
                )
            except PlacementRefused as e:
                log.info("re-registration of %s: %s", node_id, e)
        for report in running:
            await self.worker_report(node_id, report)
        for worker in self.live_workers(node_id):
            if worker.state == wm.DRAINING:
                self._send_drain(worker)

    # --- effects -----------------------------------------------------------------------------

    async def apply(self, worker: wm.Worker, event: wm.Event, save: bool = True) -> None:
        effects = worker.handle(event)
        if save or effects:
            self._save(worker)
        for effect in effects:
            match effect:
                case wm.RouteAdded(route):
                    self._publish(worker, route)
                case wm.RouteRemoved(worker_id):
                    self.routes.remove(worker_id)
                case wm.DrainOnNode():
                    self._send_drain(worker)
                case wm.WorkerEvent(kind, details):
                    await self.record(kind, worker.node_id, dict(details))
                case _:
                    raise TypeError(effect)
        if worker.state == wm.STOPPED:
            self.workers.pop(worker.worker_id, None)
            waiting = self._replace_on_stop.pop(worker.worker_id, None)
            if waiting is not None:
                await self._replace(waiting)

    def _publish(self, worker: wm.Worker, route: wm.Route | None = None) -> None:
        r = route or worker.route()
        self.routes.upsert(
            RouteEntry(
                r.worker_id, r.node_id, r.model, r.gate_address, worker.slots_in_use, r.capacity
            )
        )

    def _send_drain(self, worker: wm.Worker) -> None:
        # The node's reclamation, so what the drain cuts lands in that reclamation's timeline.
        drains = self.store.active_drains(worker.node_id)
        reclaim_id = min(drains, key=lambda d: d.grace_deadline).reclaim_id if drains else ""
        self.send(
            worker.node_id,
            pb.CoordinatorMessage(
                drain_worker=pb.DrainWorker(
                    worker_id=worker.worker_id,
                    reason=worker.drain_reason,
                    reclaim_id=reclaim_id,
                    grace_deadline=worker.grace_deadline or 0.0,
                    terminate_at=worker.terminate_at or 0.0,
                )
            ),
        )

    def send(self, node_id: str, message: pb.CoordinatorMessage) -> None:
        queue = self.streams.get(node_id)
        if queue is not None:
            queue.put_nowait(message)
        # Not connected: registration reconciles, and recovery re-sends drains.

    def _save(self, worker: wm.Worker) -> None:
        doc = worker.to_json()
        self.store.save_worker(worker.worker_id, worker.node_id, worker.model, worker.state, doc)

    def live_workers(self, node_id: str | None = None) -> list[wm.Worker]:
        return [
            w
            for w in self.workers.values()
            if w.state != wm.STOPPED and (node_id is None or w.node_id == node_id)
        ]

    def all_workers(self, node_id: str = "") -> list[wm.Worker]:
        docs = self.store.worker_docs(node_id=node_id or None)
        return [self.workers.get(d["worker_id"]) or _worker(d) for d in docs]
