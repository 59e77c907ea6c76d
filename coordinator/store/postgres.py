"""The fleet backend: PostgreSQL through psycopg 3's async connection pool.

The URL is a libpq URI, so a multi-host URI with `target_session_attrs=read-write` finds the
primary after a failover. Two pools: a small one kept for the critical path (Taint, the
workload flag), so a queue of event batches can never hold every connection a Taint needs.

Replicas (coordinator/replicas/leadership.py): the leader lease is one row, `leader_lease`, whose
expiry is the database's clock, so replicas' clocks never matter. Once `fence_to(term, holder)` is
set, every write transaction first runs FENCE, in the same pipeline trip as its first statement: it
takes a share lock on the lease row at that term or fails the transaction. A deposed leader's
writes fail; a takeover (an UPDATE of that row) waits for the writes in flight to commit, so the
new leader's rebuild reads every write its predecessor was told succeeded. `fence_off()` (a
follower) refuses every write without a trip.

Every connection names its process (`application_name`, "spotdrain " and the last word of the
lease holder it takes, `holder_for`). A takeover that waits too long for the row (its holder
stopped mid-transaction: SIGSTOP, a paused VM) ends that holder's sessions and takes it: the
holder's lease has run out, and whatever it still has open is rolled back, never committed.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from spotdrain.coordinator.store import schema
from spotdrain.coordinator.store.backend import (
    Backend,
    Conn,
    Fenced,
    Result,
    StoreError,
    StoreUnavailable,
    WriteStats,
    schema_version,
)
from spotdrain.coordinator.store.groups import GroupCommit, Write
from spotdrain.coordinator.store.pg_conn import (
    FENCE_TAG,
    LOCK_EVENTS,
    PgConn,
    commit_trip,
    failed,
    params,
    trip,
)
from spotdrain.coordinator.store.sqlite import check_version

log = logging.getLogger("spotdrain.coordinator.store")

# Every double as the exact digits that round-trip, whatever the server's own setting (0 gives
# 15 significant digits: microseconds off at today's epoch): deadlines compare the same before
# and after the store.
EXACT_FLOATS = "-c extra_float_digits=3"

# Any fixed number: the key of the migration's transaction-scoped advisory lock (the events
# lock, EVENTS_LOCK, is pg_conn's).
MIGRATION_LOCK = 0x5D02
CONNECT_TIMEOUT_S = 5.0
# While the database answers nothing (no primary: mid-failover), a call waits this long for a
# connection rather than CONNECT_TIMEOUT_S: a Taint fails fast with UNAVAILABLE, well inside
# the agent's 800 ms, so the agent's local taint applies at once instead of at its deadline,
# and an event batch goes unacknowledged (it waits in the agent's outbox); nothing is answered
# that was not stored. The first call that gets a connection ends it.
DOWN_WAIT_S = 0.2

# The fence: a key-share lock on the lease row at this term, or an error naming the term. A
# key-share lock does not hold up the leader's own renewals (an UPDATE of non-key columns), so
# a busy leader never deposes itself waiting for its writes; a takeover locks the row FOR
# UPDATE (below), which does wait for every fenced write in flight. A transaction of a leader
# stopped mid-way (SIGSTOP) would hold that lock, and with it every takeover, for as long as its
# socket lives: the takeover ends that leader's sessions (END_EXPIRED). The idle limit set here
# is only a second net: PostgreSQL arms it after a plain statement, not after a pipeline (the
# fence's own trip always is one), so a transaction stopped right after such a trip sits on.
FENCE = (
    "SELECT set_config('idle_in_transaction_session_timeout', ?, true), "
    "COALESCE((SELECT '1' FROM leader_lease WHERE id = 1 AND term = ? AND holder = ? "
    "FOR KEY SHARE), ?)::int"
)
_CLOCK = "EXTRACT(EPOCH FROM clock_timestamp())::double precision"
# Take the lease when it has run out (by the database's clock), with the next term; the row as
# it is when someone else holds it.
# The row is locked FOR UPDATE only once the lease has run out, so a follower's routine
# attempt never stalls the leader's writes; a takeover waits for the old leader's writes in
# flight, for up to the lease connection's lock_timeout (LOCK_WAIT_SHARE of its timeout).
ACQUIRE = (
    f"WITH expired AS (SELECT id FROM leader_lease WHERE id = 1 AND expires_at <= {_CLOCK} "
    f"FOR UPDATE), "
    f"taken AS (UPDATE leader_lease SET holder = ?, term = term + 1, "
    f"expires_at = {_CLOCK} + ? WHERE id IN (SELECT id FROM expired) "
    f"AND expires_at <= {_CLOCK} "
    f"RETURNING term, holder, expires_at) "
    f"SELECT term, holder, expires_at - {_CLOCK}, TRUE FROM taken UNION ALL "
    f"SELECT term, holder, expires_at - {_CLOCK}, FALSE FROM leader_lease "
    f"WHERE id = 1 AND NOT EXISTS (SELECT 1 FROM taken)"
)
# Renew only what is still ours and not yet run out: an expired lease is never revived.
RENEW = (
    f"UPDATE leader_lease SET expires_at = {_CLOCK} + ? "
    f"WHERE id = 1 AND term = ? AND holder = ? AND expires_at > {_CLOCK} RETURNING term"
)
HOLDER = f"SELECT term, holder, expires_at - {_CLOCK} FROM leader_lease WHERE id = 1"

# What names a process's sessions: SESSION_PREFIX and its lease holder's last word.
SESSION_PREFIX = "spotdrain "
# A takeover waits this share of its time for the old leader's writes in flight to commit: a
# live leader's transactions take milliseconds; one held longer past the lease's expiry belongs
# to a leader that is stopped, whose sessions END_EXPIRED ends in the rest of the time.
LOCK_WAIT_SHARE = 0.5
# The sessions of the holder whose lease has run out (by the database's clock), named by its
# application_name: never this session, never this process's (the holder may be ourselves,
# resumed), and only while the row still names that holder run out, so never a live leader's:
# an expired lease is never renewed (RENEW), and a new holder's name is another. Ending them
# rolls back what they have open: nothing of a run-out term commits after the takeover.
END_EXPIRED = (
    f"SELECT l.holder, l.term, a.pid, pg_terminate_backend(a.pid) "
    f"FROM leader_lease l JOIN pg_stat_activity a "
    f"ON a.application_name = ? || substring(l.holder FROM '[^ ]+$') "
    f"WHERE l.id = 1 AND l.expires_at <= {_CLOCK} AND a.datname = current_database() "
    f"AND a.pid <> pg_backend_pid() AND a.application_name <> ?"
)


def redact(url: str) -> str:
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", re.sub(r"password=\S+", "password=***", url))


class _RowLocked(StoreError):
    """A lease statement waited its lock_timeout for the lease row (held by a transaction)."""


class PostgresBackend(Backend):
    name = "postgresql"
    # Listings sort ids by their characters, as SQLite does, whatever the database's collation.
    text_order = ' COLLATE "C"'

    def __init__(self, url: str, pool_size: int = 8) -> None:
        self.url = url
        self.where = redact(url)
        # Unique per process: the name of every session it opens (above, END_EXPIRED).
        self.session = uuid.uuid4().hex[:12]
        self.session_name = SESSION_PREFIX + self.session
        kwargs = {
            "autocommit": True,
            "connect_timeout": int(CONNECT_TIMEOUT_S),
            "application_name": self.session_name,
            "options": EXACT_FLOATS,
        }
        self._bulk = AsyncConnectionPool(
            url,
            kwargs=kwargs,
            min_size=1,
            max_size=pool_size,
            open=False,
            timeout=CONNECT_TIMEOUT_S,
            name="spotdrain-bulk",
        )
        self._critical = AsyncConnectionPool(
            url,
            kwargs=kwargs,
            min_size=1,
            max_size=4,
            open=False,
            timeout=CONNECT_TIMEOUT_S,
            name="spotdrain-critical",
        )
        # No lease (one coordinator, today's default): writes are not fenced at all.
        self._fence: tuple[Any, ...] | None = None
        self._fenced_off = ""  # a follower's reason: every write refused, no trip
        self.on_fenced: Callable[[str], None] = lambda why: None
        self._lease_conn: psycopg.AsyncConnection | None = None
        # The pools whose last call found no database to talk to. A failure marks both (the
        # database is gone); only a call that got through clears its own pool: the bulk pool
        # back first (an agent's outbox) must not leave a Taint waiting the critical pool's
        # full connect timeout, past its own 800 ms, while that pool still reconnects.
        self._down: set[AsyncConnectionPool] = set()
        # Transactions of blind writes waiting to commit together, per pool (so a Taint's
        # never waits behind bulk ones): by priority.
        self._groups = {
            False: GroupCommit(lambda groups: self._commit_groups(self._bulk, groups)),
            True: GroupCommit(lambda groups: self._commit_groups(self._critical, groups)),
        }

    def _wait_s(self, pool: AsyncConnectionPool) -> float | None:
        """How long a call waits for a pool connection (None: the pool's CONNECT_TIMEOUT_S)."""
        return DOWN_WAIT_S if pool in self._down else None

    def _mark_down(self) -> None:
        self._down = {self._bulk, self._critical}

    def _failure(self, e: Exception) -> StoreError:
        error = failed(self.where, e)
        if isinstance(error, StoreUnavailable):
            self._mark_down()
        return error

    # --- the leader lease and the fence ------------------------------------------------------

    def holder_for(self, advertise: str) -> str:
        """The lease holder this process takes the lease as: its address, and the word that
        names its sessions (so a successor can end them should it stop mid-write)."""
        return f"{advertise} {self.session}"

    def fence_to(self, term: int, holder: str, idle_limit_s: float) -> None:
        """From now on every write is fenced by `term`: it fails unless `holder` holds the
        lease at that term when the write's transaction starts."""
        message = f"{FENCE_TAG}: term {term} no longer holds the leader lease"
        self._fence = (str(max(1, int(idle_limit_s * 1000))), term, holder, message)
        self._fenced_off = ""

    def fence_off(self, why: str) -> None:
        """Refuse every write from now on (a follower, or a leader that stepped down)."""
        self._fence = None
        self._fenced_off = why

    def _check_fence(self) -> None:
        if self._fenced_off:
            raise Fenced(f"database {self.where}: {self._fenced_off}")

    def _refused(self, e: Fenced) -> None:
        why = str(e).removeprefix(f"database {self.where}: ")
        self.fence_off(why)
        self.on_fenced(why)

    async def _lease(self, sql: str, args: Sequence[Any], timeout_s: float) -> list[tuple]:
        """One lease statement on a connection of its own (never waiting behind the pools),
        within `timeout_s` also on the server's side (a lock wait ends there too)."""
        try:
            async with asyncio.timeout(timeout_s):
                if self._lease_conn is None or self._lease_conn.closed:
                    ms = max(2, int(timeout_s * 1000))
                    lock_ms = max(1, int(ms * LOCK_WAIT_SHARE))
                    self._lease_conn = await psycopg.AsyncConnection.connect(
                        self.url,
                        autocommit=True,
                        connect_timeout=int(CONNECT_TIMEOUT_S),
                        application_name=self.session_name,
                        options=f"{EXACT_FLOATS} -c statement_timeout={ms} "
                        f"-c lock_timeout={lock_ms}",
                    )
                cur = await self._lease_conn.execute(params(sql), tuple(args))
                return await cur.fetchall()
        except psycopg.errors.LockNotAvailable as e:  # the statement failed, the connection not
            raise _RowLocked(f"database {self.where}: lease: the row stayed locked ({e})") from e
        except (psycopg.Error, TimeoutError) as e:
            await self._drop_lease_conn()
            if isinstance(e, TimeoutError):
                raise StoreUnavailable(f"database {self.where}: lease: no answer in time") from e
            raise failed(self.where, e) from e

    async def _drop_lease_conn(self) -> None:
        conn, self._lease_conn = self._lease_conn, None
        if conn is not None and not conn.closed:
            await conn.close()

    async def acquire_lease(
        self, holder: str, ttl_s: float, timeout_s: float
    ) -> tuple[bool, int, str, float]:
        """(taken, term, holder, seconds left by the database's clock): the lease taken at the
        next term when it had run out, else who holds it."""
        try:
            rows = await self._lease(ACQUIRE, (holder, ttl_s), timeout_s)
        except _RowLocked:
            # Only a run-out lease's row is locked by ACQUIRE, and a write of its holder held
            # it past the wait: that holder is stopped mid-transaction. End it, take the row.
            await self._end_expired(timeout_s)
            rows = await self._lease(ACQUIRE, (holder, ttl_s), timeout_s)
        [(term, who, left, taken)] = rows
        return bool(taken), int(term), str(who), float(left)

    async def _end_expired(self, timeout_s: float) -> None:
        args = (SESSION_PREFIX, self.session_name)
        try:
            ended = await self._lease(END_EXPIRED, args, timeout_s)
        except StoreError as e:
            # Most likely the role may not end the other replica's sessions (docs/fleet.md).
            log.warning(
                "lease: could not end the sessions of the holder whose lease ran out "
                "(it holds the lease row): %s",
                e,
            )
            raise
        if ended:
            who, term = ended[0][0], ended[0][1]
            log.warning(
                "lease: %s let term %d run out inside a transaction (stopped?): ended "
                "its sessions %s",
                who,
                term,
                [pid for _, _, pid, _ in ended],
            )

    async def renew_lease(self, holder: str, term: int, ttl_s: float, timeout_s: float) -> bool:
        """True when renewed: `ttl_s` from when the database ran it."""
        return bool(await self._lease(RENEW, (ttl_s, term, holder), timeout_s))

    async def lease_holder(self, timeout_s: float) -> tuple[int, str, float]:
        [(term, who, left)] = await self._lease(HOLDER, (), timeout_s)
        return int(term), str(who), float(left)

    # --- opening, transactions, reads --------------------------------------------------------

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
    async def _calling(self) -> AsyncIterator[None]:
        """A call's failures as StoreErrors: the database gone marks the pools down, a fence
        failure makes this process refuse every write from then on."""
        try:
            yield
        except (psycopg.Error, PoolTimeout) as e:
            error = self._failure(e)
            if isinstance(error, Fenced):
                self._refused(error)
            raise error from e
        except StoreUnavailable:
            self._mark_down()
            raise
        except Fenced as e:
            self._refused(e)
            raise

    def _head(self) -> list[Write]:
        # The fence goes out first in every write transaction, in the same trip as its first
        # statement.
        return [] if self._fence is None else [(params(FENCE), self._fence)]

    @asynccontextmanager
    async def transaction(self, priority: bool = False) -> AsyncIterator[Conn]:
        self._check_fence()
        pool = self._critical if priority else self._bulk
        pg = PgConn(lambda: pool.connection(self._wait_s(pool)), self.where, self._head())
        async with self._calling():
            try:
                yield pg
                await pg.commit()
            except BaseException:
                await pg.rollback()
                raise
            finally:
                await pg.close()
        if pg.started:
            self._down.discard(pool)
            return
        writes = pg.blind()
        if writes:
            # Shielded: a caller cancelled now leaves its writes committed with the group,
            # never half sent.
            await asyncio.shield(self._groups[priority](writes))

    def write_stats(self) -> WriteStats:
        pools = (self._bulk, self._critical)
        waiting = sum(p.get_stats().get("requests_waiting", 0) for p in pools)
        commits = {"critical": self._groups[True].trips, "bulk": self._groups[False].trips}
        return WriteStats(waiting, commits)

    async def write(self, sql: str, args: Sequence[Any] = (), priority: bool = False) -> Result:
        self._check_fence()
        pool = self._critical if priority else self._bulk
        statement = (params(sql), tuple(args))
        async with self._calling(), pool.connection(self._wait_s(pool)) as conn:
            if self._fence is None:  # autocommit: one statement, one round trip
                result = await trip(conn, self.where, [statement])
            else:
                # Fenced: BEGIN, the fence, the statement and COMMIT, still one trip.
                async with conn.pipeline(), conn.transaction():
                    await conn.execute(*self._head()[0])
                    cur = await conn.execute(*statement)
                rows = await cur.fetchall() if cur.description else []
                result = Result(rows, cur.rowcount)
        self._down.discard(pool)
        return result

    async def write_later(self, sql: str, args: Sequence[Any] = (), priority: bool = False) -> None:
        self._check_fence()
        await asyncio.shield(self._groups[priority]([(params(sql), tuple(args))]))

    async def _commit_groups(
        self, pool: AsyncConnectionPool, groups: list[list[Write]]
    ) -> list[BaseException | None]:
        """Every waiting group in one trip. A statement the database refused fails that trip
        whole: then each group goes alone, so only the group that holds it is told."""
        try:
            await self._commit_trip(pool, _joined(groups))
            return [None] * len(groups)
        except StoreError as e:
            if isinstance(e, StoreUnavailable | Fenced) or len(groups) == 1:
                return [e] * len(groups)
        out: list[BaseException | None] = []
        for group in groups:
            try:
                await self._commit_trip(pool, _joined([group]))
                out.append(None)
            except StoreError as e:
                out.append(e)
        return out

    async def _commit_trip(self, pool: AsyncConnectionPool, writes: list[Write]) -> None:
        self._check_fence()
        async with self._calling(), pool.connection(self._wait_s(pool)) as conn:
            await commit_trip(conn, self.where, [*self._head(), *writes])
        self._down.discard(pool)

    async def read(self, sql: str, args: Sequence[Any] = ()) -> Result:
        async with self._calling(), self._bulk.connection(self._wait_s(self._bulk)) as conn:
            result = await trip(conn, self.where, [(params(sql), tuple(args))])
        self._down.discard(self._bulk)
        return result

    async def close(self) -> None:
        await self._drop_lease_conn()
        await self._bulk.close()
        await self._critical.close()


def _joined(groups: list[list[Write]]) -> list[Write]:
    """The groups' writes as one transaction's: the events lock once, first, when any group
    inserts events (taken mid-way it could wait on a row another holder of it wants)."""
    writes = [w for group in groups for w in group if w is not LOCK_EVENTS]
    if any(group and group[0] is LOCK_EVENTS for group in groups):
        return [LOCK_EVENTS, *writes]
    return writes
