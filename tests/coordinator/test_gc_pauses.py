"""The coordinator's garbage-collector pauses (coordinator/gc_pauses.py): young collections come
every tick whatever the allocation count says, the periodic freeze frees garbage before it
moves the live heap out of the collector's view, the frozen heap is collected once memory has
grown, and a long pause is logged with how much of it was the collector's own work."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
from prometheus_client import CollectorRegistry

from spotdrain.coordinator import gc_pauses as pauses_module
from spotdrain.coordinator.gc_pauses import Pauses

GIB = 2**30


class Cycle:
    """Garbage only the collector frees: it refers to itself."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def collector_by_hand():
    """Only the test's own collections run, and nothing it froze stays frozen."""
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.enable()


def test_a_freeze_frees_young_garbage_and_never_walks_the_old_heap(
    collector_by_hand, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A young cycle that died (a refused request's objects) is freed before the freeze: what
    is frozen is never collected again, and a freeze without it leaked (the fuzz test's memory
    bound caught it). Only the young generations: a full collection walks the whole period's
    survivors, 200 to 500 ms at 10,000 nodes."""
    collects: list[tuple] = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a, **k: collects.append(a) or real(*a, **k))
    dead, alive = Cycle(), Cycle()
    dead_ref, alive_ref = weakref.ref(dead), weakref.ref(alive)
    del dead
    frozen_before = gc.get_freeze_count()
    Pauses(CollectorRegistry(), rss=lambda: GIB).freeze()
    assert collects == [(1,)]
    assert dead_ref() is None
    assert alive_ref() is alive
    assert gc.get_freeze_count() > frozen_before


def settled(registry: CollectorRegistry, rss: list[int]) -> Pauses:
    """Pauses past the start-up grace, with the first measure of memory taken at rss[0]."""
    now = [0.0]
    pauses = Pauses(registry, rss=lambda: rss[0], clock=lambda: now[0])
    now[0] = pauses_module.RECLAIM_AFTER_START_S
    pauses.tick()
    return pauses


def test_no_full_look_while_the_fleet_connects(collector_by_hand) -> None:
    """For RECLAIM_AFTER_START_S after the start memory grows with live state (10,000 nodes
    connecting): no full look however much it grows, only freezes. The first measure is taken
    then, and doubling is counted from it."""
    rss, now = [100 * 2**20], [0.0]
    registry = CollectorRegistry()
    pauses = Pauses(registry, rss=lambda: rss[0], clock=lambda: now[0])
    for step in range(10):
        now[0], rss[0] = step * 60.0, (step + 1) * GIB
        pauses.tick()
    assert registry.get_sample_value("spotdrain_gc_reclaims_total") == 0
    assert registry.get_sample_value("spotdrain_gc_freezes_total") == 10
    now[0] = pauses_module.RECLAIM_AFTER_START_S
    pauses.tick()  # the first measure: 10 GiB
    rss[0] = 19 * GIB
    pauses.tick()
    assert registry.get_sample_value("spotdrain_gc_reclaims_total") == 0
    rss[0] = 20 * GIB
    pauses.tick()
    assert registry.get_sample_value("spotdrain_gc_reclaims_total") == 1


def test_frozen_garbage_is_freed_once_memory_has_doubled(collector_by_hand) -> None:
    """A cycle frozen alive that then dies (a stream that ended) is beyond a freeze's reach.
    The frozen heap is thawed and collected once memory has doubled since the last full look:
    not at +90%, at +100%; the next full look is at twice the memory after it."""
    rss = [GIB]
    registry = CollectorRegistry()
    pauses = settled(registry, rss)
    ended = Cycle()
    ended_ref = weakref.ref(ended)
    pauses.freeze()  # the cycle is alive, frozen; memory 1 GiB at the first measure
    del ended

    rss[0] = int(1.9 * GIB)
    pauses.tick()
    assert ended_ref() is not None  # frozen: a freeze cannot free it
    assert registry.get_sample_value("spotdrain_gc_reclaims_total") == 0

    rss[0] = 2 * GIB
    pauses.tick()
    assert ended_ref() is None
    assert registry.get_sample_value("spotdrain_gc_reclaims_total") == 1

    rss[0] = int(3.9 * GIB)
    pauses.tick()  # under twice 2 GiB: a freeze
    assert registry.get_sample_value("spotdrain_gc_reclaims_total") == 1
    rss[0] = 4 * GIB
    pauses.tick()
    assert registry.get_sample_value("spotdrain_gc_reclaims_total") == 2


def test_a_small_coordinator_waits_for_the_floor_not_double(collector_by_hand) -> None:
    """At 100 MiB, doubling would be a full look every 100 MiB: the floor, 256 MiB, first."""
    rss = [100 * 2**20]
    registry = CollectorRegistry()
    pauses = settled(registry, rss)
    rss[0] = 100 * 2**20 + pauses_module.RECLAIM_GROWTH_MIN_BYTES - 1
    pauses.tick()
    assert registry.get_sample_value("spotdrain_gc_reclaims_total") == 0
    rss[0] += 1
    pauses.tick()
    assert registry.get_sample_value("spotdrain_gc_reclaims_total") == 1


def test_a_long_pause_is_logged_with_the_collectors_share(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 120 ms generation-1 collection of which 30 ms was the collector's CPU (the rest, the
    process was not running) is logged with both figures and what it freed, counted in the
    pause histogram and kept as the longest; a 10 ms one is only counted."""
    wall = iter([10.0, 10.120, 20.0, 20.010])
    cpu = iter([1.0, 1.030, 2.0, 2.005])
    registry = CollectorRegistry()
    pauses = Pauses(registry, wall=lambda: next(wall), cpu=lambda: next(cpu))
    with caplog.at_level(logging.WARNING, "spotdrain.coordinator.gc"):
        pauses._on_gc("start", {"generation": 1})
        pauses._on_gc("stop", {"generation": 1, "collected": 40, "uncollectable": 0})
        pauses._on_gc("start", {"generation": 0})
        pauses._on_gc("stop", {"generation": 0, "collected": 3, "uncollectable": 0})
    [line] = [r.getMessage() for r in caplog.records]
    assert "generation 1" in line and "120 ms" in line and "30 ms of it" in line
    assert "collected 40" in line
    assert registry.get_sample_value("spotdrain_gc_pause_max_seconds") == pytest.approx(0.12)
    count = registry.get_sample_value("spotdrain_gc_pause_seconds_count", {"generation": "0"})
    assert count == 1


async def test_the_young_generation_is_collected_every_tick_and_only_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between freezes a young collection comes every YOUNG_EVERY_S whatever the allocation
    count says, every MIDDLE_EVERY-th of them with the middle generation: never one that walks
    the old heap."""
    import asyncio

    collects: list[tuple] = []
    monkeypatch.setattr(gc, "collect", lambda *a, **k: collects.append(a) or 0)
    task = asyncio.create_task(Pauses(CollectorRegistry(), young_every_s=0.001).keep_young_small())
    try:
        for _ in range(2000):
            if len(collects) >= 2 * pauses_module.MIDDLE_EVERY:
                break
            await asyncio.sleep(0.001)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    every = pauses_module.MIDDLE_EVERY
    assert len(collects) >= 2 * every
    assert collects[: 2 * every] == ([(0,)] * (every - 1) + [(1,)]) * 2
