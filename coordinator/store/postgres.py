"""The fleet backend: PostgreSQL through psycopg 3's async connection pool.

The URL is a libpq URI, so a multi-host URI with `target_session_attrs=read-write` finds the
primary after a failover. Two pools: a small one kept for the critical path (Taint, the
workload flag), so a queue of event batches can never hold every connection a Taint needs.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from spotdrain.coordinator.store import schema
from spotdrain.coordinator.store.backend import (
    Backend,
    Conn,
    Result,
    StoreError,
    StoreUnavailable,
    schema_version,
)
from spotdrain.coordinator.store.sqlite import check_version

# Any fixed number: the key of the transaction-scoped advisory locks below.
EVENTS_LOCK = 0x5D01
MIGRATION_LOCK = 0x5D02
CONNECT_TIMEOUT_S = 5.0


def _params(sql: str) -> str:
    # The queries are written with SQLite's `?`; psycopg wants `%s` (no query holds a `%`).
    return sql.replace("?", "%s")


def redact(url: str) -> str:
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", re.sub(r"password=\S+", "password=***", url))


def _failed(where: str, e: Exception) -> StoreError:
    if isinstance(e, psycopg.OperationalError | PoolTimeout):
        return StoreUnavailable(f"database {where}: {e}")
    return StoreError(f"database {where}: {e}")


class _PgConn(Conn):
    def __init__(self, conn: psycopg.AsyncConnection, where: str) -> None:
        self.conn = conn
        self.where = where
        self.pending: list[tuple[str, tuple[Any, ...]]] = []

    def defer(self, sql: str, args: Sequence[Any] = ()) -> None:
        self.pending.append((_params(sql), tuple(args)))

    async def flush(self) -> None:
        """Queued writes in one pipeline: sent together, answered together."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        try:
            async with self.conn.pipeline():
                for sql, args in pending:
                    await self.conn.execute(sql, args)
        except psycopg.Error as e:
            raise _failed(self.where, e) from e

    async def execute(self, sql: str, args: Sequence[Any] = ()) -> Result:
        await self.flush()
        try:
            cur = await self.conn.execute(_params(sql), tuple(args))
            rows = await cur.fetchall() if cur.description else []
            return Result(rows, cur.rowcount)
        except psycopg.Error as e:
            raise _failed(self.where, e) from e

    async def execute_each(
        self, sql: str, rows: Sequence[Sequence[Any]]
    ) -> list[tuple[Any, ...] | None]:
        out: list[tuple[Any, ...] | None] = []
        if not rows:
            return out
        await self.flush()
        try:
            async with self.conn.cursor() as cur:
                # Pipelined: every statement goes out before the first answer is read.
                await cur.executemany(_params(sql), [tuple(r) for r in rows], returning=True)
                while True:
                    out.append(await cur.fetchone())
                    if not cur.nextset():
                        break
        except psycopg.Error as e:
            raise _failed(self.where, e) from e
        return out

    def serialize_events(self) -> None:
        # Held to the commit: transactions that insert events commit one after the other, in
        # the order they took their ids.
        self.defer("SELECT pg_advisory_xact_lock(?)", (EVENTS_LOCK,))


class PostgresBackend(Backend):
    name = "postgresql"
    # Listings sort ids by their characters, as SQLite does, whatever the database's collation.
    text_order = ' COLLATE "C"'

    def __init__(self, url: str, pool_size: int = 8) -> None:
        self.url = url
        self.where = redact(url)
        kwargs = {"autocommit": True, "connect_timeout": int(CONNECT_TIMEOUT_S)}
        self._bulk = AsyncConnectionPool(
            url, kwargs=kwargs, min_size=1, max_size=pool_size, open=False,
            timeout=CONNECT_TIMEOUT_S, name="spotdrain-bulk",
        )  # fmt: skip
        self._critical = AsyncConnectionPool(
            url, kwargs=kwargs, min_size=1, max_size=4, open=False,
            timeout=CONNECT_TIMEOUT_S, name="spotdrain-critical",
        )  # fmt: skip

    async def open(self) -> None:
        try:
            await self._bulk.open(wait=True, timeout=CONNECT_TIMEOUT_S)
            await self._critical.open(wait=True, timeout=CONNECT_TIMEOUT_S)
        except (psycopg.Error, PoolTimeout) as e:
            await self.close()
            raise StoreError(f"database {self.where}: cannot connect ({e})") from e
        try:
            await self._migrate()
        except StoreError:
            await self.close()
            raise

    async def _migrate(self) -> None:
        async with self.transaction() as conn:
            # Two replicas starting together: one migrates, the other waits and finds it done.
            await conn.execute("SELECT pg_advisory_xact_lock(?)", (MIGRATION_LOCK,))
            version = await schema_version(
                conn,
                "SELECT 1 FROM information_schema.tables "
                "WHERE table_schema = current_schema() AND table_name = 'meta'",
            )
            check_version(version, self.where)
            for _, statements in schema.steps_from(version, schema.POSTGRES_WORDS):
                for sql in statements:
                    await conn.execute(sql)

    @asynccontextmanager
    async def transaction(self, priority: bool = False) -> AsyncIterator[Conn]:
        pool = self._critical if priority else self._bulk
        try:
            async with pool.connection() as conn, conn.transaction():
                pg = _PgConn(conn, self.where)
                yield pg
                await pg.flush()
        except (psycopg.Error, PoolTimeout) as e:
            raise _failed(self.where, e) from e

    async def write(self, sql: str, args: Sequence[Any] = (), priority: bool = False) -> Result:
        # Autocommit: one statement, one round trip.
        try:
            async with (self._critical if priority else self._bulk).connection() as conn:
                return await _PgConn(conn, self.where).execute(sql, args)
        except PoolTimeout as e:
            raise _failed(self.where, e) from e

    async def read(self, sql: str, args: Sequence[Any] = ()) -> Result:
        try:
            async with self._bulk.connection() as conn:
                return await _PgConn(conn, self.where).execute(sql, args)
        except PoolTimeout as e:
            raise _failed(self.where, e) from e

    async def close(self) -> None:
        await self._bulk.close()
        await self._critical.close()
