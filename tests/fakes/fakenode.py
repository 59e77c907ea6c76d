"""An agent as the coordinator sees it, for coordinator tests that need no Docker: a real gRPC
stream that registers, reports and obeys, driven by the test. And `Ops`, an operator's client."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import grpc

from fakes.waiting import eventually
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc


def aio_channel(coordinator, who) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(
        Path(who.ca).read_bytes(), Path(who.key).read_bytes(), Path(who.cert).read_bytes()
    )
    return grpc.aio.secure_channel(coordinator.address, creds)


class FakeNode:
    """An agent as the coordinator sees it: a stream that registers, reports and obeys."""

    def __init__(
        self,
        coordinator,
        pki,
        node_id: str,
        spot: bool = True,
        group: str = "default",
        provider: str = "",
        gpus: int = 2,
    ) -> None:
        self.node_id = node_id
        self.spot, self.group, self.provider, self.gpus = spot, group, provider, gpus
        self.coordinator = coordinator
        self.channel = aio_channel(coordinator, pki.issue(f"node:{node_id}"))
        self.stub = pb_grpc.AgentLinkStub(self.channel)
        self.stream = None
        self._unread: list[pb.CoordinatorMessage] = []  # commands read past by flushed()
        self._operator: grpc.aio.Channel | None = None  # disconnect()'s witness, opened once

    async def connect(
        self,
        running: list[pb.WorkerReport] = (),
        rentals: list[pb.RentalReport] = (),
        incomplete: bool = False,
    ) -> None:
        self.outgoing: asyncio.Queue[pb.AgentMessage] = asyncio.Queue()
        self._unread = []

        async def messages():
            while True:
                yield await self.outgoing.get()

        self.stream = self.stub.Connect(messages())
        await self.outgoing.put(
            pb.AgentMessage(
                register=pb.Register(
                    node_id=self.node_id,
                    gpus=[pb.Gpu(index=i) for i in range(self.gpus)],
                    spot=self.spot,
                    node_group=self.group,
                    provider=self.provider,
                    workers=list(running),
                    rentals=list(rentals),
                    inventory_incomplete=incomplete,
                )
            )
        )
        assert (await self.stream.read()).WhichOneof("body") == "registered"

    async def command(self, timeout: float = 10) -> pb.CoordinatorMessage:
        if self._unread:
            return self._unread.pop(0)
        return await asyncio.wait_for(self.stream.read(), timeout)

    async def flushed(self, timeout: float = 10) -> None:
        """A barrier: returns once the coordinator has handled everything this node sent so
        far. The coordinator reads a stream in order, so the acknowledgement of an event sent
        now comes after it; commands that arrive meanwhile are kept for command()."""
        uid = await self.event("barrier", {})
        deadline = time.monotonic() + timeout
        while True:
            msg = await asyncio.wait_for(self.stream.read(), max(0.01, deadline - time.monotonic()))
            if msg.WhichOneof("body") == "ack" and uid in msg.ack.uids:
                return
            if msg.WhichOneof("body") != "ack":
                self._unread.append(msg)

    async def start_next(self) -> str:
        """Obey the next start command; return the worker id."""
        msg = await self.command()
        assert msg.WhichOneof("body") == "start_worker", msg
        wid = msg.start_worker.worker_id
        await self.outgoing.put(
            pb.AgentMessage(
                worker=pb.WorkerReport(
                    worker_id=wid,
                    state="started",
                    gate_address=f"127.0.0.1:{msg.start_worker.port}",
                    capacity=msg.start_worker.capacity,
                )
            )
        )
        return wid

    async def next_of(self, body: str, timeout: float = 10) -> pb.CoordinatorMessage:
        """The next command of this kind; others (drains, stops) are skipped."""
        deadline = time.monotonic() + timeout
        while True:
            msg = await self.command(timeout=max(0.01, deadline - time.monotonic()))
            if msg.WhichOneof("body") == body:
                return msg

    async def report_rental(self, rental_id: str, state: str, exit_code: int = 0) -> None:
        await self.outgoing.put(
            pb.AgentMessage(
                rental=pb.RentalReport(
                    rental_id=rental_id,
                    state=state,
                    container=f"c-{rental_id}",
                    exit_code=exit_code,
                )
            )
        )

    async def heartbeat(self, worker_id: str) -> None:
        await self.outgoing.put(
            pb.AgentMessage(
                heartbeat=pb.Heartbeat(
                    node_id=self.node_id,
                    workers=[
                        pb.WorkerSlots(worker_id=worker_id, capacity=1, claimed_state="ready")
                    ],
                )
            )
        )

    async def pause(self, reason: str = "pause", grace_s: float = 110) -> pb.TaintRequest:
        now = time.time()
        request = pb.TaintRequest(
            node_id=self.node_id,
            reclaim_id=f"rcl-{reason}",
            reason=reason,
            terminate_at=now + grace_s + 10,
            grace_deadline=now + grace_s,
        )
        await self.stub.Taint(request)
        return request

    async def resume(self) -> None:
        await self.stub.SetWorkload(
            pb.SetWorkloadRequest(node_id=self.node_id, enabled=True, reclaim_id="rcl-pause")
        )

    async def event(self, kind: str, details: dict, uid: str = "") -> str:
        """One lifecycle event of this node's own, as its outbox sends it; the uid."""
        uid = uid or f"{self.node_id}-{kind}-{time.monotonic_ns()}"
        await self.outgoing.put(
            pb.AgentMessage(
                events=pb.EventBatch(
                    events=[
                        pb.Event(
                            uid=uid,
                            kind=kind,
                            node_id=self.node_id,
                            wall_time=time.time(),
                            details_json=json.dumps(details),
                        )
                    ]
                )
            )
        )
        return uid

    async def disconnect(self) -> None:
        """Drop the stream and return once the coordinator has handled the loss: its node list
        says not connected (what the placement gate reads) and the node's last_seen is stamped
        after the drop (the coordinator's last step). A sleep here raced a busy coordinator."""
        dropped_at = time.time()
        self.stream.cancel()
        if self._operator is None:
            self._operator = aio_channel(self.coordinator, self.coordinator.operator)
        admin = pb_grpc.AdminStub(self._operator)

        async def gone() -> bool:
            nodes = (await admin.ListNodes(pb.ListNodesRequest())).nodes
            node = next(n for n in nodes if n.node_id == self.node_id)
            return not node.connected and node.last_seen >= dropped_at

        await eventually(gone, f"the coordinator to see {self.node_id} disconnected")

    async def close(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
        await self.channel.close()
        if self._operator is not None:
            await self._operator.close()


class Ops:
    def __init__(self, coordinator) -> None:
        self.channel = aio_channel(coordinator, coordinator.operator)
        self.admin = pb_grpc.AdminStub(self.channel)
        self.rentals = pb_grpc.RentalsStub(self.channel)

    async def start(self, node: str, kind: str = "inference") -> pb.WorkerInfo:
        return await self.admin.StartWorker(
            pb.StartWorkerRequest(node_id=node, model="m", image="img", slots=1, kind=kind)
        )

    async def workers(self) -> dict[str, pb.WorkerInfo]:
        reply = await self.admin.ListWorkers(pb.ListWorkersRequest())
        return {w.worker_id: w for w in reply.workers}

    async def events(self, kind: str) -> list[pb.StoredEvent]:
        out = []
        async for stored in self.admin.WatchEvents(pb.WatchEventsRequest(from_id=0)):
            if stored.event.kind == kind:
                out.append(stored)
        return out

    async def wait_state(self, worker_id: str, state: str, timeout: float = 10) -> None:
        async def there() -> bool:
            return (await self.workers())[worker_id].state == state

        await eventually(there, f"{worker_id} {state}", timeout)


async def obey_starts(node: FakeNode, started: list[str]) -> None:
    """Answer every start command at once, as a quick agent would; note the rest."""
    while True:
        msg = await node.command(timeout=3600)
        if msg.WhichOneof("body") == "start_worker":
            wid = msg.start_worker.worker_id
            await node.outgoing.put(
                pb.AgentMessage(
                    worker=pb.WorkerReport(
                        worker_id=wid,
                        state="started",
                        gate_address=f"127.0.0.1:{msg.start_worker.port}",
                        capacity=msg.start_worker.capacity,
                    )
                )
            )
            started.append(wid)


async def events(ops: Ops, kind: str) -> list[dict]:
    return [
        json.loads(e.event.details_json) | {"reclaim_id": e.event.reclaim_id}
        for e in await ops.events(kind)
    ]
