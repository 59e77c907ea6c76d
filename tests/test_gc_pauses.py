"""The coordinator's garbage-collector pauses (coordinator/pauses.py): young collections come
every tick whatever the allocation count says, the periodic freeze frees young garbage before
it moves the live heap out of the collector's view, and a long pause is logged with how much
of it was the collector's own work."""

from __future__ import annotations

import gc
import logging

import pytest
from prometheus_client import CollectorRegistry

from spotdrain.coordinator import pauses as pauses_module
from spotdrain.coordinator.pauses import Pauses


def test_a_freeze_collects_the_young_generations_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Young garbage (a rejected request's traceback, a cycle) is freed before the freeze:
    what is frozen is never collected again, so a freeze without it leaked (the fuzz test's
    memory bound caught it). Only the young generations: never a walk of the old heap."""
    collects: list[tuple] = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a, **k: collects.append(a) or real(*a, **k))
    frozen_before = gc.get_freeze_count()
    pauses = Pauses(CollectorRegistry())
    try:
        pauses.freeze()
        assert collects == [(1,)]
        assert gc.get_freeze_count() > frozen_before
    finally:
        gc.unfreeze()


def test_a_long_pause_is_logged_with_the_collectors_share(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A 120 ms generation-1 collection of which 30 ms was the collector's CPU (the rest, the
    process was not running) is logged with both figures and what it freed, counted in the
    pause histogram and kept as the longest; a 10 ms one is only counted."""
    wall = iter([10.0, 10.120, 20.0, 20.010])
    cpu = iter([1.0, 1.030, 2.0, 2.005])
    monkeypatch.setattr(pauses_module.time, "perf_counter", lambda: next(wall))
    monkeypatch.setattr(pauses_module.time, "thread_time", lambda: next(cpu))
    registry = CollectorRegistry()
    pauses = Pauses(registry)
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
    monkeypatch.setattr(pauses_module, "YOUNG_EVERY_S", 0.001)
    task = asyncio.create_task(Pauses(CollectorRegistry()).keep_young_small())
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
