"""What a store backend is: transactions on one connection, and reads outside them.

The domain queries (store.py) are written once; a backend only runs SQL. Every failure comes
out as a `StoreError` (or `StoreUnavailable` when the database cannot be reached at all), never
as a driver's own exception, so the servicers map one family of errors to status codes.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any


class StoreError(Exception):
    """The store refused or failed an operation (a bad schema version, a constraint)."""


class StoreUnavailable(StoreError):
    """The database cannot be reached now (PostgreSQL restarting or failing over). Nothing was
    written; the caller answers UNAVAILABLE and the client retries (agents keep their outbox)."""


class Fenced(StoreError):
    """A write refused because this process does not hold the leader lease at its term (a
    follower, or a leader deposed while it was stopped): nothing was written. UNAVAILABLE to
    the caller, who is sent to the leader (coordinator/replicas/leadership.py)."""


@dataclass(frozen=True)
class Result:
    rows: list[tuple[Any, ...]]
    rowcount: int


@dataclass(frozen=True)
class WriteStats:
    """A backend's write path now: what `Store.stats()` reports of it."""

    waiting: int  # transactions queued for the writer (SQLite) or a pool connection (PostgreSQL)
    group_commits: Mapping[str, int]  # "critical", "bulk": trips made for blind transactions


class Conn(ABC):
    """One connection inside one transaction.

    `defer` queues a write whose result nobody needs; queued writes go out with the next
    statement that needs an answer, or with the commit, in one trip. The critical path (a
    Taint: the taint, the drain, the workers' states, the events) is then one trip to the
    database instead of one per statement."""

    @abstractmethod
    def defer(self, sql: str, args: Sequence[Any] = ()) -> None: ...

    @abstractmethod
    async def flush(self) -> None:
        """Send what `defer` queued (before the transaction commits)."""

    @abstractmethod
    async def execute(self, sql: str, args: Sequence[Any] = ()) -> Result: ...

    @abstractmethod
    async def execute_each(
        self, sql: str, rows: Sequence[Sequence[Any]]
    ) -> list[tuple[Any, ...] | None]:
        """One statement with RETURNING for each row, in one trip to the database: the first
        row each returned, or None. (A batch of events is one trip, not one per event.)"""

    def serialize_events(self) -> None:  # noqa: B027 (a no-op unless a backend needs it)
        """Called before a transaction inserts events: events must commit in id order, so that
        a consumer resuming after id N never misses one that commits late with a lower id."""


class Backend(ABC):
    name: str  # "sqlite" or "postgresql"
    text_order: str  # appended to a text column in ORDER BY: byte order on both backends
    where: str  # for messages: the file, or the database without its password

    @abstractmethod
    async def open(self) -> None:
        """Connect and bring the schema to this version (or refuse with StoreError)."""

    @abstractmethod
    def transaction(self, priority: bool = False) -> AbstractAsyncContextManager[Conn]:
        """One transaction: committed when the block ends, rolled back if it raises.
        `priority`: the critical path (Taint, the workload flag) goes before bulk writes."""

    @abstractmethod
    async def write(self, sql: str, args: Sequence[Any] = (), priority: bool = False) -> Result:
        """One statement outside any transaction: its own transaction, in one trip."""

    async def write_later(self, sql: str, args: Sequence[Any] = (), priority: bool = False) -> None:
        """`write` for a statement whose result nobody reads; a backend may commit it together
        with others waiting at the same moment. Stored when it returns."""
        await self.write(sql, args, priority)

    @abstractmethod
    async def read(self, sql: str, args: Sequence[Any] = ()) -> Result:
        """A read outside any transaction: never waits for a writer."""

    @abstractmethod
    def write_stats(self) -> WriteStats:
        """Counters of the write path, read without a trip to the database."""

    @abstractmethod
    async def close(self) -> None: ...


class PriorityLock:
    """A mutex whose priority waiters go before the others (each class in FIFO order): a Taint
    waits for at most the one transaction in progress, never for a queue of event batches."""

    def __init__(self) -> None:
        self._held = False
        self._waiters: tuple[list[asyncio.Future[None]], list[asyncio.Future[None]]] = ([], [])

    @property
    def waiting(self) -> int:
        return sum(len(queue) for queue in self._waiters)

    async def acquire(self, priority: bool = False) -> None:
        if not self._held and not any(self._waiters):
            self._held = True
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._waiters[0 if priority else 1]
        queue.append(future)
        try:
            await future
        except BaseException:
            if future in queue:
                queue.remove(future)
            elif future.done() and not future.cancelled():
                self.release()  # handed the lock just as it was cancelled: pass it on
            raise

    def release(self) -> None:
        for queue in self._waiters:
            while queue:
                future = queue.pop(0)
                if not future.done():
                    future.set_result(None)  # the lock passes straight to this waiter
                    return
        self._held = False


async def schema_version(conn: Conn, meta_exists_sql: str) -> int:
    """The database's schema version: 0 for a new one, -1 for a meta table without one."""
    if not (await conn.execute(meta_exists_sql)).rows:
        return 0
    row = await conn.execute("SELECT value FROM meta WHERE key='schema_version'")
    return int(row.rows[0][0]) if row.rows else -1
