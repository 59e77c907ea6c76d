"""The coordinator behind its servicers (`Coordinator`: the store, the event log, the fleet,
metrics and identities) and the agents' servicer.

Servicers are thin: check who is calling, convert the request (coordinator/api/convert.py), call the
fleet, convert the answer; coordinator/api/errors.py maps every domain error to a status code in one
place. A node acts only on its own records (docs/design.md "Security", like Kubernetes'
NodeRestriction): its identity comes from its client certificate; a message naming another node is
refused with PERMISSION_DENIED and the attempt is recorded as `identity_refused`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from spotdrain.coordinator.api import convert
from spotdrain.coordinator.api.errors import BadRequest, Refused, end_with, grpc_errors
from spotdrain.coordinator.api.intake import Intake, batch_cost
from spotdrain.coordinator.api.operations import Operations
from spotdrain.coordinator.capacity.acquirer import DEFAULT_AVOID_S, Acquirer
from spotdrain.coordinator.capacity.contracts import ContractPolicy
from spotdrain.coordinator.core import messages as msg
from spotdrain.coordinator.core import worker_machine as wm
from spotdrain.coordinator.fleet.eventlog import EventLog
from spotdrain.coordinator.fleet.wiring import Fleet
from spotdrain.coordinator.store import NewEvent, Store, StoreError
from spotdrain.coordinator.store.backend import Fenced
from spotdrain.net.security import NODE, OPERATOR, ROUTER, Identity, parse_common_name
from spotdrain.protocol import timing
from spotdrain.runtime.metrics import (
    CollectorRegistry,
    GaugeCollector,
    Histogram,
    ReclamationMetrics,
)
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

# Events of a batch converted between two turns of the loop (a few ms of work at most).
CONVERT_SLICE = 50
# Taint answers, 1 ms to 2 s: the 800 ms local fallback and the 200 ms mass target in between.
TAINT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4, 0.8, 2.0)
log = logging.getLogger("spotdrain.coordinator")


class Coordinator:
    """The coordinator's state behind the servicers."""

    def __init__(
        self,
        store: Store,
        insecure: bool,
        clock: Callable[[], float] = time.time,
        heartbeat_ttl_s: float = 15.0,
        start_timeout_s: float = 300.0,
        acquirers: dict[str, Acquirer] | None = None,
        avoid_s: float = DEFAULT_AVOID_S,
        node_gone_s: float = timing.NODE_GONE_S,
        node_lost_s: float = timing.NODE_LOST_S,
        contract_policy: ContractPolicy | None = None,
    ):
        self.store = store
        self.insecure = insecure
        self.clock = clock
        self.registry = CollectorRegistry()
        self.metrics = ReclamationMetrics(self.registry)
        self.events = EventLog(store, clock, observe=self._observe)
        self.fleet = Fleet(
            store,
            self.events,
            clock,
            heartbeat_ttl_s,
            start_timeout_s,
            acquirers=acquirers,
            avoid_s=avoid_s,
            node_gone_s=node_gone_s,
            node_lost_s=node_lost_s,
            contract_policy=contract_policy,
        )
        # What servicers and the dashboard do to the fleet, one method each.
        self.ops = Operations(store, self.fleet, self.events, clock)
        self.registry.register(
            GaugeCollector(
                "spotdrain_workload_reclamations",
                "Reclamations of each workload image by how its container ended: exited before "
                "G, killed at G, or overrun (still there at O).",
                ["image", "kind", "end"],
                self.fleet.contracts.samples,
            )
        )
        self.registry.register(
            GaugeCollector(
                "spotdrain_workload_contract_flagged",
                "1 for a workload image whose killed and overrun share passed the contract budget.",
                ["image", "kind"],
                self.fleet.contracts.flagged_samples,
            )
        )
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
                "Slots in use over a model's ready workers, as their gates count them.",
                ["model"],
                self._slots_in_use,
            )
        )
        self.registry.register(
            GaugeCollector(
                "spotdrain_nodes_connected",
                "Agents with a live stream.",
                [],
                lambda: [([], float(len(self.fleet.nodes.streams)))],
            )
        )
        # Counted apart from spotdrain_reclamations_total: a lost node is no drain and no overrun.
        self.registry.register(
            GaugeCollector(
                "spotdrain_nodes_lost",
                "Nodes lost without notice (node_lost) since this coordinator started leading.",
                [],
                lambda: [([], float(self.fleet.lost.declared))],
            )
        )
        self.registry.register(
            GaugeCollector(
                "spotdrain_nodes_returned",
                "Lost nodes that registered again (node_returned) since this coordinator started "
                "leading.",
                [],
                lambda: [([], float(self.fleet.lost.returned))],
            )
        )
        self.registry.register(
            GaugeCollector(
                "spotdrain_recovery_passes",
                "Recovery passes run to their end since this coordinator started leading.",
                [],
                lambda: [([], float(self.fleet.recovery.passes))],
            )
        )
        # The coordinator's own share of a Taint's round trip: the rest (the network, gRPC's
        # queue before the handler runs, the agent) is what an agent's timeline shows beyond it.
        self.taint_answer = Histogram(
            "spotdrain_taint_answer_seconds",
            "Taint calls answered: from the handler's start to its answer (the commit included).",
            ["reason"],
            buckets=TAINT_BUCKETS,
            registry=self.registry,
        )

    def _observe(self, ev: NewEvent) -> None:
        self.metrics.observe_event(ev.kind, ev.reclaim_id, ev.t_offset_s, ev.details)

    def _workers_by_state(self) -> list[tuple[list[str], float]]:
        counts = dict.fromkeys(wm.STATES, 0)
        for worker in self.fleet.live_workers():
            counts[worker.state] += 1
        return [([state], float(n)) for state, n in counts.items()]

    def _slots_in_use(self) -> list[tuple[list[str], float]]:
        # Per model, not per worker: 10,000 series at 10,000 nodes, built on the metrics thread
        # at every scrape, held the GIL for a tenth of the event loop's time during a mass
        # reclamation (and a series per worker is a cardinality a Prometheus should not get
        # from one target). A node's own workers are on its agent's endpoint.
        return [([m], float(n)) for m, n in self.fleet.registry.slots_in_use_by_model().items()]

    @property
    def connected(self) -> dict[str, float]:
        return self.fleet.nodes.connected

    async def record(
        self, kind: str, node_id: str, details: dict[str, Any], reclaim_id: str = ""
    ) -> None:
        await self.events.record(kind, node_id, details, reclaim_id)

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

    async def node_only(
        self, context: grpc.aio.ServicerContext, claimed_node: str, what: str
    ) -> Identity:
        """The caller, which must be the node it claims to be; anything else is refused and
        recorded."""
        identity = self.identity(context, claimed_node)
        if identity.role == NODE and identity.name == claimed_node:
            return identity
        await self.record(
            "identity_refused",
            node_id=identity.name if identity.role == NODE else "",
            details={
                "identity": str(identity),
                "claimed_node": claimed_node,
                "call": what,
                "peer": context.peer(),
            },
        )
        log.warning(
            "refused %s from %s claiming node %r (%s)", what, identity, claimed_node, context.peer()
        )
        raise Refused(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{identity} may not act for node {claimed_node!r}",
        )

    def caller(self, context: grpc.aio.ServicerContext, api: str, *roles: str) -> Identity:
        """The caller, which must hold one of `roles` to use `api`."""
        identity = self.identity(context)
        if identity.role not in roles:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"{identity} may not use {api}")
        return identity

    def operator(self, context: grpc.aio.ServicerContext) -> Identity:
        identity = self.identity(context)
        if identity.role != OPERATOR:
            raise Refused(
                grpc.StatusCode.PERMISSION_DENIED, f"{identity} may not use the admin API"
            )
        return identity

    def router(self, context: grpc.aio.ServicerContext) -> Identity:
        identity = self.identity(context)
        if identity.role not in (ROUTER, OPERATOR):
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"{identity} may not read routes")
        return identity


_READER_ENDED = object()  # on a stream's command queue: the agent's side of it has ended


class AgentLinkServicer(pb_grpc.AgentLinkServicer):
    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord

    @grpc_errors
    async def Taint(  # noqa: N802 (gRPC method name)
        self, request: pb.TaintRequest, context: grpc.aio.ServicerContext
    ) -> pb.TaintReply:
        started = time.perf_counter()
        node_id = convert.check_id(request.node_id, "node_id")
        await self.coord.node_only(context, node_id, "Taint")
        reclaim_id = convert.check_id(request.reclaim_id, "Taint needs a reclaim_id")
        args = (
            node_id,
            reclaim_id,
            request.reason or "notice",
            convert.finite(request.terminate_at, "terminate_at"),
            convert.finite(request.grace_deadline, "grace_deadline"),
        )
        ops = self.coord.ops
        answer = await (ops.lift_taint(*args) if request.remove else ops.taint(*args))
        reason = "lift" if request.remove else ("pause" if args[2] == "pause" else "notice")
        self.coord.taint_answer.labels(reason).observe(time.perf_counter() - started)
        log.info(
            "node %s %s taint for %s", node_id, "lifted" if request.remove else "set", reclaim_id
        )
        return pb.TaintReply(taints=[convert.taint_pb(t) for t in answer.taints])

    @grpc_errors
    async def SetWorkload(  # noqa: N802
        self, request: pb.SetWorkloadRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetWorkloadReply:
        node_id = convert.check_id(request.node_id, "node_id")
        await self.coord.node_only(context, node_id, "SetWorkload")
        if not request.enabled:
            raise BadRequest("a pause is a Taint with reason pause, not SetWorkload(false)")
        enabled = await self.coord.ops.end_pause(node_id, request.reclaim_id)
        return pb.SetWorkloadReply(workload_enabled=enabled)

    async def Connect(  # noqa: N802
        self, request_iterator: AsyncIterator[pb.AgentMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.CoordinatorMessage]:
        """Replies (registration, acks) and commands (start, drain) share one outgoing queue;
        a reader task handles what the agent sends."""
        out: asyncio.Queue[Any] = asyncio.Queue()
        session: dict[str, str] = {"node_id": ""}
        reader = asyncio.create_task(self._read(request_iterator, context, out, session))
        # The reader's end is one more item on the queue, after what it queued before it: one
        # wait per command sent, not a task and a wait set each (a mass reclamation sends a
        # thousand drains in a second).
        reader.add_done_callback(lambda _: out.put_nowait(_READER_ENDED))
        try:
            while (command := await out.get()) is not _READER_ENDED:
                yield convert.command_pb(command)
            while not out.empty():  # queued for the node after the reader ended
                command = out.get_nowait()
                if command is not _READER_ENDED:
                    yield convert.command_pb(command)
            error = reader.exception()
            if error is not None:
                end_with(context, error, f"Connect({session['node_id']})")
        finally:
            # The reader ends with the stream, whichever way it ends (the agent gone, the call
            # cancelled), and its error is retrieved here.
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            if session["node_id"]:
                try:
                    await self.coord.fleet.reports.disconnected(session["node_id"], out)
                except StoreError as e:
                    # Its last-seen not stored (a deposed leader's write, refused by its term):
                    # the stream has ended already, with its own status; raising here would
                    # abort it a second time (grpc's "Abort already called").
                    log.log(
                        logging.DEBUG if isinstance(e, Fenced) else logging.WARNING,
                        "node %s disconnected; its last-seen not stored: %s",
                        session["node_id"],
                        e,
                    )

    async def _read(
        self,
        request_iterator: AsyncIterator[pb.AgentMessage],
        context: grpc.aio.ServicerContext,
        out: asyncio.Queue[msg.Command],
        session: dict[str, str],
    ) -> None:
        fleet, coord = self.coord.fleet, self.coord
        intake = Intake()  # this stream's share of the loop for its event batches
        async for message in request_iterator:
            which = message.WhichOneof("body")
            node_id = session["node_id"]
            if which == "register":
                reg = convert.registration(message.register)
                await coord.node_only(context, reg.node_id, "Register")
                session["node_id"] = reg.node_id
                await fleet.reports.register(reg, out)
                continue
            if not node_id:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "register before anything else")
            fleet.nodes.connected[node_id] = coord.clock()
            if which == "heartbeat":
                slots = [convert.worker_slots(s) for s in message.heartbeat.workers]
                await fleet.reports.slots(node_id, slots, heartbeat=True)
            elif which == "slots":
                slots = [convert.worker_slots(s) for s in message.slots.workers]
                await fleet.reports.slots(node_id, slots, heartbeat=False)
            elif which == "worker":
                await fleet.reports.worker_report(node_id, convert.worker_report(message.worker))
            elif which == "rental":
                await fleet.rentals.report(node_id, convert.rental_report(message.rental))
            elif which == "events":
                events = await self._take_in(node_id, message.events, context, intake)
                uids = await coord.events.accept(events)
                out.put_nowait(msg.EventAck(tuple(uids)))

    async def _take_in(
        self,
        node_id: str,
        batch: pb.EventBatch,
        context: grpc.aio.ServicerContext,
        intake: Intake,
    ) -> list[NewEvent]:
        """A batch checked and converted, within the stream's budget (coordinator/api/intake.py), a
        slice at
        a time: a Taint waiting for the loop goes in between two slices, not after the batch."""
        size = convert.check_batch(batch)
        loop = asyncio.get_running_loop()
        wait = intake.take(batch_cost(size, len(batch.events)), loop.time())
        if wait > 0:
            await intake.sleep(wait)  # not read meanwhile: the agent's sends wait in HTTP/2
        events: list[NewEvent] = []
        for start in range(0, len(batch.events), CONVERT_SLICE):
            part = batch.events[start : start + CONVERT_SLICE]
            for ev in part:
                if ev.node_id != node_id:
                    await self.coord.node_only(context, ev.node_id, "Event")
            events += convert.batch_events(node_id, part)
            await intake.sleep(0)
        return events
