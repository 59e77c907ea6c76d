"""Clients with several coordinator addresses (spotdrain.net.leader), against fake replicas: real
gRPC servers on loopback that lead, follow (UNAVAILABLE naming the leader in `spotdrain-leader`)
or are gone. And the router's table, which never goes back to an older version."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from fakes.waiting import eventually
from spotdrain.agent.spotctl import main as spotctl
from spotdrain.coordinator.router.model_routes import ModelRoutes, ModelWatch, Route
from spotdrain.net.leader import LEADER_KEY, Replicas, addresses
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc


def route(worker_id: str) -> Route:
    return Route(worker_id, "node-a", "127.0.0.1:1", 0, 4)


# --- the route table ---------------------------------------------------------------------------


def test_a_snapshot_older_than_the_table_is_held_aside_until_it_is_newer():
    """The router applied version 100 (w2 only). A new leader's snapshot comes at 50: the table
    stays at 100 (w2) while its changes at 60 and 90 are kept with it; its change at 150 makes
    it the table, with every change since its snapshot."""
    table = ModelRoutes("m")
    assert table.apply_snapshot(90, [route("w1")])
    assert table.apply_change(100, [route("w2")], ["w1"])
    assert (table.version, set(table.routes)) == (100, {"w2"})

    assert not table.apply_snapshot(50, [route("w1"), route("w3")])
    assert (table.version, set(table.routes)) == (100, {"w2"})
    assert not table.apply_change(60, [route("w4")], ["w1"])
    assert not table.apply_change(55, [route("w9")], [])  # older than the held snapshot's 60
    assert not table.apply_change(90, [], ["w3"])
    assert (table.version, set(table.routes)) == (100, {"w2"})
    assert table.apply_change(150, [route("w5")], [])
    assert (table.version, set(table.routes)) == (150, {"w4", "w5"})
    assert not table.apply_change(150, [route("w6")], [])
    assert table.apply_change(151, [], ["w4"])
    assert set(table.routes) == {"w5"}


def test_a_newer_or_equal_snapshot_is_taken_at_once_and_drops_one_held_aside():
    table = ModelRoutes("m")
    table.apply_snapshot(100, [route("w1")])
    table.apply_snapshot(40, [route("w2")])
    assert table.apply_snapshot(100, [route("w3")])  # the same version: the whole truth again
    assert (table.version, set(table.routes)) == (100, {"w3"})
    assert not table.apply_change(90, [route("w2")], [])  # nothing held aside now
    assert table.apply_snapshot(200, [])
    assert (table.version, table.routes) == (200, {})


# --- fake replicas -----------------------------------------------------------------------------


class FakeReplica:
    """A coordinator replica on loopback: `leader` None while it leads, else the address it
    names ("" for no leader). Serves ListNodes, StartWorker and WatchEvents (Admin) and
    WatchRoutes (Routes) from what the test puts in."""

    def __init__(self) -> None:
        self.leader: str | None = ""
        self.calls: list[str] = []
        self.routes: list[pb.RouteUpdate] = []  # sent on each WatchRoutes, then held open
        self.events: list[pb.StoredEvent] = []
        self.follow = asyncio.Event()  # set: WatchEvents ends its follow (the replica died)
        self.server = grpc.aio.server()
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        pb_grpc.add_AdminServicer_to_server(_Admin(self), self.server)
        pb_grpc.add_RoutesServicer_to_server(_Routes(self), self.server)

    async def refuse_unless_leading(self, context: grpc.aio.ServicerContext) -> None:
        if self.leader is not None:
            context.set_trailing_metadata(((LEADER_KEY, self.leader),))
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"not the leader: {self.leader!r}")

    async def start(self) -> FakeReplica:
        await self.server.start()
        return self

    async def stop(self) -> None:
        await self.server.stop(grace=None)


class _Admin(pb_grpc.AdminServicer):
    def __init__(self, replica: FakeReplica) -> None:
        self.replica = replica

    async def ListNodes(self, request, context):
        self.replica.calls.append("ListNodes")
        await self.replica.refuse_unless_leading(context)
        return pb.ListNodesReply(nodes=[pb.Node(node_id=f"node-{self.replica.port}")])

    async def StartWorker(self, request, context):
        self.replica.calls.append("StartWorker")
        await self.replica.refuse_unless_leading(context)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")  # lost mid-call

    async def WatchEvents(self, request, context) -> AsyncIterator[pb.StoredEvent]:
        self.replica.calls.append(f"WatchEvents from {request.from_id}")
        for stored in self.replica.events:
            if stored.id > request.from_id:
                yield stored
        await self.replica.follow.wait()
        await context.abort(grpc.StatusCode.UNAVAILABLE, "gone")


class _Routes(pb_grpc.RoutesServicer):
    def __init__(self, replica: FakeReplica) -> None:
        self.replica = replica

    async def WatchRoutes(self, request, context) -> AsyncIterator[pb.RouteUpdate]:
        self.replica.calls.append("WatchRoutes")
        await self.replica.refuse_unless_leading(context)
        sent = 0
        while True:  # the list, then whatever the test appends to it
            while sent < len(self.replica.routes):
                yield self.replica.routes[sent]
                sent += 1
            await asyncio.sleep(0.01)


@pytest.fixture
async def fleet() -> AsyncIterator[Callable[[int], Any]]:
    started: list[FakeReplica] = []

    async def make(n: int) -> list[FakeReplica]:
        for _ in range(n):
            started.append(await FakeReplica().start())
        return started[-n:]

    yield make
    for replica in started:
        await replica.stop()


def insecure(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address)


def down_address() -> str:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


# --- finding the leader ------------------------------------------------------------------------


def test_a_coordinator_list_is_parsed_once_each_and_checked():
    assert addresses("a:1, b:2,a:1") == ("a:1", "b:2")
    from spotdrain.runtime.cli import UsageError  # noqa: PLC0415

    for bad in ("", " , ", "a:1,b", "a:x"):
        with pytest.raises(UsageError):
            addresses(bad)


async def test_a_follower_alone_sends_the_call_to_the_leader_it_names(fleet):
    """Pointed only at a follower: the follower's refusal names the leader, the call goes there
    and is answered, and the leader is remembered for the next call."""
    follower, leader = await fleet(2)
    leader.leader = None
    follower.leader = leader.address
    replicas = Replicas([follower.address], insecure)
    try:
        reply = await replicas.until_leader(
            pb_grpc.AdminStub, "ListNodes", pb.ListNodesRequest(), wait_s=2
        )
        assert [n.node_id for n in reply.nodes] == [f"node-{leader.port}"]
        assert replicas.leader == leader.address
    finally:
        await replicas.close()


async def test_a_call_waits_for_a_new_leader_within_the_window(fleet):
    """The leader is gone and the follower knows of none yet: the call is retried, and
    answered once the follower leads; without replicas in play (one address, no replica's
    refusal) a dead coordinator fails at once, as it always did."""
    (follower,) = await fleet(1)
    dead = down_address()
    replicas = Replicas([dead, follower.address], insecure)
    asyncio.get_running_loop().call_later(0.6, setattr, follower, "leader", None)
    try:
        started = asyncio.get_running_loop().time()
        reply = await replicas.until_leader(
            pb_grpc.AdminStub, "ListNodes", pb.ListNodesRequest(), wait_s=5, timeout=2
        )
        waited = asyncio.get_running_loop().time() - started
        assert reply.nodes[0].node_id == f"node-{follower.port}" and 0.5 < waited < 2
        assert replicas.leader == follower.address
    finally:
        await replicas.close()

    alone = Replicas([dead], insecure)
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await alone.until_leader(
                pb_grpc.AdminStub, "ListNodes", pb.ListNodesRequest(), wait_s=5, timeout=2
            )
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert asyncio.get_running_loop().time() - started < 1.5
    finally:
        await alone.close()


async def test_a_call_that_may_have_run_at_the_leader_is_not_sent_again(fleet):
    """StartWorker reached the leader and its answer was lost: retrying it might start a
    second worker, so spotctl reports the failure instead (a follower's refusal alone would be
    retried)."""
    leader, follower = await fleet(2)
    leader.leader = None
    follower.leader = leader.address
    replicas = Replicas([follower.address, leader.address], insecure)
    try:
        with pytest.raises(grpc.aio.AioRpcError):
            await replicas.until_leader(
                pb_grpc.AdminStub, "StartWorker", pb.StartWorkerRequest(), wait_s=3, once_only=True
            )
        assert leader.calls.count("StartWorker") == 1
    finally:
        await replicas.close()


async def test_spotctl_follow_carries_on_at_another_replica_from_the_last_event(fleet, capsys):
    """`spotctl events --follow` on two replicas: the one it reads from dies after event 2;
    it opens the stream again at the other from id 2, and prints every event once."""
    first, second = await fleet(2)

    def stored(i: int) -> pb.StoredEvent:
        return pb.StoredEvent(id=i, event=pb.Event(uid=f"u{i}", kind="tainted", node_id="n"))

    first.events = [stored(1), stored(2)]
    second.events = [stored(1), stored(2), stored(3)]
    asyncio.get_running_loop().call_later(0.5, first.follow.set)
    asyncio.get_running_loop().call_later(1.0, second.follow.set)
    argv = [
        "--coordinator",
        f"{first.address},{second.address}",
        "--insecure",
        "--leader-wait-s",
        "0.5",
        "events",
        "--follow",
    ]
    rc = await spotctl.run(spotctl.parser().parse_args(argv))
    printed = [json.loads(line)["id"] for line in capsys.readouterr().out.splitlines()]
    assert printed == [1, 2, 3]
    assert rc == 1  # the second one went too, and no replica answered within the wait
    assert second.calls[0] == "WatchEvents from 2"


# --- the router's watch across a change of leader -----------------------------------------------


def snapshot(version: int, *workers: str) -> pb.RouteUpdate:
    return pb.RouteUpdate(
        version=version,
        snapshot=True,
        upsert=[
            pb.Route(worker_id=w, node_id="n", address="127.0.0.1:1", capacity=4) for w in workers
        ],
    )


def change(version: int, upsert: tuple[str, ...] = (), removed: tuple[str, ...] = ()):
    return pb.RouteUpdate(
        version=version,
        removed=list(removed),
        upsert=[
            pb.Route(worker_id=w, node_id="n", address="127.0.0.1:1", capacity=4) for w in upsert
        ],
    )


async def test_the_router_watch_moves_to_the_new_leader_and_never_shows_an_older_table(fleet):
    """The router watches the leader (found through the follower it was given). The leader
    dies; the other replica leads, but its snapshot is at a lower version: the router keeps
    the table it had, version and all, until the new leader's versions pass it."""
    old, new = await fleet(2)
    old.leader, new.leader = None, old.address
    old.routes = [snapshot(100, "w1"), change(101, ("w2",), ("w1",))]
    replicas = Replicas([new.address, old.address], insecure)
    watch = ModelWatch("m", replicas)
    versions: list[int] = []
    seen = asyncio.create_task(_record(watch, versions))
    try:
        await eventually(lambda: watch.table.version == 101, "the old leader's table")
        assert set(watch.table.routes) == {"w2"}

        new.routes = [snapshot(50, "w1", "w3"), change(60, ("w4",))]
        new.leader = None
        await old.stop()
        await eventually(lambda: new.calls.count("WatchRoutes") >= 2, "the watch at the new leader")
        # The watch lost the old leader (its problem said so); live again means the new
        # leader's older snapshot was taken in (kept aside): a barrier, not a sleep.
        await eventually(lambda: watch.problem == "", "the new leader's snapshot taken in")
        assert (watch.table.version, set(watch.table.routes)) == (101, {"w2"})

        new.routes.append(change(200, (), ("w1",)))
        await eventually(lambda: watch.table.version == 200, "the new leader's newer table")
        assert set(watch.table.routes) == {"w3", "w4"}
        assert versions == sorted(versions)  # never went down
    finally:
        seen.cancel()
        watch.task.cancel()
        await asyncio.gather(watch.task, seen, return_exceptions=True)
        await replicas.close()


async def _record(watch: ModelWatch, versions: list[int]) -> None:
    while True:
        if not versions or versions[-1] != watch.table.version:
            versions.append(watch.table.version)
        await asyncio.sleep(0.005)
