"""A coordinator SIGKILLed and started again on the same store, on each backend: nothing it
had promised is lost, and nothing is replaced because the restart made a node look late.

Fake agents over real gRPC with mutual TLS (tests/fakes/fakenode.py); the coordinator is the real
process, killed with SIGKILL."""

from __future__ import annotations

import asyncio
import json
import time

from fakes.fakenode import FakeNode, Ops
from fakes.harness import start_coordinator
from fakes.waiting import eventually
from spotdrain.v1 import spotdrain_pb2 as pb


async def details(ops: Ops, kind: str) -> list[dict]:
    return [
        {**json.loads(e.event.details_json), "_node": e.event.node_id, "_time": e.event.wall_time}
        for e in await ops.events(kind)
    ]


def restart(coordinator, tmp_path, pki, extra=()):
    port = int(coordinator.address.rsplit(":", 1)[1])
    coordinator.proc.kill()
    return start_coordinator(tmp_path / "c", tls=pki, db=coordinator.db, port=port, extra=extra)


async def test_a_resumed_nodes_draining_worker_is_replaced_after_a_coordinator_crash(
    tmp_path, pki, coordinator_db
):
    """The owner resumes while the paused worker still drains: its replacement waits for the
    stop. The coordinator is SIGKILLed before the stop arrives; the restarted one still places
    the replacement when the agent reports the stop (the replace-after-stop set is stored)."""
    coordinator = start_coordinator(tmp_path / "c", tls=pki, db=coordinator_db)
    node = FakeNode(coordinator, pki, "node-a")
    ops = Ops(coordinator)
    try:
        await node.connect()
        info = await ops.start("node-a")
        await node.start_next()
        await ops.wait_state(info.worker_id, "ready")
        await node.pause()
        await ops.wait_state(info.worker_id, "draining")
        await node.resume()
        await ops.channel.close()
        await node.close()

        coordinator = restart(coordinator, tmp_path, pki)
        node = FakeNode(coordinator, pki, "node-a")
        ops = Ops(coordinator)
        await node.connect(
            running=[
                pb.WorkerReport(
                    worker_id=info.worker_id,
                    state="started",
                    gate_address="127.0.0.1:1",
                    capacity=1,
                )
            ]
        )
        await node.outgoing.put(
            pb.AgentMessage(
                worker=pb.WorkerReport(worker_id=info.worker_id, state="stopped", exit_code=0)
            )
        )
        start = await node.next_of("start_worker")
        assert start.start_worker.model == "m"
        starting = await details(ops, "worker_starting")
        assert [s["path"] for s in starting] == ["operator", "resume"]
        assert (await ops.workers())[info.worker_id].state == "stopped"
    finally:
        await node.close()
        await ops.channel.close()
        coordinator.proc.stop()


async def test_a_models_start_backoff_survives_a_coordinator_crash(tmp_path, pki, coordinator_db):
    """A model's worker is refused by its node (a wrong image): the next start waits 5 s. The
    coordinator is SIGKILLed at once; the restarted one still waits out the same backoff."""
    coordinator = start_coordinator(tmp_path / "c", tls=pki, db=coordinator_db)
    node = FakeNode(coordinator, pki, "node-a")
    ops = Ops(coordinator)
    try:
        await node.connect()
        await ops.admin.SetModelReplicas(
            pb.SetModelReplicasRequest(model="bad", replicas=1, image="no-such-image", slots=1)
        )
        start = await node.next_of("start_worker")
        await node.outgoing.put(
            pb.AgentMessage(
                worker=pb.WorkerReport(
                    worker_id=start.start_worker.worker_id, state="refused", reason="no such image"
                )
            )
        )
        [failed] = await eventually(lambda: details(ops, "capacity_start_failed"))
        retry_at = failed["_time"] + failed["retry_in_s"]
        await ops.channel.close()
        await node.close()

        coordinator = restart(coordinator, tmp_path, pki)
        node = FakeNode(coordinator, pki, "node-a")
        ops = Ops(coordinator)
        await node.connect()
        await node.next_of("start_worker", timeout=30)
        starts = await details(ops, "worker_starting")
        assert len(starts) == 2
        assert starts[1]["_time"] >= retry_at  # not before the stored backoff ended
    finally:
        await node.close()
        await ops.channel.close()
        coordinator.proc.stop()


async def test_a_restart_gives_every_node_a_full_heartbeat_ttl(tmp_path, pki, coordinator_db):
    """Two nodes' workers were ready; the coordinator is SIGKILLed and stays down longer than
    the heartbeat TTL. node-a reconnects at once and heartbeats; node-b never comes back. Only
    node-b's worker is declared missing (once the TTL from the restart has run out): node-a's,
    last heard of long before, is not replaced."""
    ttl = ("--heartbeat-ttl-s", "3")
    coordinator = start_coordinator(tmp_path / "c", tls=pki, db=coordinator_db, extra=ttl)
    a, b = FakeNode(coordinator, pki, "node-a"), FakeNode(coordinator, pki, "node-b")
    ops = Ops(coordinator)
    try:
        await a.connect()
        await b.connect()
        wa = (await ops.start("node-a")).worker_id
        await a.start_next()
        wb = (await ops.start("node-b")).worker_id
        await b.start_next()
        for worker_id in (wa, wb):
            await ops.wait_state(worker_id, "ready")
        await a.heartbeat(wa)
        await b.heartbeat(wb)
        await ops.channel.close()
        for n in (a, b):
            await n.close()
        port = int(coordinator.address.rsplit(":", 1)[1])
        coordinator.proc.kill()
        # Not an absence proof: real time must pass every worker's expiry as the dead
        # coordinator knew it (a real process, no fake clock) before it comes back.
        await asyncio.sleep(4)
        coordinator = start_coordinator(
            tmp_path / "c", tls=pki, db=coordinator.db, port=port, extra=ttl
        )
        a = FakeNode(coordinator, pki, "node-a")
        ops = Ops(coordinator)
        await a.connect(
            running=[
                pb.WorkerReport(
                    worker_id=wa, state="started", gate_address="127.0.0.1:1", capacity=1
                )
            ]
        )
        await a.heartbeat(wa)
        started = time.monotonic()
        missing = await eventually(lambda: details(ops, "worker_missing"), timeout=20)
        assert time.monotonic() - started >= 1.5  # a TTL from the restart, not from before
        assert [m["worker_id"] for m in missing] == [wb]
        workers = await ops.workers()
        assert workers[wa].state == "ready" and workers[wb].state == "stopped"
    finally:
        await a.close()
        await ops.channel.close()
        coordinator.proc.stop()
