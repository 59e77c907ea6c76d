"""Live reclamation pages: one follower of the event log for every open page.

A page subscribes to one reclamation. The follower runs only while some page is open: woken by
the event log's notify (the same condition WatchEvents waits on, with the same 1 s bound for a
notify that came between two reads), it reads the new events once for all pages, and for each
reclamation that gained a step it loads the timeline once and hands every page watching it the
whole new drawing. A page that falls behind keeps only the latest drawing: each message is the
whole state, never a delta to lose.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from spotdrain.coordinator.fleet.eventlog import EventLog
from spotdrain.coordinator.store import Store
from spotdrain.runtime.watchers import Watchers

log = logging.getLogger("spotdrain.coordinator.dashboard")

MAX_WATCHERS = 64  # open live pages, all reclamations together
READ_BATCH = 1000
NOTIFY_BOUND_S = 1.0


class TooManyWatchers(Exception):
    pass


class LiveTimelines:
    def __init__(
        self,
        events: EventLog,
        store: Store,
        message_for: Callable[[str], Awaitable[str | None]],
        max_watchers: int = MAX_WATCHERS,
    ) -> None:
        self.events = events
        self.store = store
        self.message_for = message_for  # reclaim id -> the message every watcher gets
        self.max_watchers = max_watchers
        self._watchers: Watchers[str, str] = Watchers()
        self._follower: asyncio.Task[None] | None = None
        self._last_id: int | None = None

    def count(self) -> int:
        return len(self._watchers)

    def watch(self, reclaim_id: str) -> asyncio.Queue[str]:
        if self.count() >= self.max_watchers:
            raise TooManyWatchers(f"{self.max_watchers} live pages open already")
        queue = self._watchers.add(reclaim_id, asyncio.Queue(maxsize=1))
        if self._follower is None or self._follower.done():
            self._follower = asyncio.get_running_loop().create_task(self._follow())
        return queue

    def unwatch(self, reclaim_id: str, queue: asyncio.Queue[str]) -> None:
        self._watchers.remove(reclaim_id, queue)

    async def close(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower

    async def _follow(self) -> None:
        if self._last_id is None:
            self._last_id = await self.store.last_event_id()
        while self._watchers:
            changed: set[str] = set()
            while True:
                rows = await self.store.events_after(self._last_id, limit=READ_BATCH)
                for row in rows:
                    self._last_id = row.id
                    if row.reclaim_id in self._watchers:
                        changed.add(row.reclaim_id)
                if len(rows) < READ_BATCH:
                    break
            for reclaim_id in changed:
                try:
                    message = await self.message_for(reclaim_id)
                except Exception:  # noqa: BLE001 (a page misses one update, the follower lives)
                    log.exception("live timeline %s: could not draw it", reclaim_id)
                    continue
                if message is not None:
                    for queue in self._watchers.of(reclaim_id):
                        offer(queue, message)
            await self.events.wait(timeout=NOTIFY_BOUND_S)


def offer(queue: asyncio.Queue[str], message: str) -> None:
    """The latest whole state replaces one not yet sent."""
    if queue.full():
        with contextlib.suppress(asyncio.QueueEmpty):
            queue.get_nowait()
    queue.put_nowait(message)
