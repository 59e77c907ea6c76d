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

from spotdrain.coordinator.store import EventRow, Store
from spotdrain.security import NODE, OPERATOR, Identity, parse_common_name
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

log = logging.getLogger("spotdrain.coordinator")


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Coordinator:
    """The coordinator's state behind the servicers: the store plus who is connected."""

    def __init__(self, store: Store, insecure: bool, clock: Callable[[], float] = time.time):
        self.store = store
        self.insecure = insecure
        self.clock = clock
        self.connected: dict[str, float] = {}
        self._new_event = asyncio.Condition()

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

    # --- events ------------------------------------------------------------------------------

    async def record(self, kind: str, node_id: str, details: dict[str, Any]) -> None:
        """An event the coordinator itself witnessed."""
        self.store.add_event(
            uid=f"coordinator-{uuid.uuid4()}",
            kind=kind,
            node_id=node_id,
            reclaim_id="",
            wall_time=self.clock(),
            t_offset_s=None,
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
            self.store.add_event(
                uid=ev.uid,
                kind=ev.kind,
                node_id=node_id,
                reclaim_id=ev.reclaim_id,
                wall_time=ev.wall_time,
                t_offset_s=ev.t_offset_s if ev.HasField("t_offset_s") else None,
                details=json.loads(ev.details_json) if ev.details_json else {},
            )
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
        else:
            store.add_taint(request.node_id, request.reclaim_id, request.reason or "notice")
        log.info(
            "node %s %s taint for %s",
            request.node_id,
            "lifted" if request.remove else "set",
            request.reclaim_id,
        )
        return pb.TaintReply(taints=taints_pb(store, request.node_id))

    async def Connect(  # noqa: N802
        self, request_iterator: AsyncIterator[pb.AgentMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.CoordinatorMessage]:
        node_id = ""
        try:
            async for msg in request_iterator:
                which = msg.WhichOneof("body")
                if which == "register":
                    reg = msg.register
                    identity = self.coord.identity(context, reg.node_id)
                    await self.coord.refuse_foreign(
                        identity, reg.node_id, "Register", context.peer()
                    )
                    node_id = reg.node_id
                    gpus = [
                        {
                            "index": g.index,
                            "uuid": g.uuid,
                            "name": g.name,
                            "memory_bytes": g.memory_bytes,
                        }
                        for g in reg.gpus
                    ]
                    self.coord.store.upsert_node(node_id, reg.spot, reg.node_group, gpus)
                    self.coord.connected[node_id] = self.coord.clock()
                    log.info(
                        "node %s registered (%d GPUs, group %s, spot=%s)",
                        node_id,
                        len(gpus),
                        reg.node_group,
                        reg.spot,
                    )
                    yield pb.CoordinatorMessage(
                        registered=pb.Registered(
                            node_id=node_id, taints=taints_pb(self.coord.store, node_id)
                        )
                    )
                    continue
                if not node_id:
                    raise Refused(
                        grpc.StatusCode.FAILED_PRECONDITION, "register before anything else"
                    )
                if which == "heartbeat":
                    self.coord.connected[node_id] = self.coord.clock()
                elif which == "events":
                    identity = self.coord.identity(context, node_id)
                    for ev in msg.events.events:
                        await self.coord.refuse_foreign(
                            identity, ev.node_id, "Event", context.peer()
                        )
                    uids = await self.coord.accept_events(node_id, list(msg.events.events))
                    self.coord.connected[node_id] = self.coord.clock()
                    yield pb.CoordinatorMessage(ack=pb.EventAck(uids=uids))
        except Refused as r:
            await _abort(context, r)
        finally:
            if node_id:
                self.coord.connected.pop(node_id, None)
                self.coord.store.touch_node(node_id)


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord

    async def _operator(self, context: grpc.aio.ServicerContext) -> None:
        try:
            self.coord.require_operator(self.coord.identity(context))
        except Refused as r:
            await _abort(context, r)

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
        nodes = []
        for n in self.coord.store.nodes():
            nodes.append(
                pb.Node(
                    node_id=n.node_id,
                    spot=n.spot,
                    node_group=n.node_group,
                    gpus=[pb.Gpu(**g) for g in n.gpus],
                    connected=n.node_id in self.coord.connected,
                    last_seen=self.coord.connected.get(n.node_id, n.last_seen),
                    taints=taints_pb(self.coord.store, n.node_id),
                )
            )
        return pb.ListNodesReply(nodes=nodes)
