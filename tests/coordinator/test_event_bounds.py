"""What one node can send the coordinator, and what it cannot: every message bounded, refused
whole with a clear status when it is not, and nothing of a refused batch stored. A real
coordinator process, a fake agent's stream over real gRPC with mutual TLS."""

from __future__ import annotations

import json
import uuid

import grpc
import pytest

from fakes.fakenode import FakeNode, Ops
from spotdrain.protocol import limits
from spotdrain.v1 import spotdrain_pb2 as pb


def event(node_id: str, details: str = "{}", **fields) -> pb.Event:
    return pb.Event(
        uid=fields.pop("uid", str(uuid.uuid4())),
        kind=fields.pop("kind", "tainted"),
        node_id=node_id,
        wall_time=fields.pop("wall_time", 1.0),
        details_json=details,
        **fields,
    )


async def send(node: FakeNode, events: list[pb.Event]) -> pb.CoordinatorMessage:
    await node.outgoing.put(pb.AgentMessage(events=pb.EventBatch(events=events)))
    return await node.command()


async def refused(node: FakeNode, events: list[pb.Event]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await send(node, events)
    return err.value


async def stored_uids(ops: Ops) -> set[str]:
    out = set()
    async for stored in ops.admin.WatchEvents(pb.WatchEventsRequest(from_id=0)):
        out.add(stored.event.uid)
    return out


async def test_a_batch_at_the_bounds_is_stored_and_acknowledged(coordinator, pki):
    node = FakeNode(coordinator, pki, "node-a")
    ops = Ops(coordinator)
    try:
        await node.connect()
        batch = [event("node-a") for _ in range(limits.MAX_BATCH_EVENTS)]
        reply = await send(node, batch)
        assert reply.WhichOneof("body") == "ack"
        assert list(reply.ack.uids) == [e.uid for e in batch]
        assert {e.uid for e in batch} <= await stored_uids(ops)
    finally:
        await node.close()
        await ops.channel.close()


@pytest.mark.parametrize("what", ["too_many_events", "too_many_bytes", "details_too_large"])
async def test_a_batch_above_a_bound_is_refused_whole(coordinator, pki, what):
    """One event too many, a batch too big, one event's details too big: RESOURCE_EXHAUSTED
    with the bound named, and none of the batch stored (the agent splits and resends)."""
    node = FakeNode(coordinator, pki, "node-a")
    ops = Ops(coordinator)
    try:
        await node.connect()
        if what == "too_many_events":
            batch = [event("node-a") for _ in range(limits.MAX_BATCH_EVENTS + 1)]
            says = f"at most {limits.MAX_BATCH_EVENTS}"
        elif what == "too_many_bytes":
            pad = json.dumps({"pad": "x" * (limits.MAX_DETAILS_BYTES - 100)})
            batch = [
                event("node-a", pad)
                for _ in range(limits.MAX_BATCH_BYTES // limits.MAX_DETAILS_BYTES + 2)
            ]
            says = f"at most {limits.MAX_BATCH_BYTES}"
        else:
            batch = [
                event("node-a"),
                event("node-a", json.dumps({"pad": "x" * limits.MAX_DETAILS_BYTES})),
            ]
            says = f"at most {limits.MAX_DETAILS_BYTES}"
        error = await refused(node, batch)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert says in error.details()
        assert not {e.uid for e in batch} & await stored_uids(ops)
    finally:
        await node.close()
        await ops.channel.close()


@pytest.mark.parametrize(
    "details, fields",
    [
        ("[" * 30_000 + "]" * 30_000, {}),  # nested far deeper than the decoder recurses
        ('{"n": ' + "9" * 5000 + "}", {}),  # an integer too long to convert
        ("[1, 2]", {}),  # not an object
        ("not json", {}),
        ("{}", {"wall_time": float("nan")}),
        ("{}", {"t_offset_s": float("inf")}),
        ("{}", {"uid": ""}),
    ],
    ids=["deep", "huge-int", "array", "garbage", "nan-time", "inf-offset", "no-uid"],
)
async def test_a_malformed_event_is_refused_and_changes_nothing(coordinator, pki, details, fields):
    """The stream ends INVALID_ARGUMENT (never UNKNOWN with a traceback), nothing of the batch
    is stored, and the coordinator goes on serving the same node."""
    node = FakeNode(coordinator, pki, "node-a")
    ops = Ops(coordinator)
    try:
        await node.connect()
        good, bad = event("node-a"), event("node-a", details, **fields)
        error = await refused(node, [good, bad])
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert good.uid not in await stored_uids(ops)
        await node.connect()
        assert (await send(node, [good])).WhichOneof("body") == "ack"
        assert "Traceback" not in coordinator.proc.log()
    finally:
        await node.close()
        await ops.channel.close()


async def test_an_event_naming_another_node_is_refused(coordinator, pki):
    """Node A's stream carries an event that says it is node B's: PERMISSION_DENIED, recorded,
    nothing stored."""
    node = FakeNode(coordinator, pki, "node-a")
    ops = Ops(coordinator)
    try:
        await node.connect()
        forged = event("node-b", kind="drained", reclaim_id="rcl-b")
        error = await refused(node, [forged])
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert forged.uid not in await stored_uids(ops)
        [attempt] = await ops.events("identity_refused")
        assert json.loads(attempt.event.details_json)["claimed_node"] == "node-b"
    finally:
        await node.close()
        await ops.channel.close()


async def test_a_node_cannot_rewrite_another_nodes_reclamation(coordinator, pki):
    """Node A sends events under its own id but with node B's reclaim id: B's record keeps
    B's deadlines and outcome (a node touches only its own records)."""
    a, b = FakeNode(coordinator, pki, "node-a"), FakeNode(coordinator, pki, "node-b")
    ops = Ops(coordinator)
    try:
        await a.connect()
        await b.connect()
        notice = {
            "t0": 100.0,
            "terminate_at": 220.0,
            "grace_deadline": 210.0,
            "overrun_at": 218.0,
            "reason": "notice",
        }
        await send(
            b,
            [
                event(
                    "node-b",
                    json.dumps(notice),
                    kind="notice_received",
                    reclaim_id="rcl-b",
                    wall_time=100.0,
                )
            ],
        )
        forged = {**notice, "t0": 1.0, "terminate_at": 2.0}
        await send(
            a,
            [
                event(
                    "node-a",
                    json.dumps(forged),
                    kind="notice_received",
                    reclaim_id="rcl-b",
                    wall_time=101.0,
                ),
                event(
                    "node-a",
                    json.dumps({"spare_s": 99.0}),
                    kind="drained",
                    reclaim_id="rcl-b",
                    wall_time=102.0,
                ),
            ],
        )
        timeline = await ops.admin.GetTimeline(pb.GetTimelineRequest(reclaim_id="rcl-b"))
        rec = timeline.reclamation
        assert (rec.node_id, rec.t0, rec.terminate_at, rec.outcome) == ("node-b", 100.0, 220.0, "")
    finally:
        for n in (a, b):
            await n.close()
        await ops.channel.close()


def test_details_never_pass_for_the_stored_fields():
    """An event whose details claim another kind, node, id and uid is printed as what was
    stored; the claims are kept beside it, named as details."""
    from spotdrain.protocol.events import stored_event_to_dict

    stored = pb.StoredEvent(
        id=7,
        event=pb.Event(
            uid="u-1",
            kind="tainted",
            node_id="node-a",
            wall_time=1.0,
            details_json=json.dumps(
                {"kind": "drained", "node": "node-b", "id": -5, "uid": "x", "mode": "remote"}
            ),
        ),
    )
    out = stored_event_to_dict(stored)
    assert (out["kind"], out["node"], out["id"], out["uid"]) == ("tainted", "node-a", 7, "u-1")
    assert out["mode"] == "remote"
    assert (out["detail.kind"], out["detail.node"], out["detail.id"]) == ("drained", "node-b", -5)
