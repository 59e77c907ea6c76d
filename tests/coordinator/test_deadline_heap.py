"""The coordinator's one heap of deadlines (start timeouts, heartbeat expiries, node-gone):
first the pure heap against a plain model, then the recovery shell over a real store with a
fake clock. Nothing sleeps: each story moves the clock and fires what is due."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spotdrain.coordinator.api.agent_link import Coordinator
from spotdrain.coordinator.core import messages as msg
from spotdrain.coordinator.core import worker_machine as wm
from spotdrain.coordinator.core.deadlines import COMPACT_SLACK, Deadlines
from spotdrain.coordinator.fleet.recovery import EXPIRY, NODE_GONE, NODE_LOST, START
from spotdrain.coordinator.store import open_store

T0 = 1_796_237_800.0
TTL, START_S, GONE_S = 15.0, 300.0, 600.0
FAR_S = 1e6  # a node-lost time the stories about other deadlines never reach

SQLITE = pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)

# --- the pure heap -------------------------------------------------------------------------


def test_a_deadline_fires_once_at_its_time():
    heap: Deadlines[str] = Deadlines()
    heap.set("w1", 10.0)
    assert heap.pop_due(9.99) == []
    assert heap.pop_due(10.0) == ["w1"]
    assert heap.pop_due(1e12) == [] and len(heap) == 0


def test_a_moved_or_cancelled_deadline_never_fires_at_its_old_time():
    heap: Deadlines[str] = Deadlines()
    heap.set("later", 10.0)
    heap.set("later", 20.0)  # a heartbeat: nothing pushed, the old entry waits to surface
    heap.set("earlier", 20.0)
    heap.set("earlier", 5.0)
    heap.set("gone", 7.0)
    heap.cancel("gone")
    # 10 (later, moved), 20 and 5 (earlier), 7 (cancelled): stale ones drop as they surface.
    assert heap.entries() == 4 and len(heap) == 2
    assert heap.pop_due(5.0) == ["earlier"]
    assert heap.pop_due(19.0) == []
    assert heap.next_at() == 20.0
    assert heap.pop_due(20.0) == ["later"]
    assert heap.pop_due(1e12) == []


def test_only_the_due_entries_are_looked_at_among_many():
    heap: Deadlines[str] = Deadlines()
    for i in range(10_000):
        heap.set(f"w{i}", 1000.0 + i)
    for i in range(3):
        heap.set(f"early{i}", 1.0 + i)
    entries = heap.entries()
    for i in range(10_000):  # every worker refreshed later: no entry added
        heap.set(f"w{i}", 2000.0 + i)
    assert heap.entries() == entries
    assert heap.pop_due(999.0) == ["early0", "early1", "early2"]
    assert (heap.surfaced, heap.fired) == (3, 3)


def test_the_heap_stays_bounded_by_its_live_keys():
    heap: Deadlines[int] = Deadlines()
    for round_ in range(50):
        for k in range(200):
            heap.set(k, 1000.0 - round_)  # earlier each round: a push each
        for k in range(100):
            heap.cancel(k)
    assert len(heap) == 100
    assert heap.entries() <= 2 * len(heap) + COMPACT_SLACK


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.integers(0, 5), st.integers(0, 50)),
        st.tuples(st.just("cancel"), st.integers(0, 5), st.just(0)),
        st.tuples(st.just("pop"), st.just(0), st.integers(0, 60)),
    ),
    max_size=80,
)


@given(OPS)
def test_the_heap_agrees_with_a_plain_dictionary(ops):
    """Whatever the order of sets, cancels and pops: a pop returns exactly the keys whose
    current deadline is due, earliest first, and each only once."""
    heap: Deadlines[int] = Deadlines()
    model: dict[int, float] = {}
    for op, key, t in ops:
        if op == "set":
            heap.set(key, float(t))
            model[key] = float(t)
        elif op == "cancel":
            heap.cancel(key)
            model.pop(key, None)
        else:
            due = sorted((at, k) for k, at in model.items() if at <= t)
            got = heap.pop_due(float(t))
            assert sorted(got) == sorted(k for _, k in due)
            assert [model[k] for k in got] == sorted(model[k] for k in got)
            for k in got:
                del model[k]
        assert len(heap) == len(model)
        assert heap.next_at() == (min(model.values()) if model else None)


# --- the shell: coordinator/fleet/recovery.py ----------------------------------------------


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def stored_worker(store, node_id: str, worker_id: str, state: str, created_at: float):
    await store.upsert_node(node_id, True, "group-1", [{"index": i} for i in range(8)])
    worker = wm.Worker(
        worker_id, node_id, "llama", "img:1", 9000, 4, created_at, state=state, gate_address="x:1"
    )
    await store.save_worker(
        worker_id, node_id, worker.model, worker.state, created_at, worker.to_json()
    )


async def started(store, clock, lost_s: float = FAR_S) -> Coordinator:
    coord = Coordinator(
        store,
        insecure=True,
        clock=clock,
        heartbeat_ttl_s=TTL,
        start_timeout_s=START_S,
        node_gone_s=GONE_S,
        node_lost_s=lost_s,
    )
    await coord.fleet.recovery.rebuild()
    return coord


async def kinds(store, kind: str) -> list[dict]:
    return [json.loads(e.details_json) for e in await store.events_after(0) if e.kind == kind]


@SQLITE
async def test_a_start_timeout_fires_once(store_url):
    """A worker placed on node-a whose start command is never answered: nothing before
    created + start timeout, then it is given up once, and later passes find nothing."""
    clock = FakeClock()
    store = await open_store(store_url, clock=clock)
    try:
        await store.upsert_node("node-a", True, "group-1", [{"index": 0}, {"index": 1}])
        coord = await started(store, clock)
        fleet, recovery = coord.fleet, coord.fleet.recovery
        fleet.nodes.connect("node-a", asyncio.Queue())
        placed = await fleet.gate.place_worker("node-a", "llama", "img:1", 4, path="operator")
        worker = placed.worker_id
        assert recovery.deadlines.get((START, worker)) == T0 + START_S
        clock.now = T0 + START_S - 0.001
        assert await recovery.fire_due() == 0
        clock.now = T0 + START_S
        assert await recovery.fire_due() == 1
        assert fleet.registry.get(worker) is None  # stopped: the GPU is free
        clock.now += 10 * START_S
        assert await recovery.fire_due() == 0
        assert [e["worker_id"] for e in await kinds(store, "worker_start_timeout")] == [worker]
        await fleet.close()
    finally:
        await store.close()


@SQLITE
async def test_a_refreshed_heartbeat_moves_the_expiry_and_the_old_entry_never_fires(store_url):
    """After a restart node-a has not reconnected; its ready worker's expiry is a TTL away. A
    heartbeat 10 s in moves it: at the old expiry nothing fires, at the new one the worker is
    missing, once."""
    clock = FakeClock()
    store = await open_store(store_url, clock=clock)
    try:
        await stored_worker(store, "node-a", "w-a", wm.READY, T0 - 60)
        coord = await started(store, clock)
        fleet, recovery = coord.fleet, coord.fleet.recovery
        worker = fleet.registry.get("w-a")
        assert recovery.deadlines.get((EXPIRY, "w-a")) == T0 + TTL
        clock.now = T0 + 10
        await fleet.apply(worker, wm.Heartbeat(clock.now, wm.READY, 1, TTL))
        assert recovery.deadlines.get((EXPIRY, "w-a")) == T0 + 10 + TTL
        clock.now = T0 + TTL + 1
        assert await recovery.fire_due() == 0
        assert worker.state == wm.READY and await kinds(store, "worker_missing") == []
        clock.now = T0 + 10 + TTL
        assert await recovery.fire_due() == 1
        assert worker.state == wm.STOPPED
        clock.now += 100
        assert await recovery.fire_due() == 0
        assert len(await kinds(store, "worker_missing")) == 1
        await fleet.close()
    finally:
        await store.close()


@SQLITE
async def test_a_connected_nodes_heartbeats_arm_no_expiry_and_its_disconnect_does(store_url):
    """A worker is missing when its heartbeats stop and its node's stream is closed: while
    node-a is connected its worker holds no expiry at all; the disconnect arms it."""
    clock = FakeClock()
    store = await open_store(store_url, clock=clock)
    try:
        await stored_worker(store, "node-a", "w-a", wm.READY, T0 - 60)
        coord = await started(store, clock)
        fleet, recovery = coord.fleet, coord.fleet.recovery
        queue: asyncio.Queue = asyncio.Queue()
        fleet.nodes.connect("node-a", queue)
        assert (EXPIRY, "w-a") not in recovery.deadlines
        assert (NODE_GONE, "node-a") not in recovery.deadlines
        worker = fleet.registry.get("w-a")
        await fleet.apply(worker, wm.Heartbeat(clock.now, wm.READY, 1, TTL))
        assert (EXPIRY, "w-a") not in recovery.deadlines
        clock.now = T0 + 5 * TTL  # silent, but connected: not missing
        assert await recovery.fire_due() == 0
        await fleet.reports.disconnected("node-a", queue)
        assert recovery.deadlines.get((EXPIRY, "w-a")) == T0 + TTL  # overdue: next pass
        assert await recovery.fire_due() == 1
        assert worker.state == wm.STOPPED
        await fleet.close()
    finally:
        await store.close()


@SQLITE
async def test_a_node_gone_under_a_reclamation_ends_its_rental_at_node_gone_s(store_url):
    """node-a runs alice's rental, gets a notice and disconnects: one second short of
    node_gone_s the rental runs; at node_gone_s it has ended as the reclamation's (`reclaim`),
    and the node is not lost. A node that came back has no node-gone."""
    clock = FakeClock()
    store = await open_store(store_url, clock=clock)
    try:
        for n in ("node-a", "node-b"):
            await store.upsert_node(n, False, "group-1", [{"index": 0}])
        coord = await started(store, clock)
        fleet, recovery = coord.fleet, coord.fleet.recovery
        queues = {n: asyncio.Queue() for n in ("node-a", "node-b")}
        for n, q in queues.items():
            fleet.nodes.connect(n, q)
        rental = await fleet.rentals.create("node-a", "alice", "img:1", 1)
        await fleet.rentals.report("node-a", msg.RentalReport(rental.rental_id, "started", "c1"))
        await fleet.drains.taint("node-a", "rcl-1", "notice", T0 + 120, T0 + 110)
        clock.now = T0 + 100
        for n, q in queues.items():
            await fleet.reports.disconnected(n, q)
        assert recovery.deadlines.get((NODE_GONE, "node-a")) == T0 + 100 + GONE_S
        fleet.nodes.connect("node-b", asyncio.Queue())  # back: its node-gone is cancelled
        assert (NODE_GONE, "node-b") not in recovery.deadlines
        clock.now = T0 + 100 + GONE_S - 1
        assert await recovery.fire_due() == 0
        assert (await fleet.rentals.get(rental.rental_id)).state == "running"
        clock.now = T0 + 100 + GONE_S
        assert await recovery.fire_due() == 1
        ended = await fleet.rentals.get(rental.rental_id)
        assert ended.state == "ended" and ended.ended_by == "reclaim"
        assert "gone for" in ended.detail
        assert await kinds(store, "node_lost") == []
        await fleet.close()
    finally:
        await store.close()


@SQLITE
async def test_a_restart_rebuilds_the_heap_and_fires_what_fell_due_while_down(store_url):
    """The coordinator was down 400 s: node-a's worker, placed before, never started and its
    start timeout passed meanwhile; node-b's ready worker gets a full TTL from the restart.
    The first pass after the rebuild gives up node-a's worker, and only it."""
    clock = FakeClock()
    store = await open_store(store_url, clock=clock)
    try:
        await stored_worker(store, "node-a", "w-a", wm.STARTING, T0 - 400)
        await stored_worker(store, "node-b", "w-b", wm.READY, T0 - 400)
        coord = await started(store, clock)
        recovery = coord.fleet.recovery
        assert recovery.deadlines.get((START, "w-a")) == T0 - 400 + START_S
        assert recovery.deadlines.get((EXPIRY, "w-b")) == T0 + TTL
        assert recovery.deadlines.get((NODE_GONE, "node-b")) == T0 + GONE_S
        assert await recovery.fire_due() == 1
        assert [e["worker_id"] for e in await kinds(store, "worker_start_timeout")] == ["w-a"]
        assert coord.fleet.registry.get("w-b").state == wm.READY
        await coord.fleet.close()
    finally:
        await store.close()


@SQLITE
async def test_among_many_workers_only_the_due_ones_are_touched(store_url):
    """2,000 workers starting on 250 connected nodes, five of them placed 400 s before the
    restart: the pass fires those five, and the heap looked at five entries, not 2,000."""
    clock = FakeClock()
    store = await open_store(store_url, clock=clock)
    try:
        for i in range(2000):
            created = T0 - 400 if i % 400 == 0 else T0
            await stored_worker(store, f"node-{i // 8}", f"w-{i}", wm.STARTING, created)
        coord = await started(store, clock)
        fleet, recovery = coord.fleet, coord.fleet.recovery
        for i in range(250):
            fleet.nodes.connect(f"node-{i}", asyncio.Queue())
        assert len(recovery.deadlines) == 2000  # the start timeouts; node-gone cancelled
        surfaced, fired = recovery.deadlines.surfaced, recovery.deadlines.fired
        assert await recovery.fire_due() == 5
        assert recovery.deadlines.surfaced - surfaced == 5
        assert recovery.deadlines.fired - fired == 5
        assert await recovery.fire_due() == 0
        await recovery.recover()  # the periodic pass looks at no worker either
        assert recovery.deadlines.surfaced - surfaced == 5
        await fleet.close()
    finally:
        await store.close()


@SQLITE
async def test_a_node_lost_at_node_lost_s_names_what_the_ttl_took_and_returns_after_a_restart(
    store_url,
):
    """node-a's stream closes at T0+100 with a ready worker: the TTL takes the worker out at
    +15 s; one second short of node_lost_s nothing more, at node_lost_s the node is lost once,
    naming that worker. A coordinator restarted since knows it is lost (from the store), and
    node-a registering again is `node_returned`, in the same record."""
    lost_s = 60.0
    clock = FakeClock()
    store = await open_store(store_url, clock=clock)
    try:
        await stored_worker(store, "node-a", "w-a", wm.READY, T0 - 60)
        coord = await started(store, clock, lost_s)
        fleet, recovery = coord.fleet, coord.fleet.recovery
        queue: asyncio.Queue = asyncio.Queue()
        await fleet.reports.register(
            msg.Registration(
                "node-a",
                True,
                "group-1",
                "",
                tuple({"index": i} for i in range(8)),
                (msg.WorkerReport("w-a", "started", "x:1", 4),),
            ),
            queue,
        )
        clock.now = T0 + 100
        await fleet.reports.disconnected("node-a", queue)
        assert recovery.deadlines.get((NODE_LOST, "node-a")) == T0 + 100 + lost_s
        clock.now = T0 + 100 + TTL
        assert await recovery.fire_due() == 1  # the worker's expiry
        assert len(await kinds(store, "worker_missing")) == 1
        clock.now = T0 + 100 + lost_s - 1
        assert await recovery.fire_due() == 0
        clock.now = T0 + 100 + lost_s
        assert await recovery.fire_due() == 1
        [lost] = await kinds(store, "node_lost")
        assert [w["worker_id"] for w in lost["workers"]] == ["w-a"]
        assert lost["since"] == T0 + 100 and lost["rentals"] == []
        clock.now += GONE_S
        assert await recovery.fire_due() == 1  # node-gone: nothing of it left to end
        assert len(await kinds(store, "node_lost")) == 1
        await fleet.close()

        clock.now += 1000  # a restarted coordinator: still lost, never twice
        again = await started(store, clock, lost_s)
        assert set(again.fleet.lost.lost) == {"node-a"}
        clock.now += lost_s
        await again.fleet.recovery.fire_due()
        assert len(await kinds(store, "node_lost")) == 1
        await again.fleet.reports.register(
            msg.Registration(
                "node-a",
                True,
                "group-1",
                "",
                tuple({"index": i} for i in range(8)),
                (msg.WorkerReport("w-a", "started", "x:1", 4),),
            ),
            asyncio.Queue(),
        )
        [back] = [e for e in await store.events_after(0) if e.kind == "node_returned"]
        assert back.reclaim_id.startswith("lost-node-a-")
        assert json.loads(back.details_json)["stale_workers"] == ["w-a"]
        assert again.fleet.lost.lost == {}
        await again.fleet.close()
    finally:
        await store.close()
