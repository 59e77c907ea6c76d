"""Rentals at the real coordinator, with fake agents (the agent's side, with real containers, is
in test_agent_rentals.py and test_rental_reclaim.py): the renter's view of a reclaim, who ended
what, reputation, the spot flag under a rental, and GPUs never double-booked."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest

from fakes.fakenode import FakeNode, Ops, aio_channel
from fakes.harness import BIN, start_coordinator
from fakes.waiting import eventually
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc


@pytest.fixture
async def ops(coordinator):
    o = Ops(coordinator)
    yield o
    await o.channel.close()


class Renter:
    def __init__(self, coordinator, pki, name: str) -> None:
        self.channel = aio_channel(coordinator, pki.issue(f"renter:{name}"))
        self.rentals = pb_grpc.RentalsStub(self.channel)

    async def rent(self, node: str, gpus: int = 1) -> pb.Rental:
        return await self.rentals.CreateRental(
            pb.CreateRentalRequest(node_id=node, image="renter/job:1", gpus=gpus)
        )

    async def get(self, rental_id: str) -> pb.Rental:
        return await self.rentals.GetRental(pb.GetRentalRequest(rental_id=rental_id))


@pytest.fixture
async def alice(coordinator, pki):
    r = Renter(coordinator, pki, "alice")
    yield r
    await r.channel.close()


async def running_rental(node: FakeNode, renter: Renter) -> pb.Rental:
    rental = await renter.rent(node.node_id)
    msg = await node.next_of("start_rental")
    assert msg.start_rental.rental_id == rental.rental_id
    assert msg.start_rental.renter == "alice"
    await node.report_rental(rental.rental_id, "started")
    await eventually(lambda: renter.get(rental.rental_id), ok=lambda r: r.state == "running")
    return rental


async def reputation(ops: Ops, **subject) -> pb.Reputation:
    return await ops.admin.GetReputation(pb.GetReputationRequest(**subject))


async def test_a_renter_sees_and_ends_only_its_own_rentals(coordinator, pki, ops, alice):
    node = FakeNode(coordinator, pki, "node-a", spot=False, provider="acme")
    bob = Renter(coordinator, pki, "bob")
    router = aio_channel(coordinator, pki.issue("router:r1"))
    try:
        await node.connect()
        rental = await running_rental(node, alice)
        assert (rental.provider, rental.renter, rental.started_on_spot) == ("acme", "alice", False)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await bob.get(rental.rental_id)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await bob.rentals.EndRental(pb.EndRentalRequest(rental_id=rental.rental_id))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert not (await bob.rentals.ListRentals(pb.ListRentalsRequest())).rentals
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await alice.rentals.CreateRental(
                pb.CreateRentalRequest(node_id="node-a", image="x", renter="bob")
            )
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.RentalsStub(router).ListRentals(pb.ListRentalsRequest())
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # The renter ends it: ended at once, and the agent is told to stop the container.
        ended = await alice.rentals.EndRental(
            pb.EndRentalRequest(rental_id=rental.rental_id, ended_by="provider")
        )  # a renter cannot blame anyone
        assert (ended.state, ended.ended_by) == ("ended", "renter")
        stop = await node.next_of("stop_rental")
        assert stop.stop_rental.rental_id == rental.rental_id
        assert (await reputation(ops, node_id="node-a")).successes == 1
    finally:
        await node.close()
        await bob.channel.close()
        await router.close()


@pytest.mark.parametrize(
    "spot, reason, ended_by, moves",
    [
        (True, "pause", "reclaim", False),  # spot: reclaiming is what spot means
        (True, "notice", "reclaim", False),
        (False, "notice", "reclaim", False),  # the host's cloud reclaimed it: neutral
        (False, "pause", "provider", True),  # the owner took back what it promised
    ],
)
async def test_a_reclaim_tells_the_renter_reclaim_at_and_ends_the_rental_fairly(
    coordinator, pki, ops, alice, spot, reason, ended_by, moves
):
    node = FakeNode(coordinator, pki, "node-a", spot=spot, provider="acme")
    try:
        await node.connect()
        rental = await running_rental(node, alice)
        before = (await reputation(ops, node_id="node-a"), await reputation(ops, provider="acme"))
        watch = alice.rentals.WatchRental(pb.GetRentalRequest(rental_id=rental.rental_id))
        first = await watch.read()
        assert first.state == "running" and not first.HasField("reclaim_at")

        taint = await node.pause(reason)
        update = await asyncio.wait_for(watch.read(), 1.0)  # within a second of the pause
        assert update.reclaim_at == taint.grace_deadline
        assert (update.reclaim_reason, update.reclaim_id) == (reason, taint.reclaim_id)
        assert (await alice.get(rental.rental_id)).reclaim_at == taint.grace_deadline

        # The agent stops the container at reclaim_at (its SIGKILL round at G).
        await node.report_rental(rental.rental_id, "stopped", exit_code=137)
        last = await asyncio.wait_for(watch.read(), 5)
        assert (last.state, last.ended_by, last.exit_code) == ("ended", ended_by, 137)
        assert await watch.read() == grpc.aio.EOF  # the stream ends with the rental

        after = (await reputation(ops, node_id="node-a"), await reputation(ops, provider="acme"))
        for b, a in zip(before, after, strict=True):
            if moves:
                assert a.score < b.score and a.failures == b.failures + 1
            else:
                assert a.score == b.score
        assert after[0].excluded_spot == (1 if spot else 0)
    finally:
        await node.close()


async def test_a_resume_before_reclaim_at_lets_the_rental_go_on(coordinator, pki, ops, alice):
    node = FakeNode(coordinator, pki, "node-a")
    try:
        await node.connect()
        rental = await running_rental(node, alice)
        await node.pause("pause")
        await eventually(lambda: alice.get(rental.rental_id), ok=lambda r: r.HasField("reclaim_at"))
        await node.resume()
        back = await eventually(
            lambda: alice.get(rental.rental_id), ok=lambda r: not r.HasField("reclaim_at")
        )
        assert back.state == "running" and back.reclaim_id == ""
    finally:
        await node.close()


async def test_the_spot_flag_cannot_change_under_a_rental(coordinator, pki, ops, alice):
    node = FakeNode(coordinator, pki, "node-a", spot=False, provider="acme")
    try:
        await node.connect()
        rental = await running_rental(node, alice)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ops.admin.SetNodeSpot(pb.SetNodeSpotRequest(node_id="node-a", spot=True))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert rental.rental_id in err.value.details()
        # Nor by restarting the agent with spot = true.
        await node.disconnect()
        node.spot = True
        await node.connect(rentals=[pb.RentalReport(rental_id=rental.rental_id, state="started")])
        nodes = (await ops.admin.ListNodes(pb.ListNodesRequest())).nodes
        assert [(n.spot, n.active_rentals) for n in nodes] == [(False, 1)]
        assert len(await ops.events("spot_change_refused")) == 2

        # The owner pauses: on-demand, so it is the provider's doing.
        await node.pause("pause")
        await node.report_rental(rental.rental_id, "stopped", exit_code=137)
        ended = await eventually(
            lambda: alice.get(rental.rental_id), ok=lambda r: r.state == "ended"
        )
        assert ended.ended_by == "provider"

        changed = await ops.admin.SetNodeSpot(pb.SetNodeSpotRequest(node_id="node-a", spot=True))
        assert changed.spot is True
        assert (await alice.get(rental.rental_id)).started_on_spot is False  # history stands
        score = await reputation(ops, provider="acme")
        assert (score.failures, score.excluded_spot) == (1, 0)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ops.admin.SetNodeSpot(pb.SetNodeSpotRequest(node_id="node-x", spot=True))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await node.close()


async def test_gpus_are_never_double_booked(coordinator, pki, ops, alice):
    node = FakeNode(coordinator, pki, "node-a", gpus=2)
    try:
        await node.connect()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await alice.rent("node-a", gpus=3)
        assert "not_enough_gpus" in err.value.details()
        rental = await alice.rent("node-a", gpus=2)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ops.start("node-a")
        assert "not_enough_gpus" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await alice.rent("node-a")
        assert "not_enough_gpus" in err.value.details()
        await alice.rentals.EndRental(pb.EndRentalRequest(rental_id=rental.rental_id))
        assert (await ops.start("node-a")).node_id == "node-a"
    finally:
        await node.close()


async def test_a_worker_goes_back_on_the_gpus_a_rental_frees(coordinator, pki, ops, alice):
    """The model wants one worker; the only node is fully rented. When the rental ends the
    worker is placed there, through the gate, on the rental_end_restart path."""
    node = FakeNode(coordinator, pki, "node-a", gpus=1)
    try:
        await node.connect()
        rental = await running_rental(node, alice)
        await ops.admin.SetModelReplicas(
            pb.SetModelReplicasRequest(model="m", replicas=1, image="img", slots=2)
        )
        [short] = await ops.events("capacity_short")
        assert b"not_enough_gpus" in short.event.details_json.encode()
        await node.report_rental(rental.rental_id, "stopped", exit_code=0)
        start = await node.next_of("start_worker")
        assert start.start_worker.model == "m"
        [starting] = await ops.events("worker_starting")
        assert '"path": "rental_end_restart"' in starting.event.details_json
    finally:
        await node.close()


async def test_a_node_back_without_its_rental_container_ends_the_rental(
    coordinator, pki, ops, alice
):
    node = FakeNode(coordinator, pki, "node-a")
    try:
        await node.connect()
        gone = await running_rental(node, alice)
        stale = await running_rental(node, alice)
        await alice.rentals.EndRental(pb.EndRentalRequest(rental_id=stale.rental_id))
        await node.disconnect()
        # Back after a reboot: `gone` is not running any more, `stale` still is.
        await node.connect(rentals=[pb.RentalReport(rental_id=stale.rental_id, state="started")])
        stop = await node.next_of("stop_rental")
        assert stop.stop_rental.rental_id == stale.rental_id
        ended = await eventually(lambda: alice.get(gone.rental_id), ok=lambda r: r.state == "ended")
        assert ended.ended_by == "platform" and "gone" in ended.detail
    finally:
        await node.close()


async def spotctl(coordinator, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        str(BIN / "spotctl"),
        *coordinator.cli_args(),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode, out.decode(), err.decode()


async def test_spotctl_against_the_real_coordinator(coordinator, pki, ops):
    """What an operator types: rent, look at the node, try to flip its flag, read reputation."""
    node = FakeNode(coordinator, pki, "node-a", spot=False, provider="acme")
    try:
        await node.connect()
        code, out, _ = await spotctl(
            coordinator,
            "rentals",
            "create",
            "node-a",
            "--image",
            "renter/job:1",
            "--renter",
            "alice",
            "--json",
        )
        assert code == 0
        rental = json.loads(out)
        await node.next_of("start_rental")
        await node.report_rental(rental["rental_id"], "started")
        code, out, _ = await spotctl(coordinator, "nodes", "--json")
        [shown] = [json.loads(line) for line in out.splitlines()]
        assert (shown["node_id"], shown["spot"], shown["active_rentals"]) == ("node-a", False, 1)
        assert shown["provider"] == "acme"
        code, _, err = await spotctl(coordinator, "node", "set-spot", "node-a", "true")
        assert code == 1 and "FAILED_PRECONDITION" in err and rental["rental_id"] in err
        code, out, _ = await spotctl(
            coordinator, "rentals", "end", rental["rental_id"], "--ended-by", "provider", "--json"
        )
        assert code == 0 and json.loads(out)["ended_by"] == "provider"
        code, out, _ = await spotctl(coordinator, "reputation", "--provider", "acme", "--json")
        score = json.loads(out)
        assert (score["failures"], round(score["score"], 3)) == (1, round(4 / 6, 3))
        code, out, _ = await spotctl(coordinator, "node", "set-spot", "node-a", "true", "--json")
        assert code == 0 and json.loads(out)["spot"] is True
        code, out, _ = await spotctl(coordinator, "rentals", "--json")
        assert json.loads(out)["started_on_spot"] is False
    finally:
        await node.close()


async def test_a_killed_coordinator_keeps_rentals_reclaims_and_avoided_groups(tmp_path, pki):
    """SIGKILL mid-reclaim; the restarted coordinator rebuilds it all from its SQLite file."""
    first = start_coordinator(tmp_path / "c", tls=pki)
    node = FakeNode(first, pki, "node-a", group="group-a")
    elsewhere = FakeNode(first, pki, "node-b", group="group-b")  # so group-a gets avoided
    alice = Renter(first, pki, "alice")
    try:
        await elsewhere.connect()
        await node.connect()
        rental = await running_rental(node, alice)
        taint = await node.pause("notice")
        await eventually(lambda: alice.get(rental.rental_id), ok=lambda r: r.HasField("reclaim_at"))
    finally:
        await node.close()
        await elsewhere.close()
        await alice.channel.close()
    port = first.address.rsplit(":", 1)[1]
    first.proc.kill()
    again = start_coordinator(tmp_path / "c", tls=pki, db=first.db, port=int(port))
    ops, alice, node = (
        Ops(again),
        Renter(again, pki, "alice"),
        FakeNode(again, pki, "node-a", group="group-a"),
    )
    try:
        kept = await alice.get(rental.rental_id)
        assert (kept.state, kept.reclaim_at) == ("running", taint.grace_deadline)
        await node.connect(rentals=[pb.RentalReport(rental_id=rental.rental_id, state="started")])
        shown = {n.node_id: n for n in (await ops.admin.ListNodes(pb.ListNodesRequest())).nodes}
        assert shown["node-a"].group_avoided_until > time.time() + 200  # still avoided (300 s)
        await node.report_rental(rental.rental_id, "stopped", exit_code=137)
        ended = await eventually(
            lambda: alice.get(rental.rental_id), ok=lambda r: r.state == "ended"
        )
        assert ended.ended_by == "reclaim"
    finally:
        await node.close()
        await alice.channel.close()
        await ops.channel.close()
        again.proc.stop()


async def test_a_resume_during_a_notice_leaves_the_notices_reclaim_at(coordinator, pki, alice):
    node = FakeNode(coordinator, pki, "node-a")
    try:
        await node.connect()
        rental = await running_rental(node, alice)
        await node.pause("pause", grace_s=100)
        notice = await node.pause("notice", grace_s=200)
        told = await eventually(
            lambda: alice.get(rental.rental_id), ok=lambda r: r.HasField("reclaim_at")
        )
        assert told.reclaim_reason == "pause"
        await node.resume()
        after = await eventually(
            lambda: alice.get(rental.rental_id), ok=lambda r: r.reclaim_reason == "notice"
        )
        assert (after.reclaim_at, after.reclaim_id) == (notice.grace_deadline, notice.reclaim_id)
    finally:
        await node.close()


async def test_an_ended_rentals_gpus_stay_booked_until_its_container_stopped(
    coordinator, pki, ops, alice
):
    node = FakeNode(coordinator, pki, "node-a", gpus=1)
    try:
        await node.connect()
        rental = await running_rental(node, alice)
        await alice.rentals.EndRental(pb.EndRentalRequest(rental_id=rental.rental_id))
        await node.next_of("stop_rental")
        with pytest.raises(grpc.aio.AioRpcError) as err:  # its container still runs
            await ops.start("node-a")
        assert "not_enough_gpus" in err.value.details()
        await node.report_rental(rental.rental_id, "stopped", exit_code=143)
        ended = await eventually(
            lambda: alice.get(rental.rental_id), ok=lambda r: r.HasField("exit_code")
        )
        assert (ended.ended_by, ended.exit_code) == ("renter", 143)
        assert (await ops.start("node-a")).node_id == "node-a"
    finally:
        await node.close()


async def test_a_node_that_cannot_list_its_containers_loses_no_rental(coordinator, pki, ops, alice):
    """The agent restarted while Docker was down: its registration says the inventory is
    incomplete, and nothing missing from it is taken as gone. Once complete, a rental still
    missing waits for its stop report, which says how it ended (here: the owner's pause the
    agent applied on its own, past G, on an on-demand node); one with no report at all ends
    as platform after a few seconds."""
    node = FakeNode(coordinator, pki, "node-a", spot=False, gpus=4)
    try:
        await node.connect()
        paused = await running_rental(node, alice)
        gone = await running_rental(node, alice)
        await node.disconnect()
        await node.connect(incomplete=True)
        await node.flushed()  # the short inventory handled: a barrier, not a sleep
        for r in (paused, gone):
            assert (await alice.get(r.rental_id)).state == "running"
        await node.disconnect()
        await node.connect()
        now = time.time()
        await node.outgoing.put(
            pb.AgentMessage(
                rental=pb.RentalReport(
                    rental_id=paused.rental_id,
                    state="stopped",
                    exit_code=137,
                    reclaim_id="rcl-local-pause",
                    reclaim_reason="pause",
                    reclaim_at=now - 1,
                )
            )
        )
        ended = await eventually(
            lambda: alice.get(paused.rental_id), ok=lambda r: r.state == "ended"
        )
        assert (ended.ended_by, ended.reclaim_id) == ("provider", "rcl-local-pause")
        assert (await alice.get(gone.rental_id)).state == "running"  # its report may come
        vanished = await eventually(
            lambda: alice.get(gone.rental_id), ok=lambda r: r.state == "ended", timeout=15
        )
        assert vanished.ended_by == "platform" and "gone" in vanished.detail
    finally:
        await node.close()


async def test_a_rental_never_started_is_given_up(tmp_path, pki):
    coordinator = start_coordinator(tmp_path / "c", tls=pki, extra=("--start-timeout-s", "1"))
    node = FakeNode(coordinator, pki, "node-a")
    alice = Renter(coordinator, pki, "alice")
    try:
        await node.connect()
        rental = await alice.rent("node-a")
        await node.next_of("start_rental")  # and never answers
        ended = await eventually(
            lambda: alice.get(rental.rental_id), ok=lambda r: r.state == "ended"
        )
        assert ended.ended_by == "platform" and "never reported started" in ended.detail
        assert (await node.next_of("stop_rental")).stop_rental.rental_id == rental.rental_id
    finally:
        await node.close()
        await alice.channel.close()
        coordinator.proc.stop()


async def test_no_provider_change_and_no_spot_under_render_jobs(coordinator, pki, ops, alice):
    node = FakeNode(coordinator, pki, "node-a", spot=False, provider="acme")
    try:
        await node.connect()
        rental = await running_rental(node, alice)
        await node.disconnect()
        node.provider = "someone-else"
        await node.connect(rentals=[pb.RentalReport(rental_id=rental.rental_id, state="started")])
        [shown] = (await ops.admin.ListNodes(pb.ListNodesRequest())).nodes
        assert shown.provider == "acme"
        assert await ops.events("provider_change_refused")
        await alice.rentals.EndRental(pb.EndRentalRequest(rental_id=rental.rental_id))
        await node.report_rental(rental.rental_id, "stopped", exit_code=0)

        job = await ops.start("node-a", kind="render")
        await node.next_of("start_worker")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ops.admin.SetNodeSpot(pb.SetNodeSpotRequest(node_id="node-a", spot=True))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert job.worker_id in err.value.details() and "render" in err.value.details()
    finally:
        await node.close()


async def test_a_rental_on_a_node_gone_under_a_reclamation_ends_at_node_gone_s(tmp_path, pki):
    """A node gone under a reclamation (a notice, then silence) is not lost: its rental ends
    after --node-gone-s as the reclamation's. (A node gone with no reclamation open is lost:
    test_lost_nodes.py.)"""
    coordinator = start_coordinator(tmp_path / "c", tls=pki, extra=("--node-gone-s", "1"))
    node = FakeNode(coordinator, pki, "node-a")
    alice = Renter(coordinator, pki, "alice")
    try:
        await node.connect()
        rental = await running_rental(node, alice)
        # Real time past --node-gone-s in the real coordinator process (no fake clock there):
        # "not gone" only means something once the threshold has passed, so this is a wait
        # for time, the one thing no event can stand for.
        await asyncio.sleep(1.5)
        assert (await alice.get(rental.rental_id)).state == "running"  # connected: not gone
        await node.pause(reason="notice")
        await node.disconnect()
        ended = await eventually(
            lambda: alice.get(rental.rental_id), ok=lambda r: r.state == "ended"
        )
        assert ended.ended_by == "reclaim" and "gone for" in ended.detail
    finally:
        await node.close()
        await alice.channel.close()
        coordinator.proc.stop()
