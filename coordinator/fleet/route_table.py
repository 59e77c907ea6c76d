"""The routing table routers consume: per model, the `ready` workers and their slots.

In memory, rebuilt from the store at start; every change bumps one version and is pushed to
each watcher of that model at once (no polling), so a worker that goes draining is gone from
every router's view before its node signals anything (docs/design.md "Owner pause timeline").
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

from spotdrain.runtime.watchers import Watchers

WATCH_BACKLOG = 10_000  # changes a watcher may be behind before its stream is ended


@dataclass(frozen=True)
class RouteEntry:
    worker_id: str
    node_id: str
    model: str
    address: str
    slots_in_use: int
    capacity: int


@dataclass(frozen=True)
class RouteChange:
    version: int
    upsert: tuple[RouteEntry, ...] = ()
    removed: tuple[str, ...] = ()


class RouteTable:
    def __init__(self) -> None:
        # Versions keep growing across coordinator restarts (a router compares them): start
        # from the clock in microseconds rather than from zero.
        self.version = time.time_ns() // 1000
        self._routes: dict[str, dict[str, RouteEntry]] = {}
        self._model_of: dict[str, str] = {}
        self._watchers: Watchers[str, RouteChange] = Watchers()
        self._overflowed: set[asyncio.Queue[RouteChange]] = set()

    def snapshot(self, model: str) -> tuple[int, list[RouteEntry]]:
        return self.version, list(self._routes.get(model, {}).values())

    def get(self, worker_id: str) -> RouteEntry | None:
        model = self._model_of.get(worker_id)
        return None if model is None else self._routes[model].get(worker_id)

    def upsert(self, entry: RouteEntry) -> None:
        self._routes.setdefault(entry.model, {})[entry.worker_id] = entry
        self._model_of[entry.worker_id] = entry.model
        self._publish(entry.model, RouteChange(self._bump(), upsert=(entry,)))

    def remove(self, worker_id: str) -> None:
        model = self._model_of.pop(worker_id, None)
        if model is None:
            return
        self._routes[model].pop(worker_id, None)
        self._publish(model, RouteChange(self._bump(), removed=(worker_id,)))

    def set_slots(self, worker_id: str, slots_in_use: int) -> None:
        entry = self.get(worker_id)
        if entry is not None and entry.slots_in_use != slots_in_use:
            self.upsert(replace(entry, slots_in_use=slots_in_use))

    def pick(self, model: str) -> RouteEntry | None:
        """The least-loaded ready worker (by the share of its slots in use)."""
        entries = self._routes.get(model, {}).values()
        return min(
            entries,
            key=lambda e: (e.slots_in_use / max(e.capacity, 1), e.slots_in_use, e.worker_id),
            default=None,
        )

    def subscribe(self, model: str) -> asyncio.Queue[RouteChange]:
        return self._watchers.add(model, asyncio.Queue(maxsize=WATCH_BACKLOG))

    def overflowed(self, queue: asyncio.Queue[RouteChange]) -> bool:
        return queue in self._overflowed

    def unsubscribe(self, model: str, queue: asyncio.Queue[RouteChange]) -> None:
        self._watchers.remove(model, queue)
        self._overflowed.discard(queue)

    def _bump(self) -> int:
        self.version += 1
        return self.version

    def _publish(self, model: str, change: RouteChange) -> None:
        for queue in self._watchers.of(model):
            try:
                queue.put_nowait(change)
            except asyncio.QueueFull:
                # A watcher this far behind gets no more changes: its stream ends and the
                # router re-snapshots (memory stays bounded whatever a router does).
                self._watchers.remove(model, queue)
                self._overflowed.add(queue)


def merged(changes: list[RouteChange]) -> RouteChange | None:
    """Changes a watcher has waiting, as one: each worker's last word, at the last version. A
    thousand workers draining at once (a mass reclamation) are then a few messages to each
    router, not a thousand, and none is held back: only what already waits is merged."""
    if not changes:
        return None
    if len(changes) == 1:
        return changes[0]
    last: dict[str, RouteEntry | None] = {}
    for change in changes:
        for entry in change.upsert:
            last.pop(entry.worker_id, None)  # keeps the order of the latest word
            last[entry.worker_id] = entry
        for worker_id in change.removed:
            last.pop(worker_id, None)
            last[worker_id] = None
    return RouteChange(
        changes[-1].version,
        upsert=tuple(e for e in last.values() if e is not None),
        removed=tuple(w for w, e in last.items() if e is None),
    )
