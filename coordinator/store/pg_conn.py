"""One PostgreSQL transaction's connection, taken only at its first trip.

A transaction costs trips to the server, and at fleet scale the trips are the cost: BEGIN, each
statement and COMMIT as trips of their own made a transaction three or four. Here BEGIN goes
with the first statement (the fence and the events lock with it), queued writes go with the
next statement that needs an answer, and COMMIT goes with the last queued writes: a transaction
that reads once is two trips. A transaction that never needed an answer (blind writes: a
Taint's, a worker's new state, the coordinator's own events) never takes a connection at all:
its writes (`blind()`) are committed in a group with the others waiting at the same moment
(store/groups.py), one trip for all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Any

import psycopg
from psycopg_pool import PoolTimeout

from spotdrain.coordinator.store.backend import Conn, Fenced, Result, StoreError, StoreUnavailable
from spotdrain.coordinator.store.groups import Write

# The text a fence failure carries (postgres.FENCE raises it), so it maps to Fenced.
FENCE_TAG = "spotdrain-fence"
# Any fixed number: the key of the transaction-scoped advisory lock that makes transactions
# inserting events commit one after the other, in the order they took their ids.
EVENTS_LOCK = 0x5D01
LOCK_EVENTS: Write = ("SELECT pg_advisory_xact_lock(%s)", (EVENTS_LOCK,))
BEGIN: Write = ("BEGIN", ())
COMMIT: Write = ("COMMIT", ())


def params(sql: str) -> str:
    # The queries are written with SQLite's `?`; psycopg wants `%s` (no query holds a `%`).
    return sql.replace("?", "%s")


def failed(where: str, e: Exception) -> StoreError:
    if isinstance(e, psycopg.errors.InvalidTextRepresentation) and FENCE_TAG in str(e):
        why = str(e).split(FENCE_TAG, 1)[1].strip(': "')
        return Fenced(f"database {where}: {why}")
    if isinstance(e, psycopg.OperationalError | PoolTimeout):
        return StoreUnavailable(f"database {where}: {e}")
    return StoreError(f"database {where}: {e}")


async def trip(conn: psycopg.AsyncConnection, where: str, writes: Sequence[Write]) -> Result:
    """Statements sent together and answered together; the last one's result."""
    try:
        if len(writes) == 1:
            cur = await conn.execute(*writes[0])
        else:
            async with conn.pipeline():
                for sql, args in writes:
                    cur = await conn.execute(sql, args)
        rows = await cur.fetchall() if cur.description else []
        return Result(rows, cur.rowcount)
    except psycopg.Error as e:
        raise failed(where, e) from e


async def commit_trip(conn: psycopg.AsyncConnection, where: str, writes: Sequence[Write]) -> None:
    """BEGIN, the writes and COMMIT in one trip; rolled back whole if one fails."""
    try:
        await trip(conn, where, [BEGIN, *writes, COMMIT])
    except StoreError:
        await rollback(conn)
        raise


async def rollback(conn: psycopg.AsyncConnection) -> None:
    try:
        await conn.execute("ROLLBACK")
    except psycopg.Error:
        pass  # the connection is gone or mid-command: the pool discards it, the server rolls back


class PgConn(Conn):
    def __init__(
        self,
        connect: Callable[[], AbstractAsyncContextManager[psycopg.AsyncConnection]],
        where: str,
        head: Sequence[Write] = (),
    ) -> None:
        self._connect = connect
        self.where = where
        self._head = list(head)  # the fence: the first statement after BEGIN
        self._events = False
        self.pending: list[Write] = []
        self.conn: psycopg.AsyncConnection | None = None
        self._stack = AsyncExitStack()

    @property
    def started(self) -> bool:
        return self.conn is not None

    def defer(self, sql: str, args: Sequence[Any] = ()) -> None:
        self.pending.append((params(sql), tuple(args)))

    def serialize_events(self) -> None:
        # Held to the commit. Not started yet: taken right after BEGIN (or first in the group).
        if self.conn is None:
            self._events = True
        else:
            self.pending.append(LOCK_EVENTS)

    def blind(self) -> list[Write]:
        """The writes of a transaction that never started, for a group commit."""
        if not self.pending:
            return []
        return [LOCK_EVENTS, *self.pending] if self._events else list(self.pending)

    async def _start(self) -> psycopg.AsyncConnection:
        if self.conn is None:
            try:
                self.conn = await self._stack.enter_async_context(self._connect())
            except (psycopg.Error, PoolTimeout) as e:
                raise failed(self.where, e) from e
            first = [BEGIN, *self._head, *([LOCK_EVENTS] if self._events else [])]
            self.pending[:0] = first
        return self.conn

    async def _trip(self, writes: Sequence[Write]) -> Result:
        conn = await self._start()
        todo, self.pending = [*self.pending, *writes], []
        return await trip(conn, self.where, todo)

    async def flush(self) -> None:
        if self.conn is None or self.pending:
            await self._trip([])

    async def execute(self, sql: str, args: Sequence[Any] = ()) -> Result:
        return await self._trip([(params(sql), tuple(args))])

    async def execute_each(
        self, sql: str, rows: Sequence[Sequence[Any]]
    ) -> list[tuple[Any, ...] | None]:
        out: list[tuple[Any, ...] | None] = []
        if not rows:
            return out
        await self.flush()
        assert self.conn is not None
        try:
            async with self.conn.cursor() as cur:
                # Pipelined: every statement goes out before the first answer is read.
                await cur.executemany(params(sql), [tuple(r) for r in rows], returning=True)
                while True:
                    out.append(await cur.fetchone())
                    if not cur.nextset():
                        break
        except psycopg.Error as e:
            raise failed(self.where, e) from e
        return out

    async def commit(self) -> None:
        """A started transaction: what is queued and COMMIT, one trip."""
        if self.conn is not None:
            await self._trip([COMMIT])

    async def rollback(self) -> None:
        self.pending = []
        if self.conn is not None:
            await rollback(self.conn)

    async def close(self) -> None:
        """The connection back to its pool."""
        await self._stack.aclose()


def joined(groups: list[list[Write]]) -> list[Write]:
    """The groups' writes as one transaction's: the events lock once, first, when any group
    inserts events (taken mid-way it could wait on a row another holder of it wants)."""
    writes = [w for group in groups for w in group if w is not LOCK_EVENTS]
    if any(group and group[0] is LOCK_EVENTS for group in groups):
        return [LOCK_EVENTS, *writes]
    return writes
