"""Every path that can put a worker on a node goes through the one placement gate (DESIGN.md
invariant 4), tested against the real coordinator with fake agents: an operator's request, a
node coming back from a reboot, the recovery loop replacing a missing worker. (A resume is in
test_pause.py; a worker restarted after a rental ends comes with rentals.)"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from harness import start_coordinator
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc


def aio_channel(coordinator, who) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(
        Path(who.ca).read_bytes(), Path(who.key).read_bytes(), Path(who.cert).read_bytes())
    return grpc.aio.secure_channel(coordinator.address, creds)


class FakeNode:
    """An agent as the coordinator sees it: a stream that registers, reports and obeys."""

    def __init__(self, coordinator, pki, node_id: str) -> None:
        self.node_id = node_id
        self.channel = aio_channel(coordinator, pki.issue(f"node:{node_id}"))
        self.stub = pb_grpc.AgentLinkStub(self.channel)
        self.stream = None

    async def connect(self, running: list[pb.WorkerReport] = ()) -> None:
        self.outgoing: asyncio.Queue[pb.AgentMessage] = asyncio.Queue()

        async def messages():
            while True:
                yield await self.outgoing.get()

        self.stream = self.stub.Connect(messages())
        await self.outgoing.put(pb.AgentMessage(register=pb.Register(
            node_id=self.node_id, gpus=[pb.Gpu(index=0), pb.Gpu(index=1)],
            workers=list(running))))
        assert (await self.stream.read()).WhichOneof("body") == "registered"

    async def command(self, timeout: float = 10) -> pb.CoordinatorMessage:
        return await asyncio.wait_for(self.stream.read(), timeout)

    async def start_next(self) -> str:
        """Obey the next start command; return the worker id."""
        msg = await self.command()
        assert msg.WhichOneof("body") == "start_worker", msg
        wid = msg.start_worker.worker_id
        await self.outgoing.put(pb.AgentMessage(worker=pb.WorkerReport(
            worker_id=wid, state="started", gate_address=f"127.0.0.1:{msg.start_worker.port}",
            capacity=msg.start_worker.capacity)))
        return wid

    async def heartbeat(self, worker_id: str) -> None:
        await self.outgoing.put(pb.AgentMessage(heartbeat=pb.Heartbeat(
            node_id=self.node_id, workers=[pb.WorkerSlots(worker_id=worker_id, capacity=1,
                                                          claimed_state="ready")])))

    async def pause(self, reason: str = "pause") -> None:
        now = time.time()
        await self.stub.Taint(pb.TaintRequest(node_id=self.node_id, reclaim_id=f"rcl-{reason}",
                                              reason=reason, terminate_at=now + 120,
                                              grace_deadline=now + 110))

    async def disconnect(self) -> None:
        self.stream.cancel()
        await asyncio.sleep(0.2)

    async def close(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
        await self.channel.close()


class Ops:
    def __init__(self, coordinator) -> None:
        self.channel = aio_channel(coordinator, coordinator.operator)
        self.admin = pb_grpc.AdminStub(self.channel)

    async def start(self, node: str) -> pb.WorkerInfo:
        return await self.admin.StartWorker(pb.StartWorkerRequest(
            node_id=node, model="m", image="img", slots=1))

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
        deadline = time.monotonic() + timeout
        while (await self.workers())[worker_id].state != state:
            assert time.monotonic() < deadline, f"{worker_id} never {state}"
            await asyncio.sleep(0.05)


@pytest.fixture
async def ops(coordinator):
    o = Ops(coordinator)
    yield o
    await o.channel.close()


@pytest.mark.parametrize("reason, refusal", [("pause", "workload_disabled"),
                                             ("notice", "tainted")])
async def test_an_operator_cannot_place_on_a_paused_or_tainted_node(
    coordinator, pki, ops, reason, refusal
):
    node = FakeNode(coordinator, pki, "node-a")
    await node.connect()
    try:
        await node.pause(reason)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ops.start("node-a")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert refusal in err.value.details()
        refused = await ops.events("placement_refused")
        assert [r.event.details_json for r in refused][0].count(refusal) == 1
        assert await ops.workers() == {}
    finally:
        await node.close()


async def test_an_operator_cannot_place_on_an_unknown_or_disconnected_node(coordinator, pki, ops):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ops.start("node-nowhere")
    assert "unknown_node" in err.value.details()
    node = FakeNode(coordinator, pki, "node-a")
    await node.connect()
    await node.disconnect()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ops.start("node-a")
    assert "not_connected" in err.value.details()
    await node.close()


async def test_a_node_back_from_a_reboot_gets_its_workers_again_through_the_gate(
    coordinator, pki, ops
):
    """node-a reboots: its stream drops and it comes back with no worker running. The
    worker it lost is stopped and a new one placed there, through the gate."""
    node = FakeNode(coordinator, pki, "node-a")
    await node.connect()
    try:
        info = await ops.start("node-a")
        assert await node.start_next() == info.worker_id
        await ops.wait_state(info.worker_id, "ready")
        await node.disconnect()
        await node.connect(running=[])
        replacement = await node.start_next()
        workers = await ops.workers()
        assert workers[info.worker_id].state == "stopped"
        assert replacement != info.worker_id
        starting = await ops.events("worker_starting")
        assert b'"reregistration"' in starting[-1].event.details_json.encode()
    finally:
        await node.close()


async def test_a_node_back_from_a_reboot_paused_gets_no_worker(coordinator, pki, ops):
    """The owner paused node-a while it was rebooting (the pause reached the coordinator): it
    registers again with nothing running, and the gate places nothing."""
    node = FakeNode(coordinator, pki, "node-a")
    await node.connect()
    try:
        info = await ops.start("node-a")
        await node.start_next()
        await ops.wait_state(info.worker_id, "ready")
        await node.disconnect()
        await node.pause()
        await node.connect(running=[])
        with pytest.raises(TimeoutError):
            while True:  # anything but a start is fine; a start fails the test
                msg = await node.command(timeout=1.5)
                assert msg.WhichOneof("body") != "start_worker", msg
        # The pause drained the worker while the node was away; the reboot ended it.
        assert (await ops.workers())[info.worker_id].state == "stopped"
        assert len(await ops.workers()) == 1
    finally:
        await node.close()


async def test_the_recovery_loop_replaces_a_missing_worker_through_the_gate(tmp_path, pki):
    """node-a's agent vanishes (no stream, no heartbeat). After the heartbeat ttl the recovery
    loop stops counting on its worker and places a replacement on node-c; node-b, paused, is
    refused by the gate on the way (it is tried first: as empty as node-c, first by name)."""
    coordinator = start_coordinator(tmp_path / "c", tls=pki, extra=("--heartbeat-ttl-s", "1"))
    ops = Ops(coordinator)
    nodes = {n: FakeNode(coordinator, pki, n) for n in ("node-a", "node-b", "node-c")}
    try:
        for n in nodes.values():
            await n.connect()
        await nodes["node-b"].pause()
        info = await ops.start("node-a")
        await nodes["node-a"].start_next()
        await ops.wait_state(info.worker_id, "ready")
        await nodes["node-a"].heartbeat(info.worker_id)
        await asyncio.sleep(0.3)
        await nodes["node-a"].disconnect()
        replacement = await nodes["node-c"].start_next()
        await ops.wait_state(info.worker_id, "stopped")
        assert (await ops.workers())[replacement].node_id == "node-c"
        assert await ops.events("worker_missing")
        refused = await ops.events("placement_refused")
        assert any(r.event.node_id == "node-b" and b"recovery" in r.event.details_json.encode()
                   for r in refused)
    finally:
        for n in nodes.values():
            await n.close()
        await ops.channel.close()
        coordinator.proc.stop()


async def test_a_worker_that_never_starts_stops_holding_its_gpu(tmp_path, pki):
    """The start command is lost (the agent never answers it). After the start timeout the
    worker is given up, and the node's GPU is free for the next placement."""
    coordinator = start_coordinator(tmp_path / "c", tls=pki, extra=("--start-timeout-s", "1"))
    ops = Ops(coordinator)
    node = FakeNode(coordinator, pki, "node-a")
    try:
        await node.connect()
        first = await ops.start("node-a")
        await node.command()  # received, never answered
        second = await ops.start("node-a")  # the node's second GPU
        await node.command()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ops.start("node-a")
        assert "not_enough_gpus" in err.value.details()
        await ops.wait_state(first.worker_id, "stopped", timeout=10)
        await ops.wait_state(second.worker_id, "stopped", timeout=10)
        assert len(await ops.events("worker_start_timeout")) == 2
        third = await ops.start("node-a")
        assert third.state == "starting"
    finally:
        await node.close()
        await ops.channel.close()
        coordinator.proc.stop()
