"""Capacity when a node goes: replacements started elsewhere in parallel with the drain, desired
capacity per model kept through the gate, and on a hard notice an acquirer asked for another node
group while the reclaimed group is avoided. Real coordinator, fake agents (fakenode.py)."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from fakes.fakenode import FakeNode, Ops, events, obey_starts
from fakes.harness import start_coordinator
from fakes.waiting import eventually
from spotdrain.v1 import spotdrain_pb2 as pb

ACQUIRE = """
import json, sys, time
request = json.load(sys.stdin)
with open(sys.argv[1], "w") as f:
    json.dump({"at": time.time(), "request": request}, f)
mode = sys.argv[2]
if mode == "hang":
    time.sleep(60)
if mode == "fail":
    print("no capacity left in this region", file=sys.stderr)
    sys.exit(3)
print(json.dumps({"instances": ["i-new"]}))
"""


def acquirers_file(tmp_path: Path, mode: str, timeout_s: float = 5) -> tuple[Path, Path]:
    script = tmp_path / "acquire.py"
    script.write_text(ACQUIRE)
    out = tmp_path / "acquired.json"
    config = tmp_path / "acquirers.toml"
    # group-a first: the reclaimed group itself is never asked, however it is ordered.
    config.write_text(
        "avoid_s = 300\n"
        "[groups.group-a]\n"
        f'exec = ["{sys.executable}", "{script}", "{tmp_path / "wrong.json"}", "ok"]\n'
        "[groups.group-b]\n"
        f'exec = ["{sys.executable}", "{script}", "{out}", "{mode}"]\n'
        f"timeout_s = {timeout_s}\n"
    )
    return config, out


async def test_a_hard_notice_asks_another_group_and_avoids_its_own(tmp_path, pki):
    config, out = acquirers_file(tmp_path, "ok")
    coordinator = start_coordinator(tmp_path / "c", tls=pki, extra=("--acquirers", str(config)))
    ops = Ops(coordinator)
    a1 = FakeNode(coordinator, pki, "a1", group="group-a")
    a2 = FakeNode(coordinator, pki, "a2", group="group-a")
    b1 = FakeNode(coordinator, pki, "b1", group="group-b")
    try:
        for n in (a1, a2, b1):
            await n.connect()
        worker = await ops.start("a1")
        await a1.start_next()
        await ops.wait_state(worker.worker_id, "ready")

        taint = await a1.pause("notice")
        noticed = time.time()
        # Its whole request: the acquirer creates the file before it writes it.
        written = await eventually(lambda: out.exists() and out.read_text(), "the request", 5)
        called = json.loads(written)
        assert called["at"] - noticed < 1.0  # asked within a second of the notice
        request = called["request"]
        assert (request["reclaimed_node"], request["reclaimed_group"]) == ("a1", "group-a")
        assert (request["target_group"], request["models"]) == ("group-b", ["m"])
        assert request["deadline"] == taint.terminate_at
        assert not (tmp_path / "wrong.json").exists()
        # Before the node's worker has even stopped: nothing waited for the drain.
        assert (await ops.workers())[worker.worker_id].state == "draining"

        [asked] = await events(ops, "replacement_requested")
        assert asked["reclaim_id"] == taint.reclaim_id and asked["target_group"] == "group-b"
        [result] = await eventually(lambda: events(ops, "replacement_result"))
        assert result["ok"] is True and result["response"] == {"instances": ["i-new"]}
        timeline = await ops.admin.GetTimeline(pb.GetTimelineRequest(reclaim_id=taint.reclaim_id))
        assert "replacement_requested" in timeline.reclamation.steps

        # group-a is avoided: no new placement on a2, while b1 takes one.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ops.start("a2")
        assert "group_avoided" in err.value.details()
        assert (await ops.start("b1")).node_id == "b1"
        nodes = {n.node_id: n for n in (await ops.admin.ListNodes(pb.ListNodesRequest())).nodes}
        assert nodes["a2"].group_avoided_until == pytest.approx(noticed + 300, abs=5)
        assert nodes["b1"].group_avoided_until == 0
        # A retried Taint of the same notice asks nothing twice. The barrier: a later notice on
        # b1, whose answer (no group left to ask: group-a is avoided) is recorded after anything
        # the retry would have asked.
        await a1.stub.Taint(taint)
        await b1.pause("notice")
        await eventually(lambda: events(ops, "replacement_unavailable"), "b1's answer")
        assert len(await events(ops, "replacement_requested")) == 1
    finally:
        for n in (a1, a2, b1):
            await n.close()
        await ops.channel.close()
        coordinator.proc.stop()


@pytest.mark.parametrize("mode, detail", [("hang", "timed out"), ("fail", "exit")])
async def test_an_acquirer_that_hangs_or_fails_is_recorded_and_delays_nothing(
    tmp_path, pki, mode, detail
):
    config, out = acquirers_file(tmp_path, mode, timeout_s=1.5)
    coordinator = start_coordinator(tmp_path / "c", tls=pki, extra=("--acquirers", str(config)))
    ops = Ops(coordinator)
    a1 = FakeNode(coordinator, pki, "a1", group="group-a")
    try:
        await a1.connect()
        worker = await ops.start("a1")
        await a1.start_next()
        await ops.wait_state(worker.worker_id, "ready")
        await a1.pause("notice")
        # The Taint has answered and the drain command is out before the acquirer has.
        drain = await a1.next_of("drain_worker", timeout=2)
        assert drain.drain_worker.worker_id == worker.worker_id
        assert not await events(ops, "replacement_result")
        [result] = await eventually(lambda: events(ops, "replacement_result"), timeout=10)
        assert result["ok"] is False and detail in result["detail"]
        assert out.exists()  # it was asked
    finally:
        await a1.close()
        await ops.channel.close()
        coordinator.proc.stop()


async def test_one_group_only_is_not_avoided_and_the_replacement_goes_beside(coordinator, pki):
    """Every node in one group, no acquirer: avoiding the group would stop every placement,
    the notice's own replacement included. The lack of an acquirer is recorded, not raised."""
    ops = Ops(coordinator)
    a1 = FakeNode(coordinator, pki, "a1", group="group-a")
    a2 = FakeNode(coordinator, pki, "a2", group="group-a")
    try:
        await a1.connect()
        await a2.connect()
        await ops.admin.SetModelReplicas(
            pb.SetModelReplicasRequest(model="m", replicas=1, image="img", slots=4)
        )
        await a1.start_next()
        await a1.pause("notice")
        [unavailable] = await eventually(lambda: events(ops, "replacement_unavailable"))
        assert unavailable["reclaimed_group"] == "group-a"
        assert unavailable["avoided_until"] is None
        assert (await a2.next_of("start_worker")).start_worker.model == "m"
        nodes = (await ops.admin.ListNodes(pb.ListNodesRequest())).nodes
        assert [n.group_avoided_until for n in nodes] == [0, 0]
    finally:
        await a1.close()
        await a2.close()
        await ops.channel.close()


async def test_a_paused_nodes_workers_are_replaced_while_it_drains(coordinator, pki):
    """Two workers of a model on a and b, c free. The owner pauses a: the replacement starts on
    c while a's worker is still draining, and the model never has fewer than one ready worker
    (a watcher polls the coordinator's own count all along)."""
    ops = Ops(coordinator)
    nodes = {n: FakeNode(coordinator, pki, n) for n in ("a", "b", "c")}
    started: dict[str, list[str]] = {n: [] for n in nodes}
    obeying = []
    lowest = [99]

    async def watch_ready() -> None:
        while True:
            [model] = (await ops.admin.ListModels(pb.ListModelsRequest())).models
            lowest[0] = min(lowest[0], model.ready)
            await asyncio.sleep(0.01)

    try:
        for name, node in nodes.items():
            await node.connect()
            obeying.append(asyncio.create_task(obey_starts(node, started[name])))
        await ops.admin.SetModelReplicas(
            pb.SetModelReplicasRequest(model="m", replicas=2, image="img", slots=4)
        )
        await eventually(
            lambda: ops.admin.ListModels(pb.ListModelsRequest()),
            ok=lambda r: r.models[0].ready == 2,
        )
        assert [len(started[n]) for n in "abc"] == [1, 1, 0]  # least loaded first
        watcher = asyncio.create_task(watch_ready())
        await asyncio.sleep(0.1)

        await nodes["a"].pause("pause")
        await eventually(lambda: asyncio.sleep(0, started["c"]), timeout=5)
        paused_worker = started["a"][0]
        assert (await ops.workers())[paused_worker].state == "draining"  # still draining
        await eventually(
            lambda: ops.admin.ListModels(pb.ListModelsRequest()),
            ok=lambda r: (r.models[0].ready, r.models[0].draining) == (2, 1),
        )
        # a's worker finishes its requests and stops.
        await nodes["a"].outgoing.put(
            pb.AgentMessage(
                worker=pb.WorkerReport(worker_id=paused_worker, state="stopped", exit_code=0)
            )
        )
        await ops.wait_state(paused_worker, "stopped")
        watcher.cancel()
        assert lowest[0] >= 1

        # The owner resumes: the model has its two already, so nothing more is placed. The
        # resume places before it answers, so the coordinator's own list is the barrier.
        def on_a(workers: dict[str, pb.WorkerInfo]) -> list[str]:
            return [w.worker_id for w in workers.values() if w.node_id == "a"]

        await nodes["a"].resume()
        assert on_a(await ops.workers()) == [paused_worker]
        # Fewer wanted: one is drained, the newest first.
        await ops.admin.SetModelReplicas(pb.SetModelReplicasRequest(model="m", replicas=1))
        # Its capacity pass ran after any pass asked for before (passes are serialised).
        assert on_a(await ops.workers()) == [paused_worker] and len(started["a"]) == 1
        [model] = (await ops.admin.ListModels(pb.ListModelsRequest())).models
        assert (model.ready, model.draining, model.image) == (1, 1, "img")
        assert (await ops.workers())[started["c"][0]].state == "draining"
    finally:
        for task in obeying:
            task.cancel()
        for node in nodes.values():
            await node.close()
        await ops.channel.close()


async def test_desired_capacity_needs_an_image_and_a_known_node(coordinator, pki):
    ops = Ops(coordinator)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ops.admin.SetModelReplicas(pb.SetModelReplicasRequest(model="m", replicas=1))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert not (await ops.admin.ListModels(pb.ListModelsRequest())).models
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ops.admin.GetReputation(pb.GetReputationRequest(node_id="nope"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await ops.channel.close()


async def test_a_model_whose_workers_fail_to_start_is_retried_with_backoff(coordinator, pki):
    """A wrong image: each start fails at once. The next try waits 5 s, then 10 s: a broken
    setting does not place a new worker every recovery pass."""
    ops = Ops(coordinator)
    node = FakeNode(coordinator, pki, "a")
    try:
        await node.connect()
        await ops.admin.SetModelReplicas(
            pb.SetModelReplicasRequest(model="m", replicas=1, image="no-such-image", slots=4)
        )
        first = await node.next_of("start_worker")
        failed_at = time.monotonic()
        await node.outgoing.put(
            pb.AgentMessage(
                worker=pb.WorkerReport(
                    worker_id=first.start_worker.worker_id,
                    state="stopped",
                    exit_code=-1,
                    reason="image not found",
                )
            )
        )
        [failed] = await eventually(lambda: events(ops, "capacity_start_failed"))
        assert (failed["failures"], failed["retry_in_s"]) == (1, 5.0)
        second = await node.next_of("start_worker", timeout=15)
        assert time.monotonic() - failed_at >= 4.5  # not before the backoff ran out
        assert second.start_worker.worker_id != first.start_worker.worker_id
        # This one starts: the backoff is forgotten.
        await node.outgoing.put(
            pb.AgentMessage(
                worker=pb.WorkerReport(
                    worker_id=second.start_worker.worker_id,
                    state="started",
                    gate_address="127.0.0.1:20001",
                    capacity=4,
                )
            )
        )
        await eventually(
            lambda: ops.admin.ListModels(pb.ListModelsRequest()),
            ok=lambda r: r.models[0].ready == 1,
        )
    finally:
        await node.close()
        await ops.channel.close()


async def test_a_coordinator_that_died_before_asking_asks_when_it_is_back(tmp_path, pki):
    """The store as a crash left it: a hard notice's drain stored, no replacement request
    recorded. The restarted coordinator asks once; a second restart does not ask again."""
    from spotdrain.coordinator.store import open_store

    config, out = acquirers_file(tmp_path, "ok")
    db = tmp_path / "c" / "coordinator.sqlite"
    db.parent.mkdir(parents=True)
    store = await open_store(str(db))
    await store.upsert_node("a1", True, "group-a", [{"index": 0}])
    await store.upsert_node("b1", True, "group-b", [{"index": 0}])
    now = time.time()
    await store.start_drain("a1", "rcl-crashed", "notice", now + 60, now + 50)
    await store.close()
    for attempt in range(2):
        coordinator = start_coordinator(
            tmp_path / "c",
            tls=pki,
            db=db,
            extra=("--acquirers", str(config), "--metrics-listen", "127.0.0.1:0"),
        )
        ops = Ops(coordinator)
        try:
            [asked] = await eventually(lambda ops=ops: events(ops, "replacement_requested"))
            assert (asked["reclaim_id"], asked["target_group"]) == ("rcl-crashed", "group-b")
            await eventually(lambda ops=ops: events(ops, "replacement_result"))
            if attempt == 0:
                assert json.loads(out.read_text())["request"]["reclaimed_node"] == "a1"
                out.unlink()
            else:
                # A whole recovery pass has run (the one that asked, the first time): it did
                # not ask again.
                await eventually(lambda c=coordinator: recovery_passes(c) >= 1)
                assert not out.exists()  # asked once, not again
        finally:
            await ops.channel.close()
            coordinator.proc.stop()


def recovery_passes(coordinator) -> float:
    """spotdrain_recovery_passes from the coordinator's /metrics (0 until it serves them)."""
    found = re.findall(r"metrics on (\S+)", coordinator.proc.log())
    if not found:
        return 0.0
    # The last address: a restarted coordinator's log follows its predecessor's.
    text = urllib.request.urlopen(f"http://{found[-1]}/metrics", timeout=5).read().decode()
    passes = re.search(r"^spotdrain_recovery_passes (\S+)$", text, re.M)
    return float(passes.group(1)) if passes else 0.0
