"""A router's watch under a burst: a thousand workers leave the table within a second (a
provider takes back a whole capacity pool). What waits for a watcher goes out as one update
with each worker's last word, so the router applies a few messages, never an older state, and
nothing is held back to wait for more."""

from __future__ import annotations

import asyncio

from spotdrain.coordinator.fleet.route_table import RouteChange, RouteEntry, RouteTable, merged


def entry(worker_id: str, slots: int = 0) -> RouteEntry:
    return RouteEntry(worker_id, f"node-{worker_id}", "m", f"127.0.0.1:{slots + 9000}", slots, 4)


def applied(table: dict[str, RouteEntry], change: RouteChange) -> dict[str, RouteEntry]:
    """What a router does with an update (spotdrain/coordinator/router.py: upserts, then
    removals)."""
    table = dict(table)
    for e in change.upsert:
        table[e.worker_id] = e
    for worker_id in change.removed:
        table.pop(worker_id, None)
    return table


def test_waiting_changes_merge_into_each_workers_last_word_at_the_last_version():
    changes = [
        RouteChange(11, upsert=(entry("a"),)),
        RouteChange(12, removed=("b",)),
        RouteChange(13, upsert=(entry("a", 2),)),  # a's slots moved: only the last counts
        RouteChange(14, removed=("a",)),  # ... then a went draining
        RouteChange(15, upsert=(entry("b", 1),)),  # b came back
        RouteChange(16, removed=("c",)),
    ]
    start = {"b": entry("b"), "c": entry("c"), "d": entry("d")}
    one = merged(changes)
    assert one is not None and one.version == 16
    assert one.upsert == (entry("b", 1),) and set(one.removed) == {"a", "c"}
    step_by_step = start
    for change in changes:
        step_by_step = applied(step_by_step, change)
    assert applied(start, one) == step_by_step
    assert merged([changes[0]]) is changes[0] and merged([]) is None


async def test_a_burst_of_removals_reaches_a_slow_watcher_as_one_update():
    """The watcher was busy while 1,000 workers drained: it finds them all waiting and sends
    one update; a change that comes after is its own, later update."""
    table = RouteTable()
    for i in range(1000):
        table.upsert(entry(f"w{i}"))
    queue = table.subscribe("m")
    for i in range(1000):
        table.remove(f"w{i}")
    waiting = [queue.get_nowait() for _ in range(queue.qsize())]
    assert len(waiting) == 1000
    one = merged(waiting)
    assert one is not None and one.version == table.version
    assert len(one.removed) == 1000 and one.upsert == ()
    table.upsert(entry("new"))
    later = await asyncio.wait_for(queue.get(), 1)
    assert later.version > one.version and later.upsert == (entry("new"),)
