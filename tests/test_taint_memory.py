"""A Taint answered from memory: the coordinator knows every drain in progress and every drain
lifted lately, so a first notice's Taint asks the store nothing before it writes, and a Taint
retried after its reclamation was lifted (a cancelled notice, a resumed pause) is still
recognised as late, after a restart too. Only a retry whose deadline is long past, or a node
that lifted more than memory keeps, reads the store, and gets the same answer.

Runs on both backends (the `store_url` fixture)."""

from __future__ import annotations

import pytest

from spotdrain.coordinator.drains import LIFTED_KEEP_S, LIFTED_PER_NODE
from spotdrain.coordinator.service import Coordinator
from spotdrain.coordinator.store import open_store


class FakeClock:
    def __init__(self, now: float = 10_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def store(store_url, clock):
    s = await open_store(store_url, clock=clock)
    yield s
    await s.close()


def counted_reads(store) -> list[tuple[str, str]]:
    """Every `store.drain` lookup the coordinator makes from now on."""
    reads: list[tuple[str, str]] = []
    real = store.drain

    async def drain(node_id, reclaim_id):
        reads.append((node_id, reclaim_id))
        return await real(node_id, reclaim_id)

    store.drain = drain
    return reads


async def started(store, clock) -> Coordinator:
    coord = Coordinator(store, insecure=True, clock=clock)
    await coord.fleet.recovery.rebuild()
    return coord


async def taint(coord, node, reclaim, d, remove=False):
    drains = coord.fleet.drains
    call = drains.lift_taint if remove else drains.taint
    return await call(node, reclaim, "notice", d, d - 10)


async def test_a_first_notice_is_stored_without_a_read_before_it(store, clock):
    """1,000 notices in a second must not queue a thousand reads ahead of their answers: a
    reclamation the coordinator neither drains nor lifted lately is new."""
    coord = await started(store, clock)
    reads = counted_reads(store)
    answer = await taint(coord, "node-a", "r-1", clock.now + 120)
    assert [t.reclaim_id for t in answer.taints] == ["r-1"] and not answer.late
    assert reads == []
    [drain] = await store.active_drains("node-a")
    assert (drain.reclaim_id, drain.terminate_at) == ("r-1", clock.now + 120)
    again = await taint(coord, "node-a", "r-1", clock.now + 120)  # the agent's retry
    assert [t.reclaim_id for t in again.taints] == ["r-1"] and reads == []
    await coord.fleet.close()


async def test_a_taint_retried_after_its_cancel_is_late_from_memory_and_after_a_restart(
    store, clock
):
    """The agent's Taint call was still in flight when the notice was cancelled (or it retries
    after): taking it would taint the node behind the cancel. Known from memory, and from the
    store once the coordinator has restarted; no lookup either way."""
    d = clock.now + 120
    coord = await started(store, clock)
    reads = counted_reads(store)
    await taint(coord, "node-a", "r-1", d)
    await taint(coord, "node-a", "r-1", d, remove=True)
    # A cancel that lands before its own Taint: remembered all the same.
    await taint(coord, "node-a", "r-2", d, remove=True)
    reads.clear()  # a lift reads what it stored; the Taints below must not read
    clock.now += 3
    for reclaim in ("r-1", "r-2"):
        answer = await taint(coord, "node-a", reclaim, d)
        assert answer.late and answer.taints == []
    assert await store.taints("node-a") == [] and await store.active_drains("node-a") == []
    await coord.fleet.close()

    restarted = await started(store, clock)
    answer = await taint(restarted, "node-a", "r-1", d)
    assert answer.late and answer.taints == []
    assert reads == []
    fresh = await taint(restarted, "node-a", "r-3", d)  # a new notice still taints
    assert [t.reclaim_id for t in fresh.taints] == ["r-3"] and reads == []
    await restarted.fleet.close()


async def test_a_retry_older_than_memory_reads_the_store_and_is_still_late(store, clock):
    """Memory keeps a lifted drain until LIFTED_KEEP_S after its deadline; a retry carrying a
    deadline older than that is looked up, and the store still says lifted."""
    d = clock.now + 120
    coord = await started(store, clock)
    reads = counted_reads(store)
    await taint(coord, "node-a", "r-1", d)
    await taint(coord, "node-a", "r-1", d, remove=True)
    reads.clear()
    clock.now = d + LIFTED_KEEP_S + 1
    answer = await taint(coord, "node-a", "r-1", d)
    assert answer.late and answer.taints == []
    assert reads == [("node-a", "r-1")]
    assert coord.fleet.drains.lifted == {}  # forgotten: memory does not grow with history
    await coord.fleet.close()


async def test_a_node_lifting_more_than_memory_keeps_reads_the_store(store, clock):
    """A node that lifts reclamations in a loop cannot grow the coordinator's memory: past
    LIFTED_PER_NODE its Taints are looked up, with the same answers."""
    d = clock.now + 120
    coord = await started(store, clock)
    reads = counted_reads(store)
    for i in range(LIFTED_PER_NODE + 1):
        await taint(coord, "node-a", f"r-{i}", d, remove=True)
    assert len(coord.fleet.drains.lifted["node-a"]) == LIFTED_PER_NODE
    reads.clear()
    late = await taint(coord, "node-a", f"r-{LIFTED_PER_NODE}", d)  # the one not remembered
    assert late.late and reads == [("node-a", f"r-{LIFTED_PER_NODE}")]
    other = await taint(coord, "node-b", "r-0", d)  # other nodes keep their memory
    assert not other.late and len(reads) == 1
    await coord.fleet.close()
