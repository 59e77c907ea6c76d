"""Every path that can put a worker on a node goes through the one placement gate (docs/design.md
invariant 4), tested against the real coordinator with fake agents: an operator's request, a
node coming back from a reboot, the recovery loop replacing a missing worker, and render never
on spot through each of them. (A resume is in test_pause.py; a rental's creation and a worker
restarted after a rental ends in test_rentals.py; every rule on every path, as a table, in
test_worker_machine.py.)"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from fakes.fakenode import FakeNode, Ops
from fakes.harness import start_coordinator


@pytest.fixture
async def ops(coordinator):
    o = Ops(coordinator)
    yield o
    await o.channel.close()


@pytest.mark.parametrize("reason, refusal", [("pause", "workload_disabled"), ("notice", "tainted")])
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
        await nodes["node-a"].flushed()  # the heartbeat handled
        await nodes["node-a"].disconnect()
        replacement = await nodes["node-c"].start_next()
        await ops.wait_state(info.worker_id, "stopped")
        assert (await ops.workers())[replacement].node_id == "node-c"
        assert await ops.events("worker_missing")
        refused = await ops.events("placement_refused")
        assert any(
            r.event.node_id == "node-b" and b"recovery" in r.event.details_json.encode()
            for r in refused
        )
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


async def test_render_is_refused_on_spot_through_every_path_that_can_carry_it(tmp_path, pki):
    """Operator: refused outright. Recovery: a missing render job is replaced on the on-demand
    node, never the emptier spot one. Re-registration: a render job's node comes back from a
    reboot as spot, and the job is not placed there again."""
    coordinator = start_coordinator(tmp_path / "c", tls=pki, extra=("--heartbeat-ttl-s", "1"))
    ops = Ops(coordinator)
    spot = FakeNode(coordinator, pki, "node-a-spot", spot=True)
    od1 = FakeNode(coordinator, pki, "node-b-od", spot=False)
    od2 = FakeNode(coordinator, pki, "node-c-od", spot=False)
    try:
        for n in (spot, od1, od2):
            await n.connect()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ops.start("node-a-spot", kind="render")
        assert "render_on_spot" in err.value.details()

        # Recovery: od1's job goes missing; the spot node (emptiest, first by name) is refused.
        job = await ops.start("node-b-od", kind="render")
        assert job.kind == "render"
        await od1.start_next()
        await ops.wait_state(job.worker_id, "ready")
        await od1.heartbeat(job.worker_id)
        await od1.disconnect()
        replacement = await od2.start_next()
        assert (await ops.workers())[replacement].kind == "render"
        refused = [r.event for r in await ops.events("placement_refused")]
        assert any(
            e.node_id == "node-a-spot"
            and '"path": "recovery"' in e.details_json
            and "render_on_spot" in e.details_json
            for e in refused
        )

        # Re-registration: od2 reboots (its job gone) and comes back as a spot node.
        await od2.disconnect()
        od2.spot = True
        await od2.connect(running=[])
        refused = [r.event for r in await ops.events("placement_refused")]
        assert any(
            e.node_id == "node-c-od"
            and '"path": "reregistration"' in e.details_json
            and "render_on_spot" in e.details_json
            for e in refused
        )
        assert (await ops.workers())[replacement].state == "stopped"
        with pytest.raises(asyncio.TimeoutError):
            while True:  # anything but a start is fine
                msg = await od2.command(timeout=1.0)
                assert msg.WhichOneof("body") != "start_worker", msg
    finally:
        for n in (spot, od1, od2):
            await n.close()
        await ops.channel.close()
        coordinator.proc.stop()
