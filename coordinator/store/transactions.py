"""The store's transactions: `async with store.transaction():` makes the calls inside it (in the
same task) one transaction on one connection; a call outside one is its own. The tables'
modules (fleet_tables, workload_tables, event_tables) read and write only through these."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from spotdrain.coordinator.store.backend import Backend, Conn, Result


@dataclass
class _Tx:
    store: Transactions
    conn: Conn
    owner: asyncio.Task[Any] | None
    open: bool = True
    after: list[Callable[[], None]] = field(default_factory=list)
    undo: list[Callable[[], None]] = field(default_factory=list)


@dataclass(frozen=True)
class StoreStats:
    """What the store has done, from its public interface (the contract suite reads this, never
    a backend's fields): the same on every backend."""

    reads: int  # statements read through the store since it opened (one trip each)
    waiting_writers: int  # transactions queued for the write path now
    group_commits: Mapping[str, int]  # "critical", "bulk": trips made for blind transactions


_current_tx: ContextVar[_Tx | None] = ContextVar("spotdrain_store_tx", default=None)


class Transactions:
    def __init__(self, backend: Backend, clock: Callable[[], float] = time.time) -> None:
        self.backend = backend
        self.clock = clock
        self._c = backend.text_order
        self._reads = 0

    @property
    def where(self) -> str:
        return self.backend.where

    async def close(self) -> None:
        await self.backend.close()

    def stats(self) -> StoreStats:
        writes = self.backend.write_stats()
        return StoreStats(self._reads, writes.waiting, dict(writes.group_commits))

    # --- transactions ------------------------------------------------------------------------

    def _tx(self) -> _Tx | None:
        # Only the task that opened the transaction uses it: a task it spawned inherits the
        # context variable, but must not write on its connection (or after it closed).
        tx = _current_tx.get()
        if tx is None or not tx.open or tx.store is not self:
            return None
        return tx if tx.owner is asyncio.current_task() else None

    @asynccontextmanager
    async def transaction(self, priority: bool = False) -> AsyncIterator[None]:
        """Everything inside commits or rolls back as one; nested blocks join the outer one."""
        if self._tx() is not None:
            yield
            return
        tx: _Tx | None = None
        try:
            async with self.backend.transaction(priority) as conn:
                tx = _Tx(self, conn, asyncio.current_task())
                token = _current_tx.set(tx)
                try:
                    yield
                finally:
                    tx.open = False
                    _current_tx.reset(token)
        except BaseException:
            for undo in reversed(tx.undo if tx is not None else []):  # rolled back
                undo()
            raise
        for callback in tx.after:  # committed
            callback()

    def after_commit(self, callback: Callable[[], None]) -> None:
        """Run `callback` once the current transaction has committed (now, outside one). What
        is told to an agent (start this worker) is then never ahead of what is stored."""
        tx = self._tx()
        if tx is None:
            callback()
        else:
            tx.after.append(callback)

    def on_rollback(self, undo: Callable[[], None]) -> None:
        """Run `undo` if the current transaction rolls back (nothing outside one): memory that a
        transaction changed before its commit (a drain it started) is put back, so it is never
        ahead of the store (a retry would take the drain as stored and store nothing)."""
        tx = self._tx()
        if tx is not None:
            tx.undo.append(undo)

    async def _read(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        tx = self._tx()
        self._reads += 1
        result = await (tx.conn.execute(sql, args) if tx else self.backend.read(sql, args))
        return result.rows

    async def _write(self, sql: str, args: Sequence[Any] = ()) -> Result:
        """A write whose result (rowcount, RETURNING) the caller needs."""
        tx = self._tx()
        if tx is not None:
            return await tx.conn.execute(sql, args)
        return await self.backend.write(sql, args)

    async def _defer(self, sql: str, args: Sequence[Any] = (), priority: bool = False) -> None:
        """A write nobody waits on the result of: in a transaction it goes out with the next
        statement or the commit; outside one it is one statement of its own."""
        tx = self._tx()
        if tx is not None:
            tx.conn.defer(sql, args)
        else:
            await self.backend.write_later(sql, args, priority)

    async def _one(self, sql: str, args: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        rows = await self._read(sql, args)
        return rows[0] if rows else None
