"""Nodes lost without notice, at the real coordinator with fake agents over real gRPC: a node
that vanishes with work on it and no reclamation open is `node_lost` after --node-lost-s (its
work named, its worker out of routing, a replacement asked for, its rental ended `lost`); a
node under a reclamation, or with no work, is not; and a lost node that comes back is
`node_returned`, told to drain what it still runs and to stop its ended rental.

The coordinator runs as its own process here (no fake clock): --node-lost-s is short. The same
deadlines on a fake clock: test_deadline_heap.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from fakes.fakenode import FakeNode, Ops, aio_channel
from fakes.harness import BIN, start_coordinator
from fakes.waiting import eventually
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

LOST_S = "1.5"


@pytest.fixture
async def lost_coordinator(tmp_path, pki):
    # A heartbeat TTL longer than --node-lost-s: the lost path itself takes the worker out.
    coordinator = start_coordinator(
        tmp_path / "c",
        tls=pki,
        extra=("--node-lost-s", LOST_S, "--heartbeat-ttl-s", "60"),
    )
    yield coordinator
    coordinator.proc.stop()


async def holding(
    node: FakeNode, ops: Ops, rentals, desired: bool = False
) -> tuple[str, pb.Rental]:
    """The node connected, running a ready worker (one the fleet wants, when `desired`: the
    capacity keeper places it) and a renter's rental."""
    await node.connect()
    if desired:
        await ops.admin.SetModelReplicas(
            pb.SetModelReplicasRequest(model="m", replicas=1, image="img", slots=1)
        )
    else:
        await ops.start(node.node_id)
    worker_id = await node.start_next()
    await ops.wait_state(worker_id, "ready")
    rental = await rentals.CreateRental(
        pb.CreateRentalRequest(node_id=node.node_id, image="renter/job:1", gpus=1)
    )
    await node.next_of("start_rental")
    await node.report_rental(rental.rental_id, "started")
    return worker_id, rental


async def spotctl(coordinator, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        str(BIN / "spotctl"),
        *coordinator.cli_args(),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def lost_events(ops: Ops) -> dict[str, dict]:
    return {
        e.event.node_id: json.loads(e.event.details_json) | {"reclaim_id": e.event.reclaim_id}
        for e in await ops.events("node_lost")
    }


async def test_a_node_that_vanishes_with_work_is_lost_and_named_and_comes_back(
    lost_coordinator, pki
):
    """node-a serves the fleet's one worker of model m and alice's rental, then vanishes with
    node-b still there."""
    coordinator = lost_coordinator
    ops = Ops(coordinator)
    renter = aio_channel(coordinator, pki.issue("renter:alice"))
    rentals = pb_grpc.RentalsStub(renter)
    node = FakeNode(coordinator, pki, "node-a")
    other = FakeNode(coordinator, pki, "node-b")
    try:
        worker_id, rental = await holding(node, ops, rentals, desired=True)
        await other.connect()
        await node.disconnect()  # and stays away: no stream, no heartbeat, no notice

        lost = (await eventually(lambda: lost_events(ops), ok=lambda d: "node-a" in d))["node-a"]
        reclaim_id = lost["reclaim_id"]
        assert reclaim_id.startswith("lost-node-a-")
        assert [w["worker_id"] for w in lost["workers"]] == [worker_id]
        assert [r["rental_id"] for r in lost["rentals"]] == [rental.rental_id]
        assert "no notice" in lost["why"]
        # Out of routing, the rental ended `lost` as the renter sees it.
        await ops.wait_state(worker_id, "stopped")
        ended = await rentals.GetRental(pb.GetRentalRequest(rental_id=rental.rental_id))
        assert ended.state == "ended" and ended.ended_by == "lost"
        # A replacement asked for under the lost record (no acquirer here: unavailable).
        asked = await eventually(
            lambda: ops.events("replacement_unavailable"),
            ok=lambda evs: any(e.event.reclaim_id == reclaim_id for e in evs),
        )
        assert json.loads(asked[-1].event.details_json)["reason"] == "lost"
        # The model's worker placed again on the node still there, through the gate.
        replacement = await other.start_next()
        await ops.wait_state(replacement, "ready")
        # The record is a kind of its own, apart from drains and overruns.
        tl = await ops.admin.GetTimeline(pb.GetTimelineRequest(reclaim_id=reclaim_id))
        assert (tl.reclamation.reason, tl.reclamation.outcome) == ("lost", "lost")
        kinds = [e.event.kind for e in tl.events]
        assert "node_lost" in kinds and "rental_ended" in kinds
        shown = await spotctl(coordinator, "timeline", reclaim_id)
        assert f"lost node node-a  record {reclaim_id}" in shown
        assert "outcome: LOST: the node vanished with its work, and no notice" in shown

        # Back, still running the worker and the rental's container.
        await node.connect(
            running=[pb.WorkerReport(worker_id=worker_id, state="started")],
            rentals=[pb.RentalReport(rental_id=rental.rental_id, state="started")],
        )
        back = await eventually(lambda: ops.events("node_returned"), ok=bool)
        details = json.loads(back[0].event.details_json)
        assert back[0].event.reclaim_id == reclaim_id
        assert details["stale_workers"] == [worker_id]
        drain = await node.next_of("drain_worker")
        assert drain.drain_worker.worker_id == worker_id
        stop = await node.next_of("stop_rental")
        assert stop.stop_rental.rental_id == rental.rental_id
        tl = await ops.admin.GetTimeline(pb.GetTimelineRequest(reclaim_id=reclaim_id))
        assert "node_returned" in tl.reclamation.steps
    finally:
        await node.close()
        await other.close()
        await renter.close()
        await ops.channel.close()


async def test_no_node_lost_under_a_reclamation_or_without_work(lost_coordinator, pki):
    """A paused node and an idle node vanish, then a node with work: only the last is lost
    (its loss, the last deadline of the three, is the barrier for the others' absence)."""
    coordinator = lost_coordinator
    ops = Ops(coordinator)
    renter = aio_channel(coordinator, pki.issue("renter:alice"))
    rentals = pb_grpc.RentalsStub(renter)
    paused = FakeNode(coordinator, pki, "node-paused")
    idle = FakeNode(coordinator, pki, "node-idle")
    witness = FakeNode(coordinator, pki, "node-witness")
    try:
        await holding(paused, ops, rentals)
        await paused.pause()  # a reclamation open: it drains (or overruns) as before
        await idle.connect()
        await holding(witness, ops, rentals)
        await paused.disconnect()
        await idle.disconnect()
        await witness.disconnect()  # last to go: its loss is the barrier for the others
        found = await eventually(lambda: lost_events(ops), ok=lambda d: "node-witness" in d)
        assert set(found) == {"node-witness"}
    finally:
        for node in (paused, idle, witness):
            await node.close()
        await renter.close()
        await ops.channel.close()
