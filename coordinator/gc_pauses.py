"""The pauses a busy coordinator can suffer, kept small and measured: the garbage collector's
and the event loop's own.

At 10,000 nodes the long-lived fleet state (workers, routes, node rows, gRPC streams) is a few
million objects. A full (generation 2) collection walks all of them and frees nothing: 0.7 s
with the loop stopped, every few seconds. So, as Instagram does for its web servers, what
survives start-up and each later period is moved out of the collector's view (`gc.freeze()`):
collections then walk only what was allocated since. Automatic full collections are turned
off; young collections (cheap, they walk only what is new) run as usual, and one more every
YOUNG_EVERY_S: the automatic ones are triggered by an allocation count that every freed object
lowers, old ones included, so with each stream's read objects replaced at every message the
young generation grew for seconds between them, and the collection that came walked all of
it: 70 to 230 ms at 10,000 nodes.

Each freeze first collects the young generations, so young garbage is freed, never frozen (a
freeze without it leaked +240 MiB in the fuzz test). A collection of everything not yet frozen
would also free what died in the old generation, but it walks the survivors of the whole period
(every stream's last message, kept until the next): 200 to 500 ms at 10,000 nodes, every freeze.
So garbage that reaches the old generation, a reference cycle that dies after two collections or
after it was frozen (a stream that ends, its call's objects), is not freed by a freeze. The
coordinator makes few such cycles (records are dataclasses and dicts freed by reference count,
and a refused call never goes through `context.abort`: coordinator/api/errors.py). For what is left,
memory decides, as Go's collector does: once the process has doubled (grown by at least
RECLAIM_GROWTH_MIN_BYTES) since the last full look (the first measure ten minutes after the
start, once the fleet has connected), the frozen heap is thawed and collected once: one long
pause (0.4 to 1 s at 10,000 nodes), paid only when memory grew, and rarer as the coordinator
grows. What stays frozen garbage is bounded by that growth.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

log = logging.getLogger("spotdrain.coordinator.gc")

FREEZE_EVERY_S = 5.0
# A young collection this often, besides the automatic ones (see above): it walks 100 ms of
# allocations, where one that waited for the count walked seconds of them (50 to 230 ms seen
# at 10,000 nodes).
YOUNG_EVERY_S = 0.1
# ... and every this many of them, of the middle generation too: what survived the young ones
# waits there, and a freeze's collection of seconds of it took 110 to 150 ms.
MIDDLE_EVERY = 5
# Automatic full collections off (a generation-2 threshold never reached): what reaches the
# old generation is frozen within FREEZE_EVERY_S instead of walked again and again.
GC_THRESHOLDS = (700, 10, 1_000_000)
# The frozen heap is thawed and collected once the process has grown by this share of its size
# at the last full look, and at least this much (see above): doubling, as Go's GOGC=100.
RECLAIM_GROWTH_SHARE = 1.0
RECLAIM_GROWTH_MIN_BYTES = 256 * 2**20
# ... measured from this long after the start (see tick).
RECLAIM_AFTER_START_S = 600.0
LAG_PROBE_S = 0.1
# A collection this long is logged, with how much of it was the collector's own CPU (the rest:
# the process was not running) and what it freed: a pause an operator sees as late Taint
# answers should be explained in the log, not only counted.
LONG_PAUSE_S = 0.05
_LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


def rss_bytes() -> int:
    """The process's resident memory (one read of /proc, no walk of the heap)."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Pauses:
    def __init__(
        self,
        registry: CollectorRegistry,
        rss: Callable[[], int] = rss_bytes,
        clock: Callable[[], float] = time.monotonic,
        young_every_s: float = YOUNG_EVERY_S,
        wall: Callable[[], float] = time.perf_counter,
        cpu: Callable[[], float] = time.thread_time,
    ) -> None:
        # wall and cpu time each collection; tests pass fake ones, as they pass the clock.
        self.gc_pause = Histogram(
            "spotdrain_gc_pause_seconds",
            "Garbage collections by generation: how long each stopped the process.",
            ["generation"],
            buckets=_LAG_BUCKETS,
            registry=registry,
        )
        self.gc_pause_max = Gauge(
            "spotdrain_gc_pause_max_seconds",
            "The longest garbage collection pause since the coordinator started.",
            registry=registry,
        )
        self.loop_lag = Histogram(
            "spotdrain_event_loop_lag_seconds",
            "How late a probe scheduled every 100 ms ran: the event loop's own stalls.",
            buckets=_LAG_BUCKETS,
            registry=registry,
        )
        self.freezes = Counter(
            "spotdrain_gc_freezes", "Times the long-lived heap was frozen.", registry=registry
        )
        self.reclaims = Counter(
            "spotdrain_gc_reclaims",
            "Times the frozen heap was thawed and collected (memory had grown).",
            registry=registry,
        )
        self._rss, self._clock = rss, clock
        self._young_every_s, self._wall, self._cpu = young_every_s, wall, cpu
        self._first_look_at = clock() + RECLAIM_AFTER_START_S
        self._reclaim_above: int | None = None  # the RSS that calls for a full look
        self._started: float | None = None
        self._started_cpu = 0.0
        self._longest = 0.0

    def install(self) -> None:
        gc.callbacks.append(self._on_gc)
        gc.set_threshold(*GC_THRESHOLDS)

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = self._wall()
            self._started_cpu = self._cpu()
        elif self._started is not None:
            pause = self._wall() - self._started
            cpu = self._cpu() - self._started_cpu
            self._started = None
            self.gc_pause.labels(str(info.get("generation", ""))).observe(pause)
            if pause > self._longest:
                self._longest = pause
                self.gc_pause_max.set(pause)
            if pause >= LONG_PAUSE_S:
                log.warning(
                    "gc: generation %s collection stopped the process %.0f ms, %.0f ms of it "
                    "collecting (collected %s, uncollectable %s)",
                    info.get("generation"),
                    pause * 1000,
                    cpu * 1000,
                    info.get("collected"),
                    info.get("uncollectable"),
                )

    def freeze(self) -> None:
        """What is alive now is long-lived: out of the collector's view."""
        gc.collect(1)  # young garbage first: what is frozen is never collected
        gc.freeze()
        self.freezes.inc()
        # (Not gc.get_freeze_count(): it walks every frozen object, a pause of its own.)

    def reclaim(self) -> None:
        """The frozen heap thawed, collected once, frozen again: the cycles that died frozen."""
        started = time.perf_counter()
        gc.unfreeze()
        freed = gc.collect(2)
        gc.freeze()
        self.reclaims.inc()
        rss = self._rss()
        self._look_again_above(rss)
        log.info(
            "gc: the frozen heap thawed and collected (memory had grown): %d objects freed in "
            "%.0f ms; RSS %d MiB, the next full look above %d MiB",
            freed,
            (time.perf_counter() - started) * 1000,
            rss >> 20,
            self._reclaim_above >> 20,
        )

    def _look_again_above(self, rss: int) -> None:
        grown = max(RECLAIM_GROWTH_MIN_BYTES, int(rss * RECLAIM_GROWTH_SHARE))
        self._reclaim_above = rss + grown

    def tick(self) -> None:
        """Every FREEZE_EVERY_S: a full look when memory has grown enough, else a freeze. The
        first measure of memory is taken RECLAIM_AFTER_START_S after the start: a fleet
        connecting grows the heap with live state, and full looks then found nothing (40 to
        65 objects in each of four, at 10,000 nodes) while stopping the process 0.4 to 1 s."""
        if self._reclaim_above is None:
            if self._clock() >= self._first_look_at:
                self._look_again_above(self._rss())
        elif self._rss() >= self._reclaim_above:
            self.reclaim()
            return
        self.freeze()

    async def keep_frozen(self) -> None:
        while True:
            await asyncio.sleep(FREEZE_EVERY_S)
            self.tick()

    async def keep_young_small(self) -> None:
        tick = 0
        while True:
            await asyncio.sleep(self._young_every_s)
            tick += 1
            gc.collect(1 if tick % MIDDLE_EVERY == 0 else 0)

    async def probe_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + LAG_PROBE_S
            await asyncio.sleep(LAG_PROBE_S)
            self.loop_lag.observe(max(0.0, loop.time() - due))
