"""One heap of absolute deadlines, keyed: the coordinator's start timeouts, heartbeat expiries
and node-gone times (Nomad's drainer keeps one the same way). Pure: no clock, no asyncio.

Each key has at most one current deadline (`set` replaces it, `cancel` drops it). The heap
invalidates lazily: an entry that surfaces is checked against the key's current deadline, so
a deadline moved or cancelled never fires at its old time.

- Moved earlier: a new entry is pushed; the old one is dropped when it surfaces.
- Moved later (a heartbeat, the common case): nothing is pushed. The old entry surfaces at its
  time and is pushed again at the current deadline, so a key refreshed every few seconds costs
  one push per period of its deadline, not one per refresh.
- Fired: the key is dropped, a deadline fires once. Setting it again arms it again.

`pop_due(now)` looks only at entries whose time has come: what a pass costs grows with what
is due, not with how many keys are held. Stale entries are compacted away when they outnumber
the live keys (after a push or a cancel), so the heap's size follows the live keys.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

COMPACT_SLACK = 64  # stale entries tolerated beside the live keys before a rebuild


class Deadlines(Generic[K]):
    def __init__(self) -> None:
        self._at: dict[K, float] = {}  # key -> its current deadline
        # (time, tie-breaker, key); every key in _at has an entry at or before its deadline.
        self._heap: list[tuple[float, int, K]] = []
        self._seq = itertools.count()
        self.surfaced = 0  # entries looked at by pop_due, stale ones included (tests count)
        self.fired = 0

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, key: object) -> bool:
        return key in self._at

    def get(self, key: K) -> float | None:
        return self._at.get(key)

    def entries(self) -> int:
        """Entries in the heap, stale ones included (bounded: see `_compact`)."""
        return len(self._heap)

    def set(self, key: K, at: float) -> bool:
        """Arm `key` at `at`, replacing its deadline. True when `at` is now the earliest of
        all (the timer sleeping until the old earliest must wake)."""
        old = self._at.get(key)
        if old == at:
            return False
        self._at[key] = at
        if old is None or at < old:
            self._push(at, key)
        return self._heap[0][0] == at

    def cancel(self, key: K) -> None:
        if self._at.pop(key, None) is not None and len(self._heap) > self._bound():
            self._compact()  # a fleet reconnecting after a restart cancels most of the heap

    def next_at(self) -> float | None:
        """The earliest current deadline (stale entries at the top are dropped or moved)."""
        while self._heap:
            at, _, key = self._heap[0]
            current = self._at.get(key)
            if current == at:
                return at
            heapq.heappop(self._heap)
            if current is not None and current > at:
                self._push(current, key)
        return None

    def pop_due(self, now: float) -> list[K]:
        """The keys whose deadline is at or before `now`, earliest first; each is dropped."""
        due: list[K] = []
        while self._heap and self._heap[0][0] <= now:
            at, _, key = heapq.heappop(self._heap)
            self.surfaced += 1
            current = self._at.get(key)
            if current == at:
                del self._at[key]
                due.append(key)
            elif current is not None and current > at:
                self._push(current, key)  # moved later: it waits for its new time
        self.fired += len(due)
        return due

    def _push(self, at: float, key: K) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), key))
        if len(self._heap) > self._bound():
            self._compact()

    def _bound(self) -> int:
        return 2 * len(self._at) + COMPACT_SLACK

    def _compact(self) -> None:
        self._heap = [(at, next(self._seq), key) for key, at in self._at.items()]
        heapq.heapify(self._heap)
