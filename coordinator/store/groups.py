"""Group commit: transactions of blind writes waiting at the same moment, committed together.

A transaction that only wrote (no read, no RETURNING: a Taint's taint and drain, a worker's new
state, the coordinator's own events) needs no connection of its own while it runs. It queues
its writes here; one task commits every transaction queued meanwhile in one trip to the
database, and tells each its own outcome. A thousand Taints in a second are then a few trips,
not a thousand transactions queueing for the writer (SQLite) or a pool's connections
(PostgreSQL). Each backend says how one trip commits a list of groups, and keeps one queue for
the critical path (a Taint's) and one for the rest, so a Taint's trip never carries, nor waits
for, a trip of bulk writes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

Write = tuple[str, Sequence[Any]]
# One trip: the groups in, for each group None (committed) or why it was not.
Commit = Callable[[list[list[Write]]], Awaitable[list[BaseException | None]]]
# Groups committed in one trip at most: one trip's statements stay bounded whatever the queue.
GROUPS_PER_TRIP = 500


class GroupCommit:
    def __init__(self, commit: Commit) -> None:
        self._commit = commit
        self._waiting: list[tuple[list[Write], asyncio.Future[None]]] = []
        self._committer: asyncio.Task[None] | None = None
        self.trips = 0  # commits made: fewer than the groups told, when groups waited together

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def __call__(self, writes: Sequence[Write]) -> None:
        """Committed with every other group waiting now; raises what failed this group."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._waiting.append((list(writes), done))
        if self._committer is None or self._committer.done():
            self._committer = loop.create_task(self._commit_waiting())
        await done

    async def _commit_waiting(self) -> None:
        while self._waiting:
            groups = self._waiting[:GROUPS_PER_TRIP]
            del self._waiting[:GROUPS_PER_TRIP]
            self.trips += 1
            try:
                errors = await self._commit([w for w, _ in groups])
            except BaseException as e:  # noqa: BLE001 (each waiter is told)
                errors = [e] * len(groups)
            for (_, done), error in zip(groups, errors, strict=True):
                if done.done():
                    continue
                if error is None:
                    done.set_result(None)
                else:
                    done.set_exception(error)
