"""An advisory (a rebalance recommendation, maintenance, a live migration) prepares without
draining: the coordinator places nothing new on the node (`at_risk`) and starts replacements for
its workers elsewhere while they keep serving. Real coordinator, fake agents (fakenode.py)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from fakes.fakenode import FakeNode, Ops, events, obey_starts
from fakes.harness import start_coordinator
from fakes.waiting import eventually
from spotdrain.v1 import spotdrain_pb2 as pb


def advisory(key: str, ttl_s: float = 600.0, action: str = "prepare") -> dict:
    return {
        "source": "aws",
        "reason": "rebalance",
        "key": key,
        "action": action,
        "expires_at": time.time() + ttl_s,
        "not_before": None,
        "detail": "",
    }


async def fleet_of(coordinator, pki, names):
    nodes = {n: FakeNode(coordinator, pki, n) for n in names}
    started: dict[str, list[str]] = {n: [] for n in nodes}
    obeying = []
    for name, node in nodes.items():
        await node.connect()
        obeying.append(asyncio.create_task(obey_starts(node, started[name])))
    return nodes, started, obeying


async def model_counts(ops: Ops) -> tuple[int, int]:
    [model] = (await ops.admin.ListModels(pb.ListModelsRequest())).models
    return model.ready, model.draining


async def test_a_rebalance_recommendation_replaces_elsewhere_and_drains_nothing(coordinator, pki):
    """m wants 2 replicas, on a and b; c is free. a's agent reports a rebalance
    recommendation: a replacement starts on c, a's worker stays ready (never draining), and
    nothing new may go on a. When the advisory is lifted, the model has one too many: the
    newest (c's) is drained, a's keeps serving."""
    ops = Ops(coordinator)
    nodes, started, obeying = await fleet_of(coordinator, pki, "abc")
    try:
        await ops.admin.SetModelReplicas(
            pb.SetModelReplicasRequest(model="m", replicas=2, image="img", slots=4)
        )
        await eventually(lambda: model_counts(ops), ok=lambda c: c == (2, 0))
        assert [len(started[n]) for n in "abc"] == [1, 1, 0]
        on_a = started["a"][0]

        uid = await nodes["a"].event("advisory_received", advisory("aws:rebalance:1"))
        await eventually(lambda: asyncio.sleep(0, started["c"]), timeout=5)
        await eventually(lambda: model_counts(ops), ok=lambda c: c == (3, 0))
        assert (await ops.workers())[on_a].state == "ready"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await ops.start("a")
        assert "at_risk" in refused.value.details()
        [refusal] = await events(ops, "placement_refused")
        assert refusal["reason"] == "at_risk"

        # The agent resends the same event (its ack was lost): one advisory, one replacement.
        await nodes["a"].event("advisory_received", advisory("aws:rebalance:1"), uid=uid)
        await nodes["a"].event(
            "advisory_lifted",
            {"source": "aws", "reason": "rebalance", "key": "aws:rebalance:1", "why": "ttl"},
        )
        await eventually(lambda: model_counts(ops), ok=lambda c: c == (2, 1))
        workers = await ops.workers()
        assert workers[started["c"][0]].state == "draining"
        assert workers[on_a].state == "ready"
        assert len(started["c"]) == 1
        await ops.start("a")  # a takes work again
    finally:
        for task in obeying:
            task.cancel()
        for node in nodes.values():
            await node.close()
        await ops.channel.close()


async def test_an_advisory_ends_at_its_expiry_and_survives_a_coordinator_restart(tmp_path, pki):
    """The window is the agent's absolute expiry, stored: a coordinator restarted inside it
    still refuses the node; once it has passed, the node takes work without any lift."""
    coordinator = start_coordinator(tmp_path / "c", tls=pki)
    ops = Ops(coordinator)
    node = FakeNode(coordinator, pki, "a")
    try:
        await node.connect()
        await node.event("advisory_received", advisory("gcp:migrate:1", ttl_s=6.0))
        await eventually(lambda: events(ops, "advisory_received"))
        coordinator.proc.stop()
        await node.close()
        await ops.channel.close()
        coordinator = start_coordinator(tmp_path / "c", tls=pki)
        ops = Ops(coordinator)
        node = FakeNode(coordinator, pki, "a")
        await node.connect()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await ops.start("a")
        assert "at_risk" in refused.value.details()

        async def placed():
            try:
                return await ops.start("a")
            except grpc.aio.AioRpcError as e:
                assert "at_risk" in e.details()
                return None

        await eventually(placed, "a placement on a once the advisory lapsed", 15, every=0.2)
    finally:
        await node.close()
        await ops.channel.close()
        coordinator.proc.stop()


async def test_an_advisory_with_a_bad_expiry_or_another_action_changes_nothing(coordinator, pki):
    ops = Ops(coordinator)
    node = FakeNode(coordinator, pki, "a")
    try:
        await node.connect()
        for details in (
            advisory("k1") | {"expires_at": float("inf")},
            advisory("k2") | {"expires_at": "soon"},
            advisory("k3", action="ignore"),
            advisory("k4") | {"key": ""},
            advisory("k5", ttl_s=-10),
        ):
            await node.event("advisory_received", details)
        await eventually(lambda: events(ops, "advisory_received"), ok=lambda e: len(e) == 5)
        await ops.start("a")  # none of them put the node at risk
    finally:
        await node.close()
        await ops.channel.close()
