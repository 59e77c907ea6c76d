"""A heartbeat storm against the real coordinator: an agent that keeps claiming `ready` for a
worker the coordinator is draining changes nothing (docs/design.md invariant 3)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc

from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc


def aio_channel(coordinator, who) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(
        Path(who.ca).read_bytes(), Path(who.key).read_bytes(), Path(who.cert).read_bytes()
    )
    return grpc.aio.secure_channel(coordinator.address, creds)


async def test_a_heartbeat_storm_claiming_ready_never_ends_a_drain(coordinator, pki):
    """node-a's worker is draining for a pause. A confused agent sends a thousand heartbeats
    claiming the worker is ready and idle. The worker stays draining, never returns to the
    routing table, and the coordinator keeps asking the agent to drain it."""
    node = aio_channel(coordinator, pki.issue("node:node-a"))
    ops = aio_channel(coordinator, coordinator.operator)
    outgoing: asyncio.Queue[pb.AgentMessage] = asyncio.Queue()

    async def messages():
        while True:
            yield await outgoing.get()

    stream = pb_grpc.AgentLinkStub(node).Connect(messages())
    await outgoing.put(
        pb.AgentMessage(register=pb.Register(node_id="node-a", gpus=[pb.Gpu(index=0, name="fake")]))
    )
    assert (await stream.read()).WhichOneof("body") == "registered"

    admin = pb_grpc.AdminStub(ops)
    info = await admin.StartWorker(
        pb.StartWorkerRequest(node_id="node-a", model="m", image="img", slots=2)
    )
    start = await stream.read()
    assert start.start_worker.worker_id == info.worker_id
    await outgoing.put(
        pb.AgentMessage(
            worker=pb.WorkerReport(
                worker_id=info.worker_id, state="started", gate_address="127.0.0.1:1", capacity=2
            )
        )
    )

    routes = pb_grpc.RoutesStub(ops)

    async def snapshot() -> list[str]:
        watch = routes.WatchRoutes(pb.WatchRoutesRequest(model="m"))
        first = await watch.read()
        watch.cancel()
        return [r.worker_id for r in first.upsert]

    for _ in range(50):
        if await snapshot() == [info.worker_id]:
            break
        await asyncio.sleep(0.05)
    assert await snapshot() == [info.worker_id]

    now = time.time()
    await pb_grpc.AgentLinkStub(node).Taint(
        pb.TaintRequest(
            node_id="node-a",
            reclaim_id="rcl-p",
            reason="pause",
            terminate_at=now + 120,
            grace_deadline=now + 110,
        )
    )
    drain = await stream.read()
    assert drain.drain_worker.worker_id == info.worker_id
    assert drain.drain_worker.grace_deadline == now + 110

    for i in range(1000):
        await outgoing.put(
            pb.AgentMessage(
                heartbeat=pb.Heartbeat(
                    node_id="node-a",
                    workers=[
                        pb.WorkerSlots(
                            worker_id=info.worker_id,
                            slots_in_use=i % 2,
                            capacity=2,
                            claimed_state="ready",
                        )
                    ],
                )
            )
        )
    # The coordinator answers the storm by repeating the drain, never by serving again.
    again = await asyncio.wait_for(stream.read(), 10)
    assert again.drain_worker.worker_id == info.worker_id
    assert again.drain_worker.grace_deadline == now + 110  # never extended
    # A barrier, not a sleep: the coordinator reads the stream in order, so the acknowledgement
    # of an event sent after the storm comes once all 1,000 heartbeats have been handled.
    barrier = pb.Event(uid="after-the-storm", kind="barrier", node_id="node-a", wall_time=now)
    await outgoing.put(pb.AgentMessage(events=pb.EventBatch(events=[barrier])))
    while True:
        answer = await asyncio.wait_for(stream.read(), 10)
        if answer.WhichOneof("body") == "ack" and barrier.uid in answer.ack.uids:
            break
        assert answer.WhichOneof("body") in ("drain_worker", "ack"), answer  # never a start

    workers = (await admin.ListWorkers(pb.ListWorkersRequest())).workers
    assert [(w.worker_id, w.state) for w in workers] == [(info.worker_id, "draining")]
    assert await snapshot() == []
    ready_events = []
    async for stored in admin.WatchEvents(pb.WatchEventsRequest(from_id=0)):
        if stored.event.kind == "worker_ready":
            ready_events.append(stored)
    assert len(ready_events) == 1  # the first start only

    stream.cancel()
    await node.close()
    await ops.close()
