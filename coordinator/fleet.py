"""The coordinator's live view of nodes and workers: the workload flags, the worker registry,
the routing table, rentals, desired capacity, replacement requests, the commands to agents, and
the recovery loop.

The worker machine (`workers.py`) decides; this module carries out its effects (routes, drain
commands, events) and stores every worker after every change. Startup and the recovery loop
share one path (`rebuild`): nothing here lives only in memory that the store cannot rebuild
(DESIGN.md invariant 8).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from spotdrain.background import Background
from spotdrain.coordinator import capacity
from spotdrain.coordinator import workers as wm
from spotdrain.coordinator.acquirer import (
    DEFAULT_AVOID_S,
    Acquirer,
    AcquisitionRequest,
    choose_target_group,
)
from spotdrain.coordinator.placement import NodeView, PlacementRequest, admit
from spotdrain.coordinator.rentals import Rental
from spotdrain.coordinator.routes import RouteEntry, RouteTable
from spotdrain.coordinator.store import NodeRow, Store
from spotdrain.v1 import spotdrain_pb2 as pb

log = logging.getLogger("spotdrain.coordinator.fleet")

HEARTBEAT_TTL_S = 15.0  # three missed heartbeats
START_TIMEOUT_S = 300.0  # image pull and model load included
RECOVERY_EVERY_S = 2.0
FIRST_WORKER_PORT = 20000
WORKER_PORTS = 1000  # a worker's slot gate listens on its port + the agent's gate offset
PAUSE_TAINT_KEY = "spotdrain.io/paused"
# A worker drained because its model has more than its desired count: its open requests get
# this long to finish before its gate cuts them.
SCALE_DOWN_GRACE_S = 60.0
# A running rental the node did not list when it registered: its stop report (queued on the
# agent, sent right after the registration) gets this long to arrive and say how it ended.
MISSING_RENTAL_GRACE_S = 5.0
# A model whose workers keep failing to start (a wrong image): the next try waits 5 s, 10 s,
# ... up to this, so a broken setting does not place a new worker every recovery pass.
START_BACKOFF_MAX_S = 300.0
# A node gone (no stream) this long has lost its rentals for good: they end as `platform`, so
# the renter is not told "running" about a machine that is not coming back.
NODE_GONE_S = 600.0

WORKER_KINDS = ("inference", "batch", "render")

# (kind, node_id, details, reclaim_id) into the event log.
Record = Callable[[str, str, dict[str, Any], str], Awaitable[None]]


def _worker(doc: dict[str, Any]) -> wm.Worker:
    return wm.Worker.from_json(doc)


class SpotChangeRefused(Exception):
    def __init__(self, node_id: str, rentals: Sequence[str], render: Sequence[str] = ()) -> None:
        held = []
        if rentals:
            held.append(f"{len(rentals)} active rental(s) ({', '.join(rentals)})")
        if render:
            held.append(f"{len(render)} render job(s) ({', '.join(render)}), never run on spot")
        super().__init__(
            f"node {node_id} has {' and '.join(held)}: its spot flag cannot change until they end"
        )
        self.node_id = node_id
        self.rentals = rentals


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
        acquirers: dict[str, Acquirer] | None = None,
        avoid_s: float = DEFAULT_AVOID_S,
        node_gone_s: float = NODE_GONE_S,
    ):
        self.store = store
        self.node_gone_s = node_gone_s
        # Silence before this coordinator started is its own absence, not the nodes'.
        self.started_at = clock()
        # Replacement capacity per node group, in the operator's order of preference.
        self.acquirers = dict(acquirers or {})
        self.avoid_s = avoid_s
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
        # Each rental's watchers (WatchRental streams): a queue of snapshots each.
        self.rental_watchers: dict[str, set[asyncio.Queue[Rental]]] = {}
        # Acquisitions in flight: nothing waits for them; a failure is logged.
        self._background = Background()
        self._short: set[str] = set()  # models whose desired capacity could not be met
        # One capacity pass at a time: two passes that both saw a shortage would both fill it.
        self._capacity_lock = asyncio.Lock()
        # Rentals a (re)registered node did not list, since when (see MISSING_RENTAL_GRACE_S).
        self._missing_rentals: dict[str, float] = {}
        # model -> (failed starts in a row, no new start before). Lost on restart: harmless.
        self._start_backoff: dict[str, tuple[int, float]] = {}
        # Notices whose replacement was never asked for (rebuild() finds them).
        self._unasked: list[tuple[str, str, float]] = []

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
        self._unasked = self._notices_never_asked(now)

    def _notices_never_asked(self, now: float) -> list[tuple[str, str, float]]:
        """Hard notices still in progress with no replacement request recorded: a coordinator
        that died between storing the drain and asking. (node, reclaim id, D) to ask for now."""
        handled = {"replacement_requested", "replacement_unavailable"}
        return [
            (d.node_id, d.reclaim_id, d.terminate_at)
            for d in self.store.active_drains()
            if d.reason == "notice"
            and now < d.terminate_at
            and not handled & {e.kind for e in self.store.events_of(d.reclaim_id)}
        ]

    async def recover(self) -> None:
        """Nodes whose workload is off (or that are draining) but still have workers: drain
        them again; ready workers whose node went silent: replace them. Run at start and every
        few seconds (DESIGN.md invariant 8)."""
        now = self.clock()
        while self._unasked:
            node_id, reclaim_id, terminate_at = self._unasked.pop()
            lost = [w for w in self.live_workers(node_id)]
            log.info("recovery: asking for %s's replacement (notice %s)", node_id, reclaim_id)
            self._request_replacement(node_id, reclaim_id, terminate_at, lost, now)
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
                    "",
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
        await self._recover_rentals(now)
        await self.keep_capacity(path="recovery")

    async def _recover_rentals(self, now: float) -> None:
        """A rental never reported started is given up, like a worker; one whose node has been
        gone for `node_gone_s`, or that its node no longer runs (and reported no stop for), has
        ended without a trace."""
        for rental in self.rentals(active_only=True):
            if rental.state == "starting" and now - rental.started_at > self.start_timeout_s:
                why = f"never reported started within {self.start_timeout_s:.0f} s"
                if rental.stopped(now, None, why):
                    await self._rental_ended(rental)
                    self._send_stop_rental(rental, "start timeout")
        for rental in self.rentals(active_only=True):
            node = self.store.node(rental.node_id)
            if rental.node_id in self.streams or node is None:
                continue
            gone_for = now - max(node.last_seen, self.started_at)
            why = f"its node has been gone for {gone_for:.0f} s"
            if gone_for > self.node_gone_s and rental.stopped(now, None, why, vanished=True):
                await self._rental_ended(rental)
        for rental_id, since in list(self._missing_rentals.items()):
            if now - since < MISSING_RENTAL_GRACE_S:
                continue
            del self._missing_rentals[rental_id]
            rental = self.rental(rental_id)
            why = "its container was gone when the node came back"
            if rental is not None and rental.stopped(now, None, why, vanished=True):
                await self._rental_ended(rental)

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
            await self.record("workload_disabled", node_id, {"reclaim_id": reclaim_id}, "")
        if terminate_at <= 0:  # an agent that sent no deadlines: the defaults from now
            terminate_at = self.clock() + 120
            grace_deadline = terminate_at - 10
        first = self.store.drain(node_id, reclaim_id) is None
        drain = self.store.start_drain(node_id, reclaim_id, reason, terminate_at, grace_deadline)
        now = self.clock()
        lost = [w for w in self.live_workers(node_id) if w.state != wm.DRAINING]
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
        # The renters are told when their containers stop: the grace deadline, so the node is
        # still verified empty by D.
        for rental in self.rentals(node_id, active_only=True):
            if rental.reclaim(drain.reclaim_id, reason, drain.grace_deadline):
                await self._rental_changed(rental)
                await self.record(
                    "rental_reclaim_set",
                    node_id,
                    {"rental_id": rental.rental_id, "reclaim_at": rental.reclaim_at},
                    drain.reclaim_id,
                )
        if first and reason == "notice":
            self._request_replacement(node_id, drain.reclaim_id, drain.terminate_at, lost, now)
        # Replacements start now, elsewhere, in parallel with this drain: the node is already
        # unschedulable (tainted or disabled), so the gate sends them to other nodes. In the
        # background: the Taint answer, which the agent waits for before signalling, does not.
        self._spawn(self.keep_capacity(path="recovery"))

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
        for drain in ended:
            await self.lift_reclaim(node_id, drain.reclaim_id)
        pauses = [d for d in self.store.active_drains(node_id) if d.reason == "pause"]
        if not pauses and self.store.set_workload(node_id, True):
            await self.record("workload_enabled", node_id, {"reclaim_id": reclaim_id}, "")
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
        await self.record("worker_missing", worker.node_id, {"worker_id": worker.worker_id}, "")
        await self.apply(worker, wm.Stopped(now, None))
        if self.store.model(worker.model) is not None and worker.kind == "inference":
            return  # the model's desired capacity decides what replaces it (keep_capacity)
        request = PlacementRequest(kind=worker.kind, path="recovery")
        node_id, refused = self._pick_node(request)
        for other, why in refused.items():
            await self.record(
                "placement_refused",
                other,
                {"model": worker.model, "workload": worker.kind, "path": "recovery", "reason": why},
                "",
            )
        if node_id is None:
            log.warning("recovery: no node admits a replacement for %s", worker.worker_id)
            return
        await self.place_worker(
            node_id, worker.model, worker.image, worker.capacity, path="recovery", kind=worker.kind
        )

    async def _replace(self, worker: wm.Worker) -> None:
        if self._enough(worker.model):
            return  # replaced elsewhere while the node was paused
        try:
            await self.place_worker(
                worker.node_id,
                worker.model,
                worker.image,
                worker.capacity,
                path="resume",
                kind=worker.kind,
            )
        except PlacementRefused as e:
            log.info("resume of %s: %s", worker.node_id, e)

    # --- desired capacity and replacement ----------------------------------------------------

    def _serving(self, model: str) -> list[wm.Worker]:
        """A model's workers that count toward its capacity: starting or ready, not draining."""
        return [
            w
            for w in self.live_workers()
            if w.model == model and w.kind == "inference" and w.state in (wm.STARTING, wm.READY)
        ]

    def _enough(self, model: str) -> bool:
        row = self.store.model(model)
        return row is not None and len(self._serving(model)) >= row.replicas

    def _pick_node(
        self, request: PlacementRequest, prefer: str = ""
    ) -> tuple[str | None, dict[str, str]]:
        views = [v for v in map(self.node_view, self.streams) if v is not None]
        return capacity.pick_node(views, request, prefer)

    async def keep_capacity(self, path: str = "recovery", prefer: str = "") -> None:
        """Every model with a desired count gets it, through the gate, on the least-loaded
        nodes that admit it; a model over its count has its newest extra workers drained."""
        async with self._capacity_lock:
            await self._keep_capacity(path, prefer)

    async def _keep_capacity(self, path: str, prefer: str) -> None:
        now = self.clock()
        for model in self.store.models():
            serving = self._serving(model.model)
            failures, retry_at = self._start_backoff.get(model.model, (0, 0.0))
            missing = model.replicas - len(serving)
            if failures and now < retry_at:
                missing = 0  # its last start failed: wait before the next try
            for _ in range(missing):
                request = PlacementRequest(kind="inference", path=path)
                node_id, refused = self._pick_node(request, prefer)
                if node_id is None:
                    # Recorded once per shortage, with why each node said no; not every pass.
                    if model.model not in self._short:
                        self._short.add(model.model)
                        await self.record(
                            "capacity_short",
                            "",
                            {
                                "model": model.model,
                                "replicas": model.replicas,
                                "serving": len(self._serving(model.model)),
                                "refused": refused,
                                "path": path,
                            },
                        )
                    break
                self._short.discard(model.model)
                await self.place_worker(node_id, model.model, model.image, model.slots, path=path)
            else:
                self._short.discard(model.model)
            for worker in capacity.surplus(serving, model.replicas):
                grace = now + SCALE_DOWN_GRACE_S
                await self.apply(worker, wm.Drain(now, "operator", grace, grace + 10))

    async def _start_failed(self, worker: wm.Worker) -> None:
        """A worker of a model with a desired count stopped before it ever served: back off
        before that model's next start (5 s, doubling, at most START_BACKOFF_MAX_S)."""
        if worker.kind != "inference" or self.store.model(worker.model) is None:
            return
        failures = self._start_backoff.get(worker.model, (0, 0.0))[0] + 1
        delay = min(START_BACKOFF_MAX_S, 5.0 * 2 ** (failures - 1))
        self._start_backoff[worker.model] = (failures, self.clock() + delay)
        await self.record(
            "capacity_start_failed",
            worker.node_id,
            {
                "model": worker.model,
                "worker_id": worker.worker_id,
                "failures": failures,
                "retry_in_s": delay,
            },
            "",
        )

    def _request_replacement(
        self, node_id: str, reclaim_id: str, terminate_at: float, lost: list[wm.Worker], now: float
    ) -> None:
        """A hard notice: avoid the node's group, and ask another group's acquirer for
        capacity. Recorded at once; the call itself runs in the background and nothing on the
        node (or the Taint answer) waits for it (DESIGN.md step 6)."""
        node = self.store.node(node_id)
        group = node.node_group if node is not None else ""
        elsewhere = ({n.node_group for n in self.store.nodes()} | set(self.acquirers)) - {group}
        # Avoiding the only group there is would stop every placement, replacements included.
        until = self.store.avoid_group(group, now + self.avoid_s) if elsewhere else None
        target = choose_target_group(
            group, list(self.acquirers), self.store.avoided_groups(now), now
        )
        request = AcquisitionRequest(
            request_id=f"acq-{reclaim_id}",
            reclaimed_node=node_id,
            reclaimed_group=group,
            target_group=target or "",
            gpus=len(node.gpus) if node is not None else 0,
            models=tuple(sorted({w.model for w in lost})),
            reason="notice",
            deadline=terminate_at,
        )
        details = {**json.loads(request.to_json()), "avoided_until": until}
        if target is None:
            details["detail"] = "no other node group has an acquirer that is not avoided"
            self._spawn(self.record("replacement_unavailable", node_id, details, reclaim_id))
            return
        self._spawn(self._acquire(self.acquirers[target], request, details, reclaim_id))

    async def _acquire(
        self, acquirer: Acquirer, request: AcquisitionRequest, details: dict, reclaim_id: str
    ) -> None:
        await self.record("replacement_requested", request.reclaimed_node, details, reclaim_id)
        result = await acquirer.request(request)
        await self.record(
            "replacement_result",
            request.reclaimed_node,
            {
                "request_id": result.request_id,
                "target_group": request.target_group,
                "ok": result.ok,
                "detail": result.detail,
                "duration_s": round(result.duration_s, 3),
                "response": result.response,
            },
            reclaim_id,
        )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._background.spawn(coro)

    # --- rentals -----------------------------------------------------------------------------

    def rentals(self, node_id: str | None = None, active_only: bool = False) -> list[Rental]:
        docs = self.store.rental_docs(node_id, holding_only=active_only)
        rentals = [Rental.from_json(d) for d in docs]
        return [r for r in rentals if r.active] if active_only else rentals

    def holding_rentals(self, node_id: str) -> list[Rental]:
        """Rentals whose GPUs are taken: active, or ended with their container still there."""
        return [Rental.from_json(d) for d in self.store.rental_docs(node_id, holding_only=True)]

    def rental(self, rental_id: str) -> Rental | None:
        doc = self.store.rental_doc(rental_id)
        return Rental.from_json(doc) if doc is not None else None

    async def create_rental(self, node_id: str, renter: str, image: str, gpus: int) -> Rental:
        """A renter's container on a node, through the one placement gate."""
        await self._admit(node_id, PlacementRequest(kind="rental", gpus=gpus, path="rental"), {})
        node = self.store.node(node_id)
        assert node is not None  # admitted
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
        await self._rental_changed(rental)
        await self.record(
            "rental_created",
            node_id,
            {"rental_id": rental.rental_id, "renter": renter, "spot": node.spot, "gpus": gpus},
            "",
        )
        self._send_start_rental(rental)
        return rental

    async def end_rental(self, rental: Rental, ended_by: str) -> Rental:
        if rental.end(self.clock(), ended_by):
            await self._rental_ended(rental)
            self._send_stop_rental(rental, ended_by)
        return rental

    def _send_stop_rental(self, rental: Rental, reason: str) -> None:
        self.send(
            rental.node_id,
            pb.CoordinatorMessage(
                stop_rental=pb.StopRental(rental_id=rental.rental_id, reason=reason)
            ),
        )

    async def rental_report(self, node_id: str, report: pb.RentalReport) -> None:
        rental = self.rental(report.rental_id)
        if rental is None or rental.node_id != node_id:
            log.warning("node %s reported unknown rental %s", node_id, report.rental_id)
            if report.state == "started":  # not ours: it must not keep the node's GPUs
                self.send(
                    node_id,
                    pb.CoordinatorMessage(
                        stop_rental=pb.StopRental(rental_id=report.rental_id, reason="unknown")
                    ),
                )
            return
        self._missing_rentals.pop(rental.rental_id, None)
        if report.state == "started":
            if not rental.active:  # ended while the agent was away: stop what still runs
                self._send_stop_rental(rental, "ended")
            elif rental.started(report.container):
                await self._rental_changed(rental)
            return
        if report.reclaim_id and rental.active:
            # Stopped by a reclamation this coordinator may never have heard of (a pause the
            # agent applied on its own): the end is that reclamation's.
            rental.reclaim(report.reclaim_id, report.reclaim_reason or "notice", report.reclaim_at)
        was_active, was_releasing = rental.active, rental.releasing
        if rental.stopped(self.clock(), report.exit_code, report.reason):
            if was_active:
                await self._rental_ended(rental)
            else:
                await self._rental_changed(rental)
                if was_releasing:  # its container is gone: the GPUs are free now
                    await self.keep_capacity(path="rental_end_restart", prefer=rental.node_id)

    async def lift_reclaim(self, node_id: str, reclaim_id: str) -> None:
        """A pause resumed or a notice cancelled before G: its rentals go on."""
        for rental in self.rentals(node_id, active_only=True):
            if rental.reclaim_lifted(reclaim_id, self.clock()):
                await self._rental_changed(rental)
                await self.record(
                    "rental_reclaim_lifted", node_id, {"rental_id": rental.rental_id}, reclaim_id
                )

    async def _reconcile_rentals(
        self, node_id: str, running: list[pb.RentalReport], complete: bool
    ) -> None:
        seen = {r.rental_id for r in running}
        for rental in self.rentals(node_id, active_only=True):
            if rental.rental_id in seen:
                continue
            if rental.state == "starting":
                self._send_start_rental(rental)  # the command may have been lost: it is idempotent
            elif complete:
                # Not ended yet: the agent's stop report, queued while it was away, comes
                # right after its registration and says how (recover() waits for it).
                self._missing_rentals.setdefault(rental.rental_id, self.clock())
        for report in running:
            await self.rental_report(node_id, report)

    async def _rental_ended(self, rental: Rental) -> None:
        await self._rental_changed(rental)
        await self.record(
            "rental_ended",
            rental.node_id,
            {
                "rental_id": rental.rental_id,
                "ended_by": rental.ended_by,
                "started_on_spot": rental.started_on_spot,
                "exit_code": rental.exit_code,
                "reclaim_at": rental.reclaim_at,
            },
            rental.reclaim_id,
        )
        if not rental.releasing:
            # Its GPUs are free: a worker the fleet wants goes back there first. (One still
            # releasing frees them when the agent reports its container stopped.)
            await self.keep_capacity(path="rental_end_restart", prefer=rental.node_id)

    async def _rental_changed(self, rental: Rental) -> None:
        self.store.save_rental(
            rental.rental_id,
            rental.node_id,
            None if rental.holds_gpus else rental.ended_at,
            rental.to_json(),
        )
        for queue in self.rental_watchers.get(rental.rental_id, ()):
            queue.put_nowait(Rental.from_json(rental.to_json()))

    def _send_start_rental(self, rental: Rental) -> None:
        self.send(
            rental.node_id,
            pb.CoordinatorMessage(
                start_rental=pb.StartRental(
                    rental_id=rental.rental_id,
                    image=rental.image,
                    gpus=rental.gpus,
                    renter=rental.renter,
                )
            ),
        )

    def watch_rental(self, rental_id: str) -> asyncio.Queue[Rental]:
        queue: asyncio.Queue[Rental] = asyncio.Queue()
        self.rental_watchers.setdefault(rental_id, set()).add(queue)
        return queue

    def unwatch_rental(self, rental_id: str, queue: asyncio.Queue[Rental]) -> None:
        watchers = self.rental_watchers.get(rental_id, set())
        watchers.discard(queue)
        if not watchers:
            self.rental_watchers.pop(rental_id, None)

    # --- the spot flag -----------------------------------------------------------------------

    async def set_spot(self, node_id: str, spot: bool) -> NodeRow:
        """An operator's (the dashboard's) change of a node's spot flag. Refused while the node
        has an active rental, so no provider can switch to spot mid-rental (invariant 9)."""
        node = self.store.node(node_id)
        if node is None:
            raise KeyError(node_id)
        active = [r.rental_id for r in self.rentals(node_id, active_only=True)]
        # Render is never on spot: a node with render jobs cannot become one under them.
        render = [w.worker_id for w in self.render_jobs(node_id)] if spot else []
        if (active or render) and node.spot != spot:
            await self.record(
                "spot_change_refused",
                node_id,
                {"spot": spot, "active_rentals": active, "render_jobs": render},
                "",
            )
            raise SpotChangeRefused(node_id, active, render)
        self.store.set_spot(node_id, spot)
        if node.spot != spot:
            await self.record("node_spot_changed", node_id, {"spot": spot, "was": node.spot}, "")
        changed = self.store.node(node_id)
        assert changed is not None
        return changed

    def render_jobs(self, node_id: str) -> list[wm.Worker]:
        return [w for w in self.live_workers(node_id) if w.kind == "render"]

    # --- the one placement gate --------------------------------------------------------------

    def node_view(self, node_id: str) -> NodeView | None:
        node = self.store.node(node_id)
        if node is None:
            return None
        # One GPU per worker and a rental's own count: promised GPUs are in use from the
        # moment of placement, so nothing is double-booked.
        busy = len(self.live_workers(node_id)) + sum(r.gpus for r in self.holding_rentals(node_id))
        return NodeView(
            node_id=node_id,
            workload_enabled=node.workload_enabled,
            tainted=bool(self.store.taints(node_id)),
            spot=node.spot,
            connected=node_id in self.streams,
            gpus_total=max(len(node.gpus), 1),
            gpus_in_use=busy,
            group_avoided=node.node_group in self.store.avoided_groups(self.clock()),
        )

    async def _admit(self, node_id: str, request: PlacementRequest, what: dict[str, Any]) -> None:
        """The gate's answer for `request` on `node_id`; a refusal is recorded and raised."""
        view = self.node_view(node_id)
        why = "unknown_node" if view is None else admit(view, request)
        if why is not None:
            await self.record(
                "placement_refused",
                node_id,
                {**what, "workload": request.kind, "path": request.path, "reason": why},
                "",
            )
            raise PlacementRefused(node_id, why)

    async def place_worker(
        self,
        node_id: str,
        model: str,
        image: str,
        capacity: int,
        port: int = 0,
        path: str = "operator",
        kind: str = "inference",
    ) -> wm.Worker:
        """Every path that puts a worker on a node comes through here (DESIGN.md invariant 4)."""
        if kind not in WORKER_KINDS:
            raise ValueError(f"worker kind must be one of {WORKER_KINDS}, got {kind!r}")
        await self._admit(node_id, PlacementRequest(kind=kind, gpus=1, path=path), {"model": model})
        if not port:
            port = self._free_port(node_id)
        worker = wm.Worker(
            worker_id=f"w-{uuid.uuid4().hex[:10]}",
            node_id=node_id,
            model=model,
            image=image,
            port=port,
            capacity=max(capacity, 1),
            created_at=self.clock(),
            kind=kind,
        )
        self.workers[worker.worker_id] = worker
        self._save(worker)
        await self.record(
            "worker_starting",
            node_id,
            {"worker_id": worker.worker_id, "model": model, "path": path, "workload": kind},
            "",
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
                    kind=kind,
                )
            ),
        )
        return worker

    def _free_port(self, node_id: str) -> int:
        """A worker port free on the node. Ports unused anywhere in the fleet come first, so
        several agents sharing one host (a lab, the demo) never collide while the range lasts;
        only a port in use on this node itself is ruled out."""
        ports = range(FIRST_WORKER_PORT, FIRST_WORKER_PORT + WORKER_PORTS)
        on_node = {w.port for w in self.live_workers(node_id)}
        in_fleet = {w.port for w in self.live_workers()}
        free = next((p for p in ports if p not in in_fleet), None)
        if free is None:
            free = next((p for p in ports if p not in on_node), None)
        if free is None:
            raise PlacementRefused(node_id, "no_free_port")
        return free

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
                    self.node_drain(node_id),
                    routed=worker.routed,
                ),
            )
        elif report.state in ("stopped", "refused"):
            if report.state == "refused":
                await self.record(
                    "worker_refused",
                    node_id,
                    {"worker_id": worker.worker_id, "reason": report.reason},
                    "",
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

    async def registered(
        self,
        node_id: str,
        running: list[pb.WorkerReport],
        rentals: Sequence[pb.RentalReport] = (),
        complete: bool = True,
    ) -> None:
        """A node (re)connected: reconcile its workers with what it says is running. With an
        incomplete inventory (Docker was down at the agent's start) nothing missing from the
        lists counts as gone: it is the list that is short."""
        seen = {r.worker_id for r in running}
        now = self.clock()
        lost = []
        for worker in self.live_workers(node_id):
            if complete and worker.worker_id not in seen and worker.state != wm.STARTING:
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
                    node_id,
                    worker.model,
                    worker.image,
                    worker.capacity,
                    path="reregistration",
                    kind=worker.kind,
                )
            except PlacementRefused as e:
                log.info("re-registration of %s: %s", node_id, e)
        for report in running:
            await self.worker_report(node_id, report)
        for worker in self.live_workers(node_id):
            if worker.state == wm.DRAINING:
                self._send_drain(worker)
        await self._reconcile_rentals(node_id, list(rentals), complete)

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
                    await self.record(kind, worker.node_id, dict(details), "")
                case _:
                    raise TypeError(effect)
        if worker.state == wm.READY:
            self._start_backoff.pop(worker.model, None)
        if worker.state == wm.STOPPED:
            if worker.story and worker.story[-1][2:] == (wm.STARTING, wm.STOPPED):
                await self._start_failed(worker)
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
