"""The recovery pass after a coordinator restart, over a real store with a fake clock: each
node's odd record is that node's problem, never the fleet's."""

from __future__ import annotations

import json
import sqlite3

import pytest

from spotdrain.coordinator.api.agent_link import Coordinator
from spotdrain.coordinator.core import worker_machine as wm
from spotdrain.coordinator.store import open_store

T0 = 1_796_237_800.0
# The fuzz run's record: a drain stored with its grace deadline 2.6 µs after its D.
D = 1796237897.9496896
G_AFTER_D = 1796237897.9496922


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def a_ready_worker(store, node_id: str, worker_id: str = "") -> str:
    """A node with a ready worker, as a coordinator before the restart left it."""
    await store.upsert_node(node_id, True, "group-1", [{"index": 0}])
    worker = wm.Worker(
        worker_id or f"w-{node_id}",
        node_id,
        "llama",
        "img:1",
        9000,
        4,
        T0 - 60,
        state=wm.READY,
        gate_address="127.0.0.1:9000",
    )
    await store.save_worker(
        worker.worker_id, node_id, worker.model, worker.state, worker.created_at, worker.to_json()
    )
    return worker.worker_id


async def started(store, clock) -> Coordinator:
    coord = Coordinator(store, insecure=True, clock=clock)
    await coord.fleet.recovery.rebuild()
    return coord


async def recovery_failures(store) -> list[tuple[str, dict]]:
    return [
        (e.node_id, json.loads(e.details_json))
        for e in await store.events_after(0)
        if e.kind == "recovery_failed"
    ]


async def test_a_drain_whose_grace_deadline_is_after_its_deadline_still_drains(store_url):
    """A fuzzed Taint left node-a a drain whose G is 2.6 µs after its D, and node-b drains
    after it in the pass. The coordinator restarts: both nodes' workers drain, node-a's by D
    (G clamped to it), and no node is reported failed."""
    clock = FakeClock()
    store = await open_store(store_url, clock=clock)
    try:
        wa = await a_ready_worker(store, "node-a")
        wb = await a_ready_worker(store, "node-b")
        await store.start_drain("node-a", "rcl-a", "notice", D, G_AFTER_D)
        await store.start_drain("node-b", "rcl-b", "notice", D + 30, D + 20)
        coord = await started(store, clock)
        await coord.fleet.recovery.recover()
        a, b = coord.fleet.registry.get(wa), coord.fleet.registry.get(wb)
        assert (a.state, a.grace_deadline, a.terminate_at) == (wm.DRAINING, D, D)
        assert (b.state, b.grace_deadline, b.terminate_at) == (wm.DRAINING, D + 20, D + 30)
        assert await recovery_failures(store) == []
        await coord.fleet.close()
    finally:
        await store.close()


async def test_a_taint_with_its_grace_deadline_after_d_is_stored_clamped(store_url):
    """An agent (or a fuzzer) sends a Taint whose G is after its D: the drain is stored and
    applied with G = D, so no record that breaks G <= D is ever written."""
    clock = FakeClock()
    store = await open_store(store_url, clock=clock)
    try:
        wa = await a_ready_worker(store, "node-a")
        coord = await started(store, clock)
        await coord.fleet.drains.taint("node-a", "rcl-a", "notice", D, G_AFTER_D)
        stored = await store.drain("node-a", "rcl-a")
        assert (stored.grace_deadline, stored.terminate_at) == (D, D)
        worker = coord.fleet.registry.get(wa)
        assert (worker.state, worker.grace_deadline) == (wm.DRAINING, D)
        await coord.fleet.close()
    finally:
        await store.close()


async def test_a_retried_taint_over_a_record_stored_with_g_after_d_drains_by_d(store_url):
    """A record stored before the rule (G 2.6 µs after D) and the agent's retry of that Taint
    after the coordinator restarted: the retry keeps the stored deadlines, with G = D, and
    the node's worker drains instead of the Taint failing."""
    clock = FakeClock()
    store = await open_store(store_url, clock=clock)
    try:
        wa = await a_ready_worker(store, "node-a")
        await store.start_drain("node-a", "rcl-a", "notice", D, G_AFTER_D)
        coord = await started(store, clock)
        await coord.fleet.drains.taint("node-a", "rcl-a", "notice", D, G_AFTER_D)
        worker = coord.fleet.registry.get(wa)
        assert (worker.state, worker.grace_deadline, worker.terminate_at) == (wm.DRAINING, D, D)
        await coord.fleet.close()
    finally:
        await store.close()


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
async def test_a_node_whose_recovery_fails_is_reported_once_and_the_others_recover(store_url):
    """Three nodes draining when the coordinator restarts; node-b has two workers, and the
    store refuses every write of node-b's records (a trigger: what a node's bad record does to
    the code that handles it). node-a and node-c are drained in the same pass, node-b is
    recorded `recovery_failed` once: not again when its second worker fails the next pass."""
    clock = FakeClock()
    store = await open_store(store_url, clock=clock)
    try:
        workers = {n: await a_ready_worker(store, n) for n in ("node-a", "node-b", "node-c")}
        await a_ready_worker(store, "node-b", "w-node-b-2")
        for n in workers:
            await store.start_drain(n, f"rcl-{n}", "notice", D + 30, D + 20)
        db = sqlite3.connect(store_url)
        db.execute(
            "CREATE TRIGGER refuse_node_b BEFORE UPDATE ON workers WHEN NEW.node_id = 'node-b' "
            "BEGIN SELECT RAISE(ABORT, 'node-b record refused'); END"
        )
        db.commit()
        db.close()
        coord = await started(store, clock)
        recovery = coord.fleet.recovery
        await recovery.recover()
        for n in ("node-a", "node-c"):
            assert coord.fleet.registry.get(workers[n]).state == wm.DRAINING
        ready_b = [w for w in coord.fleet.live_workers("node-b") if w.state == wm.READY]
        assert len(ready_b) == 1  # the pass left node-b at its first failure
        await recovery.recover()  # node-b's other worker fails: the same failure, not news
        failures = await recovery_failures(store)
        assert [n for n, _ in failures] == ["node-b"]
        assert "node-b record refused" in failures[0][1]["error"]
        await coord.fleet.close()
    finally:
        await store.close()
