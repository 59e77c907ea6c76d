"""The agent's link to the coordinator: the long-lived Connect stream and the Taint call.

The stream registers the node, then drains the outbox: each batch stays in the outbox until the
coordinator acknowledges its uids. A broken stream is reconnected with backoff and unacknowledged
events are sent again (the coordinator stores each uid once).

Each EventBatch fits the coordinator's bounds (spotdrain.protocol.limits): it refuses a larger one
with RESOURCE_EXHAUSTED, and a refused batch would be resent, and refused, forever.

Several coordinator replicas (`coordinator = ["a:7443", "b:7443"]`): only the leader serves; a
follower answers UNAVAILABLE naming the leader in the `spotdrain-leader` trailing metadata. The
stream goes to the leader (where a refusal points, else the next address); a Taint goes to every
replica at once and the leader's answer is taken, so the 800 ms deadline covers the whole search
(a stopped replica cannot eat it), and past it the local taint applies as with one coordinator.
How the leader is found is spotdrain.net.leader's, shared with spotctl and the router.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

import grpc

from spotdrain.agent.config import AgentConfig
from spotdrain.agent.drain.outbox import Outbox, bounded_details, details_json
from spotdrain.net.leader import Replicas, leader_hint
from spotdrain.net.security import channel_credentials
from spotdrain.protocol import limits, timing
from spotdrain.protocol.events import EventRecord, event_message
from spotdrain.protocol.limits import MAX_AGENT_MESSAGE_BYTES, MAX_BATCH_BYTES, MAX_BATCH_EVENTS
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

log = logging.getLogger("spotdrain.agent.drain.link")

HEARTBEAT_S = timing.HEARTBEAT_S
# The longest a drain may hold the stream's events back (hold_events): its SIGTERM round's
# kills each have their own timeout; a hold never released (a round wedged on a hung engine)
# still ends here.
HOLD_EVENTS_MAX_S = 2.0
REFUSED_RETRY_S = 30.0
BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)
CHANNEL_OPTIONS = [
    # Notice a coordinator that vanished (host gone, SIGSTOP) instead of trusting a dead TCP
    # connection forever.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # The same bound the coordinator sets on its side, named rather than left to gRPC's default,
    # so the two cannot drift apart unnoticed. Batches are split far below it (MAX_BATCH_BYTES).
    ("grpc.max_send_message_length", MAX_AGENT_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_AGENT_MESSAGE_BYTES),
]


class TaintError(Exception):
    pass


def make_channel(cfg: AgentConfig, address: str | None = None) -> grpc.aio.Channel:
    address = address or cfg.coordinators[0]
    if cfg.insecure:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    creds = channel_credentials(cfg.tls_cert, cfg.tls_key, cfg.ca)
    return grpc.aio.secure_channel(address, creds, options=CHANNEL_OPTIONS)


def to_pb(ev: EventRecord) -> pb.Event:
    # Outbox.put bounds details; this bounds an event an older agent left in the outbox, which
    # the coordinator would otherwise refuse on every resend.
    details, original_bytes = bounded_details(ev.details)
    if original_bytes is not None:
        log.warning(
            "node %s: queued %s event %s has %d bytes of details: sent as a summary",
            ev.node_id,
            ev.kind,
            ev.uid,
            original_bytes,
        )
    return event_message(ev, details_json(details))


def _varint_bytes(n: int) -> int:
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


def _field_bytes(n: int) -> int:
    """A length-delimited field holding n bytes, its tag (field number below 16) included."""
    return 1 + _varint_bytes(n) + n


def batches(events: Iterable[pb.Event]) -> Iterator[list[pb.Event]]:
    """The events in order, cut into EventBatches the coordinator accepts: at most
    MAX_BATCH_EVENTS each, and the AgentMessage carrying one at most MAX_BATCH_BYTES serialized
    (so the EventBatch too). An event too large to share a batch goes alone."""
    batch: list[pb.Event] = []
    size = 0  # the EventBatch's ByteSize(): each event is a length-delimited field of it
    for ev in events:
        cost = _field_bytes(ev.ByteSize())
        if batch and (
            len(batch) >= MAX_BATCH_EVENTS or _field_bytes(size + cost) > MAX_BATCH_BYTES
        ):
            yield batch
            batch, size = [], 0
        batch.append(ev)
        size += cost
    if batch:
        yield batch


class CoordinatorLink:
    def __init__(
        self,
        cfg: AgentConfig,
        outbox: Outbox,
        registration: Callable[[], Awaitable[pb.Register]],
        hold_events_max_s: float = HOLD_EVENTS_MAX_S,
    ) -> None:
        self.cfg = cfg
        self.outbox = outbox
        self.registration = registration
        self.replicas = Replicas(cfg.coordinators, lambda address: make_channel(cfg, address))
        self._outbox_changed = asyncio.Event()
        self._reports: list[pb.AgentMessage] = []
        self._slots: dict[str, pb.WorkerSlots] = {}
        self.on_command: Callable[[pb.CoordinatorMessage], None] = lambda msg: None
        self.heartbeat_slots: Callable[[], list[tuple[str, int, int, str]]] = list
        self.connected = asyncio.Event()
        self.remote_taints: list[pb.Taint] = []
        # Drains whose notice path is under way (hold_events), each with when its hold ends.
        self._holds: dict[str, float] = {}
        self._hold_events_max_s = hold_events_max_s

    def wake(self) -> None:
        """New events are in the outbox."""
        self._outbox_changed.set()

    def hold_events(self, key: str) -> None:
        """Drain `key` is sending its SIGTERM round: events stay in the outbox until
        release_events(key), at most HOLD_EVENTS_MAX_S, so the engine's kills share the cores
        with no event batch being stored by the coordinator. Everything else on the stream
        (heartbeats, worker and slot reports, Taint calls) goes on."""
        self._holds.setdefault(key, time.monotonic() + self._hold_events_max_s)

    def release_events(self, key: str) -> None:
        if self._holds.pop(key, None) is not None:
            self._outbox_changed.set()

    def _held_for(self) -> float | None:
        """Seconds until the last hold ends (None: no hold); expired holds are dropped."""
        now = time.monotonic()
        for key, until in list(self._holds.items()):
            if until <= now:
                del self._holds[key]
        return max(self._holds.values()) - now if self._holds else None

    async def close(self) -> None:
        await self.replicas.close()

    @property
    def leader(self) -> str:
        """Where the stream goes: the leader, as last heard."""
        return self.replicas.leader

    async def on_leader(self, method: str, request: Any, timeout: float) -> Any:  # noqa: ANN401
        """A unary AgentLink call answered by the leader, within `timeout` in all (every
        replica at once: spotdrain.net.leader). One coordinator: one plain call."""
        return await self.replicas.on_leader(pb_grpc.AgentLinkStub, method, request, timeout)

    # --- Taint -------------------------------------------------------------------------------

    async def taint(
        self,
        reclaim_id: str,
        reason: str,
        timeout: float,
        remove: bool = False,
        terminate_at: float = 0.0,
        grace_deadline: float = 0.0,
    ) -> pb.TaintReply:
        request = pb.TaintRequest(
            node_id=self.cfg.node_id,
            reclaim_id=reclaim_id,
            reason=reason,
            remove=remove,
            terminate_at=terminate_at,
            grace_deadline=grace_deadline,
        )
        try:
            return await self.on_leader("Taint", request, max(timeout, 0.001))
        except grpc.aio.AioRpcError as e:
            raise TaintError(
                f"taint {self.cfg.node_id}: coordinator gave {e.code().name}: {e.details()}"
            ) from e

    async def taint_until_answered(
        self,
        reclaim_id: str,
        reason: str,
        remove: bool = False,
        terminate_at: float = 0.0,
        grace_deadline: float = 0.0,
    ) -> None:
        """Background retry after the local fallback; returns once the coordinator stored it."""
        attempt = 0
        while True:
            try:
                await self.taint(
                    reclaim_id,
                    reason,
                    timeout=2.0,
                    remove=remove,
                    terminate_at=terminate_at,
                    grace_deadline=grace_deadline,
                )
                return
            except TaintError as e:
                log.info(
                    "node %s reclamation %s: remote taint retry: %s",
                    self.cfg.node_id,
                    reclaim_id,
                    e,
                )
                await asyncio.sleep(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])
                attempt += 1

    async def resume_until_answered(self, reclaim_id: str) -> None:
        """The owner's resume reaches the coordinator, however long it is away."""
        request = pb.SetWorkloadRequest(
            node_id=self.cfg.node_id, enabled=True, reclaim_id=reclaim_id
        )
        attempt = 0
        while True:
            try:
                await self.on_leader("SetWorkload", request, 2.0)
                return
            except grpc.aio.AioRpcError as e:
                log.info("node %s: resume retry: %s", self.cfg.node_id, e.code().name)
                await asyncio.sleep(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])
                attempt += 1

    # --- worker and rental reports and slots (not durable: the latest state is what matters,
    # --- and registration re-sends every running worker and rental) -------------------------

    def report_worker(self, worker_id: str, report: dict) -> None:
        msg = pb.WorkerReport(worker_id=worker_id, **_short(report))
        self._reports.append(pb.AgentMessage(worker=msg))
        self._outbox_changed.set()

    def register_again(self, registration: pb.Register) -> None:
        """A fuller registration on the open stream (the inventory was incomplete at the
        session's start); the coordinator reconciles again. Without a stream, the next
        session registers anyway."""
        if self.connected.is_set():
            self._reports.append(pb.AgentMessage(register=registration))
            self._outbox_changed.set()

    def report_rental(self, rental_id: str, report: dict) -> None:
        """A rental's container started, stopped or was refused (RentalReport fields)."""
        msg = pb.RentalReport(rental_id=rental_id, **_short(report))
        self._reports.append(pb.AgentMessage(rental=msg))
        self._outbox_changed.set()

    def report_slots(self, worker_id: str, in_use: int, capacity: int, state: str) -> None:
        self._slots[worker_id] = pb.WorkerSlots(
            worker_id=worker_id, slots_in_use=in_use, capacity=capacity, claimed_state=state
        )
        self._outbox_changed.set()

    # --- the stream --------------------------------------------------------------------------

    async def run(self) -> None:
        attempt = 0
        while True:
            try:
                await self._session()
                attempt = 0
            except grpc.aio.AioRpcError as e:
                if e.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                    # Our certificate does not match our node id. Retrying slowly, not exiting:
                    # the node must still answer notices on its own (local taint) meanwhile.
                    log.error(
                        "node %s: coordinator refuses us: %s; retrying in %.0f s",
                        self.cfg.node_id,
                        e.details(),
                        REFUSED_RETRY_S,
                    )
                    await asyncio.sleep(REFUSED_RETRY_S)
                    continue
                log.info(
                    "node %s: coordinator %s stream: %s: %s",
                    self.cfg.node_id,
                    self.leader,
                    e.code().name,
                    e.details(),
                )
                self.replicas.moved(e)
                if leader_hint(e):
                    attempt = 0  # sent on to the leader: go at once
            except asyncio.InvalidStateError:
                # grpc.aio raises this from write() when the call died under us (the
                # coordinator went away between connecting and registering): reconnect.
                log.info("node %s: coordinator stream closed under us", self.cfg.node_id)
            finally:
                self.connected.clear()
            await asyncio.sleep(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])
            attempt += 1

    async def _session(self) -> None:
        call = self.replicas.stub(pb_grpc.AgentLinkStub).Connect()
        await call.write(pb.AgentMessage(register=await self.registration()))
        reply = await call.read()
        if reply is grpc.aio.EOF or reply.WhichOneof("body") != "registered":
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                "coordinator closed the stream before registering us",
            )
        self.remote_taints = list(reply.registered.taints)
        self.connected.set()
        log.info("node %s: registered with coordinator %s", self.cfg.node_id, self.leader)
        in_flight: set[str] = set()
        # Due every HEARTBEAT_S even while slot reports keep the stream busy: slot reports do
        # not refresh a worker's expiry at the coordinator, heartbeats do.
        last_heartbeat = time.monotonic()
        acks = asyncio.create_task(self._read_acks(call, in_flight))
        try:
            while not acks.done():
                # Clear before reading: an event put after the read sets the flag again.
                self._outbox_changed.clear()
                while self._reports:
                    await call.write(self._reports[0])
                    self._reports.pop(0)  # only once written: a broken stream keeps it
                if self._slots:
                    slots, self._slots = list(self._slots.values()), {}
                    await call.write(pb.AgentMessage(slots=pb.SlotReport(workers=slots)))
                held = self._held_for()
                unsent = []
                if held is None:
                    unsent = [to_pb(e) for e in self.outbox.pending() if e.uid not in in_flight]
                if unsent:
                    for batch in batches(unsent):
                        in_flight.update(e.uid for e in batch)
                        await call.write(pb.AgentMessage(events=pb.EventBatch(events=batch)))
                    continue
                waiter = asyncio.create_task(self._outbox_changed.wait())
                due = max(HEARTBEAT_S - (time.monotonic() - last_heartbeat), 0.0)
                done, _ = await asyncio.wait(
                    {waiter, acks},
                    timeout=due if held is None else min(due, held),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                waiter.cancel()
                if time.monotonic() - last_heartbeat >= HEARTBEAT_S:
                    last_heartbeat = time.monotonic()
                    slots = [
                        pb.WorkerSlots(
                            worker_id=w, slots_in_use=used, capacity=cap, claimed_state=state
                        )
                        for w, used, cap, state in self.heartbeat_slots()
                    ]
                    await call.write(
                        pb.AgentMessage(
                            heartbeat=pb.Heartbeat(node_id=self.cfg.node_id, workers=slots)
                        )
                    )
            await acks  # re-raises the stream's error
        finally:
            acks.cancel()
            call.cancel()

    async def _read_acks(self, call: grpc.aio.StreamStreamCall, in_flight: set[str]) -> None:
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                return
            which = msg.WhichOneof("body")
            if which == "ack":
                self.outbox.acknowledge(msg.ack.uids)
                in_flight.difference_update(msg.ack.uids)
                # Room in the next pending(): a backlog longer than one read goes on at once,
                # not at the next heartbeat.
                self._outbox_changed.set()
            elif which in ("start_worker", "drain_worker", "start_rental", "stop_rental"):
                self.on_command(msg)


def _short(report: dict) -> dict:
    """Free text (a Docker error, an exit reason) cut to what the coordinator accepts, so a
    long message is a shortened report rather than a refused one that ends the stream."""
    cap = limits.MAX_STRING_CHARS
    return {
        k: (v[: cap - 3] + "..." if isinstance(v, str) and len(v) > cap else v)
        for k, v in report.items()
    }
