"""gRPC servicers. Thin: check who is calling, convert, call the store, map errors to codes.

A node acts only on its own records (DESIGN.md "Security", like Kubernetes' NodeRestriction): its
identity comes from its client certificate; a message naming another node is refused with
PERMISSION_DENIED and the attempt is recorded as `identity_refused`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from spotdrain.coordinator import reputation
from spotdrain.coordinator import workers as wm
from spotdrain.coordinator.acquirer import DEFAULT_AVOID_S, Acquirer
from spotdrain.coordinator.fleet import WORKER_KINDS, Fleet, PlacementRefused, SpotChangeRefused
from spotdrain.coordinator.rentals import END_CALLERS, Rental
from spotdrain.coordinator.routes import RouteEntry
from spotdrain.coordinator.store import EventRow, NodeRow, Store
from spotdrain.metrics import CollectorRegistry, GaugeCollector, ReclamationMetrics
from spotdrain.security import (
    NODE,
    OPERATOR,
    PROVIDER,
    RENTER,
    ROUTER,
    Identity,
    parse_common_name,
)
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

log = logging.getLogger("spotdrain.coordinator")


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Coordinator:
    """The coordinator's state behind the servicers: the store plus who is connected."""

    def __init__(
        self,
        store: Store,
        insecure: bool,
        clock: Callable[[], float] = time.time,
        heartbeat_ttl_s: float = 15.0,
        start_timeout_s: float = 300.0,
        acquirers: dict[str, Acquirer] | None = None,
        avoid_s: float = DEFAULT_AVOID_S,
        node_gone_s: float = 600.0,
    ):
        self.store = store
        self.insecure = insecure
        self.clock = clock
        self._new_event = asyncio.Condition()
        self.fleet = Fleet(
            store,
            self.record,
            clock,
            heartbeat_ttl_s,
            start_timeout_s,
            acquirers=acquirers,
            avoid_s=avoid_s,
            node_gone_s=node_gone_s,
        )
        self.registry = CollectorRegistry()
        self.metrics = ReclamationMetrics(self.registry)
        self.registry.register(
            GaugeCollector(
                "spotdrain_workers",
                "Inference workers by state.",
                ["state"],
                self._workers_by_state,
            )
        )
        self.registry.register(
            GaugeCollector(
                "spotdrain_slots_in_use",
                "Slots in use per ready worker, as its gate counts them.",
                ["worker_id", "node_id", "model"],
                self._slots_in_use,
            )
        )
        self.registry.register(
            GaugeCollector(
                "spotdrain_nodes_connected",
                "Agents with a live stream.",
                [],
                lambda: [([], float(len(self.fleet.streams)))],
            )
        )

    def _workers_by_state(self) -> list[tuple[list[str], float]]:
        counts = dict.fromkeys(wm.STATES, 0)
        for worker in self.fleet.workers.values():
            counts[worker.state] += 1
        return [([state], float(n)) for state, n in counts.items()]

    def _slots_in_use(self) -> list[tuple[list[str], float]]:
        return [
            ([w.worker_id, w.node_id, w.model], float(w.slots_in_use))
            for w in self.fleet.workers.values()
            if w.state == wm.READY
        ]

    @property
    def connected(self) -> dict[str, float]:
        return self.fleet.connected

    # --- identity ----------------------------------------------------------------------------

    def identity(self, context: grpc.aio.ServicerContext, claimed_node: str = "") -> Identity:
        """Who is calling. Plaintext (--insecure) trusts the claim; TLS trusts the certificate."""
        if self.insecure:
            return Identity(NODE, claimed_node) if claimed_node else Identity(OPERATOR, "insecure")
        names = context.auth_context().get("x509_common_name") or []
        identity = parse_common_name(names[0].decode()) if names else None
        if identity is None:
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, "client certificate names no identity")
        return identity

    async def refuse_foreign(
        self, identity: Identity, claimed_node: str, what: str, peer: str
    ) -> None:
        """Refuse (and record) a node acting for another node or a non-node acting as one."""
        if identity.role == NODE and identity.name == claimed_node:
            return
        await self.record(
            "identity_refused",
            node_id=identity.name if identity.role == NODE else "",
            details={
                "identity": str(identity),
                "claimed_node": claimed_node,
                "call": what,
                "peer": peer,
            },
        )
        log.warning("refused %s from %s claiming node %r (%s)", what, identity, claimed_node, peer)
        raise Refused(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{identity} may not act for node {claimed_node!r}",
        )

    def require_operator(self, identity: Identity) -> None:
        if identity.role != OPERATOR:
            raise Refused(
                grpc.StatusCode.PERMISSION_DENIED, f"{identity} may not use the admin API"
            )

    async def require(
        self, context: grpc.aio.ServicerContext, check: Callable[[Identity], None]
    ) -> None:
        """Abort the call unless the caller's identity passes `check`."""
        try:
            check(self.identity(context))
        except Refused as r:
            await _abort(context, r)

    def require_router(self, identity: Identity) -> None:
        if identity.role not in (ROUTER, OPERATOR):
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"{identity} may not read routes")

    # --- events ------------------------------------------------------------------------------

    async def record(
        self, kind: str, node_id: str, details: dict[str, Any], reclaim_id: str = ""
    ) -> None:
        """An event the coordinator itself witnessed; in its reclamation's timeline when it
        belongs to one (then with its offset from T0, once the agent's T0 is known)."""
        now = self.clock()
        record = self.store.reclamation(reclaim_id) if reclaim_id else None
        t0 = record["t0"] if record else 0.0
        self.store.add_event(
            uid=f"coordinator-{uuid.uuid4()}",
            kind=kind,
            node_id=node_id,
            reclaim_id=reclaim_id,
            wall_time=now,
            t_offset_s=now - t0 if t0 else None,
            details=details,
        )
        await self._notify()

    async def accept_events(self, node_id: str, events: list[pb.Event]) -> list[str]:
        """Store a batch from `node_id` (already checked); return the uids to acknowledge."""
        for ev in events:
            try:
                details = json.loads(ev.details_json) if ev.details_json else {}
            except json.JSONDecodeError as e:
                raise Refused(
                    grpc.StatusCode.INVALID_ARGUMENT, f"event {ev.uid}: details not JSON: {e}"
                ) from e
            if not ev.uid or not ev.kind or not isinstance(details, dict):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"event {ev.uid!r} is incomplete")
        for ev in events:
            offset = ev.t_offset_s if ev.HasField("t_offset_s") else None
            details = json.loads(ev.details_json) if ev.details_json else {}
            stored = self.store.add_event(
                uid=ev.uid,
                kind=ev.kind,
                node_id=node_id,
                reclaim_id=ev.reclaim_id,
                wall_time=ev.wall_time,
                t_offset_s=offset,
                details=details,
            )
            if stored is not None:  # a resent event is counted once, like it is stored once
                self.metrics.observe_event(ev.kind, ev.reclaim_id, offset, details)
        await self._notify()
        return [ev.uid for ev in events]

    async def _notify(self) -> None:
        async with self._new_event:
            self._new_event.notify_all()

    async def wait_for_events(self, timeout: float) -> None:
        async with self._new_event:
            try:
                await asyncio.wait_for(self._new_event.wait(), timeout)
            except TimeoutError:
                pass


def event_to_pb(row: EventRow) -> pb.StoredEvent:
    ev = pb.Event(
        uid=row.uid,
        kind=row.kind,
        node_id=row.node_id,
        reclaim_id=row.reclaim_id,
        wall_time=row.wall_time,
        details_json=row.details_json,
    )
    if row.t_offset_s is not None:
        ev.t_offset_s = row.t_offset_s
    return pb.StoredEvent(id=row.id, event=ev, received_at=row.received_at)


def taints_pb(store: Store, node_id: str) -> list[pb.Taint]:
    return [
        pb.Taint(
            key=t.key, effect=t.effect, reclaim_id=t.reclaim_id, reason=t.reason, since=t.since
        )
        for t in store.taints(node_id)
    ]


async def _abort(context: grpc.aio.ServicerContext, refused: Refused) -> None:
    await context.abort(refused.code, str(refused))


class AgentLinkServicer(pb_grpc.AgentLinkServicer):
    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord

    async def Taint(  # noqa: N802 (gRPC method name)
        self, request: pb.TaintRequest, context: grpc.aio.ServicerContext
    ) -> pb.TaintReply:
        try:
            identity = self.coord.identity(context, request.node_id)
            await self.coord.refuse_foreign(identity, request.node_id, "Taint", context.peer())
            if not request.reclaim_id:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "Taint needs a reclaim_id")
        except Refused as r:
            await _abort(context, r)
            raise AssertionError("unreachable") from None
        store = self.coord.store
        if request.remove:
            store.remove_taint(request.node_id, request.reclaim_id)
            await self.coord.fleet.lift_reclaim(request.node_id, request.reclaim_id)
            # Remember the lift even for a reclamation never tainted here, so a Taint call
            # still in flight that lands after it is recognised as late.
            store.start_drain(
                request.node_id,
                request.reclaim_id,
                request.reason or "notice",
                request.terminate_at,
                request.grace_deadline,
            )
            store.end_drain(request.node_id, request.reclaim_id)
        elif (ended := store.drain(request.node_id, request.reclaim_id)) is not None and (
            ended.ended_at is not None
        ):
            # A late retry of a reclamation already lifted (a resumed pause, a cancelled
            # notice): taking it again would pause the node behind its owner's back.
            log.info(
                "node %s: ignored a late taint for %s, lifted at %.3f",
                request.node_id,
                request.reclaim_id,
                ended.ended_at,
            )
        else:
            store.add_taint(request.node_id, request.reclaim_id, request.reason or "notice")
            # Unschedulable, then unrouted: every worker on the node leaves the routing table
            # before the agent signals anything (DESIGN.md "Hard notice timeline", step 4).
            await self.coord.fleet.begin_drain(
                request.node_id,
                request.reclaim_id,
                request.reason or "notice",
                request.terminate_at,
                request.grace_deadline,
            )
        log.info(
            "node %s %s taint for %s",
            request.node_id,
            "lifted" if request.remove else "set",
            request.reclaim_id,
        )
        return pb.TaintReply(taints=taints_pb(store, request.node_id))

    async def SetWorkload(  # noqa: N802
        self, request: pb.SetWorkloadRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetWorkloadReply:
        try:
            identity = self.coord.identity(context, request.node_id)
            await self.coord.refuse_foreign(
                identity, request.node_id, "SetWorkload", context.peer()
            )
            if not request.enabled:
                raise Refused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "a pause is a Taint with reason pause, not SetWorkload(false)",
                )
        except Refused as r:
            await _abort(context, r)
            raise AssertionError("unreachable") from None
        await self.coord.fleet.end_pause(request.node_id, request.reclaim_id)
        node = self.coord.store.node(request.node_id)
        return pb.SetWorkloadReply(workload_enabled=bool(node and node.workload_enabled))

    async def Connect(  # noqa: N802
        self, request_iterator: AsyncIterator[pb.AgentMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.CoordinatorMessage]:
        """Replies (registration, acks) and commands (start, drain) share one outgoing queue;
        a reader task handles what the agent sends."""
        out: asyncio.Queue[pb.CoordinatorMessage] = asyncio.Queue()
        session: dict[str, str] = {"node_id": ""}
        reader = asyncio.create_task(self._read(request_iterator, context, out, session))
        fleet = self.coord.fleet
        try:
            while True:
                getter = asyncio.create_task(out.get())
                done, _ = await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield getter.result()
                    continue
                getter.cancel()
                while not out.empty():
                    yield out.get_nowait()
                error = reader.exception()
                if isinstance(error, Refused):
                    await _abort(context, error)
                elif error is not None:
                    raise error
                return
        finally:
            reader.cancel()
            node_id = session["node_id"]
            if node_id and fleet.streams.get(node_id) is out:
                del fleet.streams[node_id]
                fleet.connected.pop(node_id, None)
                self.coord.store.touch_node(node_id)

    async def _read(
        self,
        request_iterator: AsyncIterator[pb.AgentMessage],
        context: grpc.aio.ServicerContext,
        out: asyncio.Queue[pb.CoordinatorMessage],
        session: dict[str, str],
    ) -> None:
        fleet = self.coord.fleet
        async for msg in request_iterator:
            which = msg.WhichOneof("body")
            node_id = session["node_id"]
            if which == "register":
                reg = msg.register
                identity = self.coord.identity(context, reg.node_id)
                await self.coord.refuse_foreign(identity, reg.node_id, "Register", context.peer())
                node_id = session["node_id"] = reg.node_id
                gpus = [
                    {
                        "index": g.index,
                        "uuid": g.uuid,
                        "name": g.name,
                        "memory_bytes": g.memory_bytes,
                    }
                    for g in reg.gpus
                ]
                refused = self.coord.store.upsert_node(
                    node_id,
                    reg.spot,
                    reg.node_group,
                    gpus,
                    reg.provider,
                    spot_locked=bool(self._render_still_running(node_id, reg)),
                )
                # Invariant 9: a node cannot turn spot (or back), nor change hands, under a
                # rental, not even by restarting its agent with other settings.
                for field_name, kind in (
                    ("spot", "spot_change_refused"),
                    ("provider", "provider_change_refused"),
                ):
                    if field_name in refused:
                        await self.coord.record(
                            kind, node_id, {field_name: refused[field_name], "via": "registration"}
                        )
                fleet.streams[node_id] = out
                fleet.connected[node_id] = self.coord.clock()
                log.info(
                    "node %s registered (%d GPUs, group %s, spot=%s, %d workers)",
                    node_id,
                    len(gpus),
                    reg.node_group,
                    reg.spot,
                    len(reg.workers),
                )
                out.put_nowait(
                    pb.CoordinatorMessage(
                        registered=pb.Registered(
                            node_id=node_id, taints=taints_pb(self.coord.store, node_id)
                        )
                    )
                )
                await fleet.registered(
                    node_id,
                    list(reg.workers),
                    list(reg.rentals),
                    complete=not reg.inventory_incomplete,
                )
                continue
            if not node_id:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "register before anything else")
            fleet.connected[node_id] = self.coord.clock()
            if which == "heartbeat":
                await fleet.slots(node_id, list(msg.heartbeat.workers), heartbeat=True)
            elif which == "slots":
                await fleet.slots(node_id, list(msg.slots.workers), heartbeat=False)
            elif which == "worker":
                await fleet.worker_report(node_id, msg.worker)
            elif which == "rental":
                await fleet.rental_report(node_id, msg.rental)
            elif which == "events":
                identity = self.coord.identity(context, node_id)
                for ev in msg.events.events:
                    await self.coord.refuse_foreign(identity, ev.node_id, "Event", context.peer())
                uids = await self.coord.accept_events(node_id, list(msg.events.events))
                out.put_nowait(pb.CoordinatorMessage(ack=pb.EventAck(uids=uids)))

    def _render_still_running(self, node_id: str, reg: pb.Register) -> list[str]:
        """Render jobs the node still runs (all it had, if it cannot tell): they hold its
        spot flag, since render never runs on spot."""
        running = {w.worker_id for w in reg.workers}
        return [
            w.worker_id
            for w in self.coord.fleet.render_jobs(node_id)
            if reg.inventory_incomplete or w.worker_id in running
        ]


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord

    async def _operator(self, context: grpc.aio.ServicerContext) -> None:
        await self.coord.require(context, self.coord.require_operator)

    async def WatchEvents(  # noqa: N802
        self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StoredEvent]:
        await self._operator(context)
        last = max(request.from_id, 0)
        while True:
            rows = self.coord.store.events_after(last)
            for row in rows:
                last = row.id
                yield event_to_pb(row)
            if rows:
                continue
            if not request.follow:
                return
            await self.coord.wait_for_events(timeout=1.0)

    async def GetTimeline(  # noqa: N802
        self, request: pb.GetTimelineRequest, context: grpc.aio.ServicerContext
    ) -> pb.Timeline:
        await self._operator(context)
        record = self.coord.store.reclamation(request.reclaim_id)
        if record is None:
            what = f"reclamation {request.reclaim_id!r}" if request.reclaim_id else "reclamation"
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no {what} recorded")
            raise AssertionError("unreachable")
        rec = pb.Reclamation(
            reclaim_id=record["reclaim_id"],
            node_id=record["node_id"],
            notice_id=record["notice_id"],
            reason=record["reason"],
            source=record["source"],
            t0=record["t0"],
            terminate_at=record["terminate_at"],
            grace_deadline=record["grace_deadline"],
            overrun_at=record["overrun_at"],
            outcome=record["outcome"],
            steps=record["steps"],
        )
        if record["spare_s"] is not None:
            rec.spare_s = record["spare_s"]
        events = [event_to_pb(r) for r in self.coord.store.events_of(record["reclaim_id"])]
        return pb.Timeline(reclamation=rec, events=events)

    async def ListNodes(  # noqa: N802
        self, request: pb.ListNodesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListNodesReply:
        await self._operator(context)
        return pb.ListNodesReply(nodes=[self._node_pb(n) for n in self.coord.store.nodes()])

    def _node_pb(self, n: NodeRow) -> pb.Node:
        store, fleet = self.coord.store, self.coord.fleet
        return pb.Node(
            node_id=n.node_id,
            spot=n.spot,
            node_group=n.node_group,
            gpus=[pb.Gpu(**g) for g in n.gpus],
            connected=n.node_id in self.coord.connected,
            last_seen=self.coord.connected.get(n.node_id, n.last_seen),
            taints=taints_pb(store, n.node_id),
            workload_enabled=n.workload_enabled,
            provider=n.owner,
            live_workers=len(fleet.live_workers(n.node_id)),
            active_rentals=len(fleet.rentals(n.node_id, active_only=True)),
            group_avoided_until=store.avoided_groups(self.coord.clock()).get(n.node_group, 0.0),
        )

    async def SetNodeSpot(  # noqa: N802
        self, request: pb.SetNodeSpotRequest, context: grpc.aio.ServicerContext
    ) -> pb.Node:
        await self._operator(context)
        try:
            node = await self.coord.fleet.set_spot(request.node_id, request.spot)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no node {request.node_id!r}")
            raise AssertionError("unreachable") from None
        except SpotChangeRefused as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            raise AssertionError("unreachable") from None
        return self._node_pb(node)

    async def GetReputation(  # noqa: N802
        self, request: pb.GetReputationRequest, context: grpc.aio.ServicerContext
    ) -> pb.Reputation:
        await self._operator(context)
        store = self.coord.store
        outcomes = [
            reputation.RentalOutcome(
                d["rental_id"],
                d["node_id"],
                d["provider"],
                d["started_on_spot"],
                d["ended_by"] or None,
            )
            for d in store.rental_docs()
        ]
        which = request.WhichOneof("subject")
        if which == "node_id":
            if store.node(request.node_id) is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"no node {request.node_id!r}")
            score = reputation.node_score(outcomes, request.node_id)
        elif which == "provider":
            known = {n.owner for n in store.nodes()} | {o.provider for o in outcomes}
            if request.provider not in known:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"no provider {request.provider!r}")
            score = reputation.provider_score(outcomes, request.provider)
        else:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "give a node_id or a provider")
            raise AssertionError("unreachable")
        return pb.Reputation(
            node_id=request.node_id,
            provider=request.provider,
            score=score.value,
            successes=score.successes,
            failures=score.failures,
            counted=score.counted,
            excluded_spot=score.excluded_spot,
            neutral_reclaims=score.neutral_reclaims,
        )

    async def SetModelReplicas(  # noqa: N802
        self, request: pb.SetModelReplicasRequest, context: grpc.aio.ServicerContext
    ) -> pb.Model:
        await self._operator(context)
        store = self.coord.store
        known = store.model(request.model)
        image = request.image or (known.image if known else "")
        if not request.model or not image:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "a model name is needed, and an image the first time a model is set",
            )
        slots = request.slots or (known.slots if known else 4)
        store.set_model(request.model, request.replicas, image, slots)
        await self.coord.record(
            "model_replicas_set", "", {"model": request.model, "replicas": request.replicas}
        )
        await self.coord.fleet.keep_capacity(path="operator")
        return self._model_pb(request.model)

    async def ListModels(  # noqa: N802
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsReply:
        await self._operator(context)
        return pb.ListModelsReply(
            models=[self._model_pb(m.model) for m in self.coord.store.models()]
        )

    def _model_pb(self, model: str) -> pb.Model:
        row = self.coord.store.model(model)
        assert row is not None
        states = [w.state for w in self.coord.fleet.live_workers() if w.model == model]
        return pb.Model(
            model=row.model,
            replicas=row.replicas,
            image=row.image,
            slots=row.slots,
            ready=states.count(wm.READY),
            starting=states.count(wm.STARTING),
            draining=states.count(wm.DRAINING),
        )

    async def StartWorker(  # noqa: N802
        self, request: pb.StartWorkerRequest, context: grpc.aio.ServicerContext
    ) -> pb.WorkerInfo:
        await self._operator(context)
        if not request.node_id or not request.model or not request.image:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "node, model and image needed")
        kind = request.kind or "inference"
        if kind not in WORKER_KINDS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"kind must be one of {WORKER_KINDS}"
            )
        try:
            worker = await self.coord.fleet.place_worker(
                request.node_id,
                request.model,
                request.image,
                request.slots or 1,
                request.port,
                path="operator",
                kind=kind,
            )
        except PlacementRefused as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            raise AssertionError("unreachable") from None
        return worker_pb(worker)

    async def ListWorkers(  # noqa: N802
        self, request: pb.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListWorkersReply:
        await self._operator(context)
        return pb.ListWorkersReply(
            workers=[worker_pb(w) for w in self.coord.fleet.all_workers(request.node_id)]
        )


def worker_pb(w: wm.Worker) -> pb.WorkerInfo:
    info = pb.WorkerInfo(
        worker_id=w.worker_id,
        node_id=w.node_id,
        model=w.model,
        image=w.image,
        port=w.port,
        capacity=w.capacity,
        state=w.state,
        gate_address=w.gate_address,
        slots_in_use=w.slots_in_use,
        drain_reason=w.drain_reason,
        kind=w.kind,
    )
    if w.grace_deadline is not None:
        info.grace_deadline = w.grace_deadline
    if w.terminate_at is not None:
        info.terminate_at = w.terminate_at
    return info


def route_pb(e: RouteEntry) -> pb.Route:
    return pb.Route(
        worker_id=e.worker_id,
        node_id=e.node_id,
        model=e.model,
        address=e.address,
        slots_in_use=e.slots_in_use,
        capacity=e.capacity,
    )


class RoutesServicer(pb_grpc.RoutesServicer):
    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord

    async def _router(self, context: grpc.aio.ServicerContext) -> None:
        await self.coord.require(context, self.coord.require_router)

    async def WatchRoutes(  # noqa: N802
        self, request: pb.WatchRoutesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RouteUpdate]:
        await self._router(context)
        routes = self.coord.fleet.routes
        # Subscribe before the snapshot: no change can fall between the two.
        queue = routes.subscribe(request.model)
        try:
            version, entries = routes.snapshot(request.model)
            yield pb.RouteUpdate(
                version=version, snapshot=True, upsert=[route_pb(e) for e in entries]
            )
            while True:
                if queue.empty() and routes.overflowed(queue):
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "this watch fell too far behind; watch again",
                    )
                change = await queue.get()
                if change.version <= version:
                    continue
                yield pb.RouteUpdate(
                    version=change.version,
                    upsert=[route_pb(e) for e in change.upsert],
                    removed=list(change.removed),
                )
        finally:
            routes.unsubscribe(request.model, queue)

    async def PickWorker(  # noqa: N802
        self, request: pb.PickWorkerRequest, context: grpc.aio.ServicerContext
    ) -> pb.Route:
        await self._router(context)
        entry = self.coord.fleet.routes.pick(request.model)
        if entry is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"no ready worker for model {request.model!r}"
            )
            raise AssertionError("unreachable")
        return route_pb(entry)


def rental_pb(r: Rental) -> pb.Rental:
    msg = pb.Rental(
        rental_id=r.rental_id,
        node_id=r.node_id,
        provider=r.provider,
        renter=r.renter,
        image=r.image,
        gpus=r.gpus,
        state=r.state,
        started_at=r.started_at,
        ended_by=r.ended_by,
        started_on_spot=r.started_on_spot,
        reclaim_id=r.reclaim_id,
        reclaim_reason=r.reclaim_reason,
        detail=r.detail,
    )
    if r.ended_at is not None:
        msg.ended_at = r.ended_at
    if r.reclaim_at is not None:
        msg.reclaim_at = r.reclaim_at
    if r.exit_code is not None:
        msg.exit_code = r.exit_code
    return msg


class RentalsServicer(pb_grpc.RentalsServicer):
    """A renter sees and ends only its own rentals; an operator acts as the platform; a
    provider may end (and see) rentals on its own nodes. Nodes and routers have no access."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord

    async def _caller(self, context: grpc.aio.ServicerContext) -> Identity:
        try:
            identity = self.coord.identity(context)
            if identity.role not in (OPERATOR, RENTER, PROVIDER):
                raise Refused(
                    grpc.StatusCode.PERMISSION_DENIED, f"{identity} may not use the rentals API"
                )
        except Refused as r:
            await _abort(context, r)
            raise AssertionError("unreachable") from None
        return identity

    def _may_see(self, identity: Identity, rental: Rental) -> bool:
        if identity.role == RENTER:
            return rental.renter == identity.name
        if identity.role == PROVIDER:
            return rental.provider == identity.name
        return True

    async def _rental(self, context: grpc.aio.ServicerContext, rental_id: str) -> Rental:
        identity = await self._caller(context)
        rental = self.coord.fleet.rental(rental_id)
        # Someone else's rental is as unknown as a missing one: no probing for ids.
        if rental is None or not self._may_see(identity, rental):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no rental {rental_id!r}")
            raise AssertionError("unreachable")
        return rental

    async def CreateRental(  # noqa: N802
        self, request: pb.CreateRentalRequest, context: grpc.aio.ServicerContext
    ) -> pb.Rental:
        identity = await self._caller(context)
        renter = request.renter
        if identity.role == RENTER:
            if renter and renter != identity.name:
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED, f"{identity} may not rent as {renter!r}"
                )
            renter = identity.name
        elif identity.role != OPERATOR:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"{identity} may not create rentals"
            )
        if not request.node_id or not request.image or not renter:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "a rental needs a node, an image and a renter"
            )
        try:
            rental = await self.coord.fleet.create_rental(
                request.node_id, renter, request.image, request.gpus or 1
            )
        except PlacementRefused as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            raise AssertionError("unreachable") from None
        return rental_pb(rental)

    async def GetRental(  # noqa: N802
        self, request: pb.GetRentalRequest, context: grpc.aio.ServicerContext
    ) -> pb.Rental:
        return rental_pb(await self._rental(context, request.rental_id))

    async def EndRental(  # noqa: N802
        self, request: pb.EndRentalRequest, context: grpc.aio.ServicerContext
    ) -> pb.Rental:
        rental = await self._rental(context, request.rental_id)
        identity = self.coord.identity(context)
        ended_by = {RENTER: "renter", PROVIDER: "provider"}.get(
            identity.role, request.ended_by or "platform"
        )
        if ended_by not in END_CALLERS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"ended_by must be one of {END_CALLERS}"
            )
        return rental_pb(await self.coord.fleet.end_rental(rental, ended_by))

    async def WatchRental(  # noqa: N802
        self, request: pb.GetRentalRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.Rental]:
        await self._rental(context, request.rental_id)
        fleet = self.coord.fleet
        # Subscribe before reading the current record: no change can fall between the two.
        queue = fleet.watch_rental(request.rental_id)
        try:
            rental = fleet.rental(request.rental_id)
            assert rental is not None
            yield rental_pb(rental)
            while rental.active:
                rental = await queue.get()
                yield rental_pb(rental)
        finally:
            fleet.unwatch_rental(request.rental_id, queue)

    async def ListRentals(  # noqa: N802
        self, request: pb.ListRentalsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListRentalsReply:
        identity = await self._caller(context)
        rentals = self.coord.fleet.rentals(request.node_id or None, request.active_only)
        return pb.ListRentalsReply(
            rentals=[rental_pb(r) for r in rentals if self._may_see(identity, r)]
        )
