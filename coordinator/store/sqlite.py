"""The embedded backend: one SQLite file in WAL mode, never touched on the event loop.

Why threads and not an async driver: sqlite3 is synchronous and every well-kept async wrapper
(aiosqlite included) is itself one thread per connection. Owning the threads lets us give the
single writer connection its own thread, with a priority lock in front of it (a Taint goes
before queued event batches), and serve reads from two more connections on their own threads,
which WAL lets run beside the writer without waiting for it.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from spotdrain.coordinator.store import schema
from spotdrain.coordinator.store.backend import (
    Backend,
    Conn,
    PriorityLock,
    Result,
    StoreError,
    WriteStats,
    schema_version,
)
from spotdrain.coordinator.store.groups import GroupCommit, Write

T = TypeVar("T")
READERS = 2


def _connect(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    # NORMAL in WAL mode survives a process crash (our SIGKILL tests); only a power loss can
    # drop the last transactions.
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA busy_timeout=5000")
    return db


def _run(db: sqlite3.Connection, sql: str, args: Sequence[Any]) -> Result:
    cur = db.execute(sql, tuple(args))
    return Result(cur.fetchall(), cur.rowcount)


def _end(db: sqlite3.Connection, sql: str, args: Sequence[Any]) -> Result:
    """COMMIT or ROLLBACK, only while a transaction is open (a failed BEGIN opened none)."""
    if db.in_transaction:
        db.execute(sql)
    return Result([], 0)


def _batch(
    db: sqlite3.Connection, pending: Sequence[tuple[str, Sequence[Any]]], final: Callable | None
) -> Any:
    for sql, args in pending:
        db.execute(sql, tuple(args))
    return final(db) if final is not None else None


def _group(db: sqlite3.Connection, groups: Sequence[Sequence[tuple[str, Sequence[Any]]]]) -> list:
    """Several transactions of blind writes as one SQLite transaction, each in a savepoint of
    its own: one that fails is rolled back alone and told so; the others commit together."""
    out: list[str | None] = []
    db.execute("BEGIN IMMEDIATE")
    try:
        for i, writes in enumerate(groups):
            db.execute(f"SAVEPOINT g{i}")
            try:
                for sql, args in writes:
                    db.execute(sql, tuple(args))
            except sqlite3.Error as e:
                db.execute(f"ROLLBACK TO g{i}")
                out.append(str(e))
            else:
                out.append(None)
            db.execute(f"RELEASE g{i}")
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
    return out


class _WriterConn(Conn):
    """The writer connection in one transaction. It takes the writer only at its first trip
    (BEGIN goes with it); a transaction that only ever deferred writes (blind writes: a Taint's
    taint, drain, worker states and events) never holds the writer at all, and commits in a
    group with the others that arrived meanwhile: a thousand Taints in a second are a few
    trips to the writer thread, not a thousand."""

    def __init__(self, backend: SqliteBackend, priority: bool) -> None:
        self.backend = backend
        self.priority = priority
        self.pending: list[tuple[str, Sequence[Any]]] = []
        self.locked = False

    def defer(self, sql: str, args: Sequence[Any] = ()) -> None:
        self.pending.append((sql, tuple(args)))

    async def _go(self, final: Callable[[sqlite3.Connection], T] | None) -> T:
        if not self.locked:
            await self.backend._lock.acquire(self.priority)
            self.locked = True
            self.pending.insert(0, ("BEGIN IMMEDIATE", ()))
        pending, self.pending = self.pending, []
        return await self.backend._write(_batch, pending, final)

    async def execute(self, sql: str, args: Sequence[Any] = ()) -> Result:
        return await self._go(lambda db: _run(db, sql, args))

    async def execute_each(
        self, sql: str, rows: Sequence[Sequence[Any]]
    ) -> list[tuple[Any, ...] | None]:
        return await self._go(lambda db: [db.execute(sql, tuple(r)).fetchone() for r in rows])

    async def flush(self) -> None:
        if self.pending:
            await self._go(None)

    async def commit(self) -> None:
        if self.locked:
            await self._go(lambda db: _end(db, "COMMIT", ()))
        elif self.pending:
            await self.backend.group_commit(self.pending, self.priority)

    async def rollback(self) -> None:
        if self.locked:
            await asyncio.shield(self.backend._write(_end, "ROLLBACK", ()))

    def release(self) -> None:
        if self.locked:
            self.locked = False
            self.backend._lock.release()


class SqliteBackend(Backend):
    name = "sqlite"
    text_order = ""

    def __init__(self, path: str) -> None:
        self.path = self.where = path
        self._lock = PriorityLock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="store-writer")
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="store-reader")
        self._wdb: sqlite3.Connection | None = None
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._all_lock = threading.Lock()
        # Transactions of blind writes waiting to commit together (group_commit), by priority:
        # a Taint's trip holds only the critical path's writes and goes first to the writer.
        self._groups = {
            False: GroupCommit(lambda groups: self._commit_groups(groups, False)),
            True: GroupCommit(lambda groups: self._commit_groups(groups, True)),
        }

    async def open(self) -> None:
        try:
            self._wdb = await self._in(self._writer, _connect, self.path)
            await self._migrate()
        except BaseException as e:
            await self.close()  # a refused database leaves no thread or connection behind
            if isinstance(e, sqlite3.DatabaseError):
                raise StoreError(f"database {self.path}: {e}") from e
            raise

    async def _migrate(self) -> None:
        async with self.transaction() as conn:
            version = await schema_version(
                conn, "SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'"
            )
        check_version(version, self.where)
        for _, statements in schema.steps_from(version, schema.SQLITE_WORDS):
            async with self.transaction() as conn:
                for sql in statements:
                    await conn.execute(sql)

    async def _in(self, pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def _write(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await self._in(self._writer, fn, self._wdb, *args)
        except sqlite3.DatabaseError as e:
            raise StoreError(f"database {self.path}: {e}") from e

    @asynccontextmanager
    async def transaction(self, priority: bool = False) -> AsyncIterator[Conn]:
        conn = _WriterConn(self, priority)
        try:
            try:
                yield conn
                # Shielded: a caller cancelled now still leaves the transaction committed or
                # rolled back, never open.
                await asyncio.shield(conn.commit())
            except BaseException:
                # Also when cancelled while a trip with BEGIN still runs: the rollback is
                # queued behind it on the writer thread, before any later transaction's BEGIN.
                await conn.rollback()
                raise
        finally:
            conn.release()

    async def write(self, sql: str, args: Sequence[Any] = (), priority: bool = False) -> Result:
        await self._lock.acquire(priority)
        try:
            return await asyncio.shield(self._write(_run, sql, args))
        finally:
            self._lock.release()

    async def write_later(self, sql: str, args: Sequence[Any] = (), priority: bool = False) -> None:
        await asyncio.shield(self.group_commit([(sql, tuple(args))], priority))

    async def group_commit(
        self, writes: Sequence[tuple[str, Sequence[Any]]], priority: bool
    ) -> None:
        """Commit these blind writes with every other group waiting now, in one trip."""
        await self._groups[priority](writes)

    async def _commit_groups(
        self, groups: list[list[Write]], priority: bool
    ) -> list[BaseException | None]:
        await self._lock.acquire(priority)
        try:
            errors = await self._write(_group, groups)
        finally:
            self._lock.release()
        return [None if e is None else StoreError(f"database {self.path}: {e}") for e in errors]

    def _reader_db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = _connect(self.path)
            with self._all_lock:
                self._all.append(db)
        return db

    def write_stats(self) -> WriteStats:
        commits = {"critical": self._groups[True].trips, "bulk": self._groups[False].trips}
        return WriteStats(self._lock.waiting, commits)

    async def read(self, sql: str, args: Sequence[Any] = ()) -> Result:
        def run() -> Result:
            return _run(self._reader_db(), sql, args)

        try:
            return await self._in(self._readers, run)
        except sqlite3.DatabaseError as e:
            raise StoreError(f"database {self.path}: {e}") from e

    async def close(self) -> None:
        """Let every read and write already handed to a thread finish, then close. Closing a
        connection under a statement still running on another thread crashes the process
        (sqlite3 frees the statement under it); it is never an error one could catch."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._readers.shutdown, True)
        with self._all_lock:
            for db in self._all:
                db.close()
        if self._wdb is not None:
            await self._in(self._writer, self._wdb.close)
        await loop.run_in_executor(None, self._writer.shutdown, True)


def check_version(version: int, where: str) -> None:
    if version > schema.SCHEMA_VERSION or version < 0:
        raise StoreError(
            f"database {where} has schema version {version}, this coordinator knows 1 to "
            f"{schema.SCHEMA_VERSION}"
        )
