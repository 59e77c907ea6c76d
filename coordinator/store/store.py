"""The coordinator's store: nodes, taints, lifecycle events, reclamation records, workers,
rentals, desired capacity, avoided node groups, and the drain state rebuild() reads back.

Every query is written once, for both backends. All of it is async and none of it runs on the
event loop. `async with store.transaction():` makes the calls inside it (in the same task) one
transaction, committed or rolled back whole; a call outside one is its own transaction.

Events are idempotent by the agent's uid (docs/design.md invariant 10): storing the same uid twice
stores it once and says so. Ids only grow, so consumers resume with `events_after(id)`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from spotdrain.coordinator.core import timeline
from spotdrain.coordinator.store.backend import Backend, Conn, Result
from spotdrain.coordinator.store.rows import (
    ContractRow,
    DrainRow,
    EventRow,
    ModelRow,
    NewEvent,
    NodeRow,
    StartBackoff,
    TaintRow,
)

_NODE_COLUMNS = (
    "node_id, spot, node_group, gpus_json, registered_at, last_seen, workload_enabled, "
    "provider, spot_pinned"
)
_EVENT_COLUMNS = (
    "id, uid, kind, node_id, reclaim_id, wall_time, t_offset_s, details_json, received_at"
)
_DRAIN_COLUMNS = "node_id, reclaim_id, reason, terminate_at, grace_deadline, started_at, ended_at"
_TAINT_COLUMNS = "node_id, reclaim_id, key, effect, reason, since"
_CONTRACT_COLUMNS = "image, kind, exited, killed, overrun, flagged_at"
EVENTS_PER_TRANSACTION = 100
RECORDS_PER_READ = 500  # reclamation records read in one statement (bound on its parameters)
_INSERT_EVENT = (
    "INSERT INTO events (uid, kind, node_id, reclaim_id, wall_time, t_offset_s, details_json, "
    "received_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(uid) DO NOTHING"
)


def _node_row(r: Sequence[Any]) -> NodeRow:
    gpus = tuple(json.loads(r[3]))
    return NodeRow(r[0], bool(r[1]), r[2], gpus, r[4], r[5], bool(r[6]), r[7], bool(r[8]))


@dataclass
class _Tx:
    store: Store
    conn: Conn
    owner: asyncio.Task[Any] | None
    open: bool = True
    after: list[Callable[[], None]] = field(default_factory=list)
    undo: list[Callable[[], None]] = field(default_factory=list)


_current_tx: ContextVar[_Tx | None] = ContextVar("spotdrain_store_tx", default=None)


class Store:
    def __init__(self, backend: Backend, clock: Callable[[], float] = time.time) -> None:
        self.backend = backend
        self.clock = clock
        self._c = backend.text_order

    @property
    def where(self) -> str:
        return self.backend.where

    async def close(self) -> None:
        await self.backend.close()

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

    # --- nodes -------------------------------------------------------------------------------

    async def upsert_node(
        self,
        node_id: str,
        spot: bool,
        node_group: str,
        gpus: Sequence[dict[str, Any]],
        provider: str = "",
        spot_locked: bool = False,
    ) -> dict[str, Any]:
        """A node's registration. Its spot and provider claims are taken unless something holds
        them: the spot flag when an operator pinned it, the node is rented (invariant 9) or
        `spot_locked` (render jobs on it); the provider while the node is rented (its rentals'
        reputation is that provider's). Returns the claims refused, for the caller to record."""
        now = self.clock()
        async with self.transaction():
            known = await self.node(node_id)
            rented = await self.active_rental_count(node_id) > 0
            refused: dict[str, Any] = {}
            if (
                known is not None
                and known.spot != spot
                and (known.spot_pinned or rented or spot_locked)
            ):
                refused["spot"] = spot
                spot = known.spot
            if known is not None and known.provider != provider and rented:
                refused["provider"] = provider
                provider = known.provider
            await self._write(
                "INSERT INTO nodes (node_id, spot, node_group, gpus_json, registered_at, "
                "last_seen, provider) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(node_id) DO UPDATE "
                "SET spot=excluded.spot, node_group=excluded.node_group, "
                "gpus_json=excluded.gpus_json, last_seen=excluded.last_seen, "
                "provider=excluded.provider",
                (node_id, int(spot), node_group, json.dumps(list(gpus)), now, now, provider),
            )
        return refused

    async def set_spot(self, node_id: str, spot: bool) -> None:
        """An operator's setting of the flag; pinned from then on. The caller checks rentals."""
        await self._defer(
            "UPDATE nodes SET spot=?, spot_pinned=1 WHERE node_id=?", (int(spot), node_id)
        )

    async def touch_node(self, node_id: str) -> None:
        await self._defer("UPDATE nodes SET last_seen=? WHERE node_id=?", (self.clock(), node_id))

    async def nodes(self) -> list[NodeRow]:
        rows = await self._read(f"SELECT {_NODE_COLUMNS} FROM nodes ORDER BY node_id{self._c}")
        return [_node_row(r) for r in rows]

    async def node(self, node_id: str) -> NodeRow | None:
        r = await self._one(f"SELECT {_NODE_COLUMNS} FROM nodes WHERE node_id=?", (node_id,))
        return _node_row(r) if r else None

    async def nodes_needing_recovery(self) -> list[str]:
        """Nodes whose workload is off or that have a drain in progress."""
        rows = await self._read(
            "SELECT node_id FROM nodes WHERE workload_enabled=0 UNION "
            "SELECT node_id FROM node_drains WHERE ended_at IS NULL"
        )
        return sorted(r[0] for r in rows)

    async def set_workload(self, node_id: str, enabled: bool) -> bool:
        """The node's workload flag (the coordinator owns it). Returns whether it changed."""
        now = self.clock()
        async with self.transaction(priority=True):
            cur = await self._write(
                "UPDATE nodes SET workload_enabled=? WHERE node_id=? AND workload_enabled!=?",
                (int(enabled), node_id, int(enabled)),
            )
            if cur.rowcount == 0 and await self.node(node_id) is None:
                # A pause from a node that never registered (it lost the coordinator at boot):
                # the flag still has to be stored, so the node is created disabled.
                await self._write(
                    "INSERT INTO nodes (node_id, spot, node_group, gpus_json, registered_at, "
                    "last_seen, workload_enabled) VALUES (?, 1, 'default', '[]', ?, ?, ?)",
                    (node_id, now, now, int(enabled)),
                )
                return True
            return cur.rowcount > 0

    # --- drains ------------------------------------------------------------------------------

    async def start_drain(
        self, node_id: str, reclaim_id: str, reason: str, terminate_at: float, grace_deadline: float
    ) -> DrainRow:
        """Record a node's drain. Idempotent: the first deadlines stored are kept for good."""
        async with self.transaction(priority=True):
            await self._write(
                "INSERT INTO node_drains VALUES (?, ?, ?, ?, ?, ?, NULL) ON CONFLICT DO NOTHING",
                (node_id, reclaim_id, reason, terminate_at, grace_deadline, self.clock()),
            )
            drain = await self.drain(node_id, reclaim_id)
        assert drain is not None
        return drain

    async def drain(self, node_id: str, reclaim_id: str) -> DrainRow | None:
        row = await self._one(
            f"SELECT {_DRAIN_COLUMNS} FROM node_drains WHERE node_id=? AND reclaim_id=?",
            (node_id, reclaim_id),
        )
        return DrainRow(*row) if row else None

    async def add_drain(self, drain: DrainRow) -> None:
        """A drain the caller knows is new (it holds the node's lock and found none): stored
        with the next trip. `start_drain` is the same when the caller cannot know."""
        await self._defer(
            "INSERT INTO node_drains VALUES (?, ?, ?, ?, ?, ?, NULL) ON CONFLICT DO NOTHING",
            (
                drain.node_id,
                drain.reclaim_id,
                drain.reason,
                drain.terminate_at,
                drain.grace_deadline,
                drain.started_at,
            ),
            priority=True,
        )

    async def end_drain(self, node_id: str, reclaim_id: str) -> None:
        await self._defer(
            "UPDATE node_drains SET ended_at=? WHERE node_id=? AND reclaim_id=? "
            "AND ended_at IS NULL",
            (self.clock(), node_id, reclaim_id),
        )

    async def lifted_drains(self, since: float) -> list[DrainRow]:
        """Drains that ended (were lifted) whose deadline D or end is later than `since`."""
        rows = await self._read(
            f"SELECT {_DRAIN_COLUMNS} FROM node_drains WHERE ended_at IS NOT NULL "
            "AND (terminate_at > ? OR ended_at > ?)",
            (since, since),
        )
        return [DrainRow(*r) for r in rows]

    async def active_drains(self, node_id: str | None = None) -> list[DrainRow]:
        sql = f"SELECT {_DRAIN_COLUMNS} FROM node_drains WHERE ended_at IS NULL"
        args: tuple[Any, ...] = ()
        if node_id is not None:
            sql += " AND node_id=?"
            args = (node_id,)
        rows = await self._read(
            sql + f" ORDER BY started_at, node_id{self._c}, reclaim_id{self._c}", args
        )
        return [DrainRow(*r) for r in rows]

    # --- workers -----------------------------------------------------------------------------

    async def save_worker(
        self,
        worker_id: str,
        node_id: str,
        model: str,
        state: str,
        created_at: float,
        doc: dict[str, Any],
    ) -> None:
        await self._defer(
            "INSERT INTO workers (worker_id, node_id, model, state, doc_json, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(worker_id) DO UPDATE SET "
            "state=excluded.state, doc_json=excluded.doc_json",
            (worker_id, node_id, model, state, json.dumps(doc, sort_keys=True), created_at),
        )

    async def worker_docs(
        self, node_id: str | None = None, model: str | None = None, live_only: bool = False
    ) -> list[dict[str, Any]]:
        sql, args = "SELECT doc_json FROM workers WHERE 1=1", []
        if node_id is not None:
            sql += " AND node_id=?"
            args.append(node_id)
        if model is not None:
            sql += " AND model=?"
            args.append(model)
        if live_only:
            sql += " AND state!='stopped'"
        rows = await self._read(sql + f" ORDER BY created_at, worker_id{self._c}", args)
        return [json.loads(r[0]) for r in rows]

    # --- drain state that outlives the process -----------------------------------------------

    async def add_replace_on_stop(self, worker_id: str, doc: dict[str, Any]) -> None:
        await self._defer(
            "INSERT INTO replace_on_stop VALUES (?, ?) ON CONFLICT DO NOTHING",
            (worker_id, json.dumps(doc, sort_keys=True)),
        )

    async def pop_replace_on_stop(self, worker_id: str) -> dict[str, Any] | None:
        async with self.transaction():
            row = await self._one(
                "SELECT doc_json FROM replace_on_stop WHERE worker_id=?", (worker_id,)
            )
            if row is None:
                return None
            await self._write("DELETE FROM replace_on_stop WHERE worker_id=?", (worker_id,))
        return json.loads(row[0])

    async def replace_on_stop(self) -> dict[str, dict[str, Any]]:
        rows = await self._read("SELECT worker_id, doc_json FROM replace_on_stop")
        return {r[0]: json.loads(r[1]) for r in rows}

    async def set_start_backoff(self, model: str, failures: int, retry_at: float) -> None:
        await self._defer(
            "INSERT INTO start_backoff VALUES (?, ?, ?) ON CONFLICT(model) DO UPDATE SET "
            "failures=excluded.failures, retry_at=excluded.retry_at",
            (model, failures, retry_at),
        )

    async def clear_start_backoff(self, model: str) -> None:
        await self._defer("DELETE FROM start_backoff WHERE model=?", (model,))

    async def start_backoffs(self) -> dict[str, StartBackoff]:
        rows = await self._read("SELECT model, failures, retry_at FROM start_backoff")
        return {r[0]: StartBackoff(*r) for r in rows}

    async def add_missing_rental(self, rental_id: str, since: float) -> None:
        """Kept from the first time it was missed: the grace is counted from then."""
        await self._defer(
            "INSERT INTO missing_rentals VALUES (?, ?) ON CONFLICT DO NOTHING", (rental_id, since)
        )

    async def drop_missing_rental(self, rental_id: str) -> None:
        await self._defer("DELETE FROM missing_rentals WHERE rental_id=?", (rental_id,))

    async def missing_rentals(self) -> dict[str, float]:
        rows = await self._read("SELECT rental_id, since FROM missing_rentals")
        return {r[0]: r[1] for r in rows}

    # --- rentals -----------------------------------------------------------------------------

    async def save_rental(
        self, rental_id: str, node_id: str, ended_at: float | None, doc: dict[str, Any]
    ) -> None:
        await self._defer(
            "INSERT INTO rentals (rental_id, node_id, ended_at, doc_json, started_at) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT(rental_id) DO UPDATE SET "
            "ended_at=excluded.ended_at, doc_json=excluded.doc_json",
            (
                rental_id,
                node_id,
                ended_at,
                json.dumps(doc, sort_keys=True),
                float(doc.get("started_at", 0.0)),
            ),
        )

    async def rental_doc(self, rental_id: str) -> dict[str, Any] | None:
        row = await self._one("SELECT doc_json FROM rentals WHERE rental_id=?", (rental_id,))
        return json.loads(row[0]) if row else None

    async def rental_docs(
        self, node_id: str | None = None, holding_only: bool = False
    ) -> list[dict[str, Any]]:
        """Rentals, oldest first; `holding_only`: those holding their node's GPUs."""
        sql, args = "SELECT doc_json FROM rentals WHERE 1=1", []
        if node_id is not None:
            sql += " AND node_id=?"
            args.append(node_id)
        if holding_only:
            sql += " AND ended_at IS NULL"
        rows = await self._read(sql + f" ORDER BY started_at, rental_id{self._c}", args)
        return [json.loads(r[0]) for r in rows]

    async def active_rental_count(self, node_id: str) -> int:
        """Rentals holding the node (an ended one counts until its container has stopped)."""
        row = await self._one(
            "SELECT COUNT(*) FROM rentals WHERE node_id=? AND ended_at IS NULL", (node_id,)
        )
        return int(row[0]) if row else 0

    # --- desired capacity and avoided groups -------------------------------------------------

    async def set_model(self, model: str, replicas: int, image: str, slots: int) -> ModelRow:
        await self._defer(
            "INSERT INTO models VALUES (?, ?, ?, ?) ON CONFLICT(model) DO UPDATE SET "
            "replicas=excluded.replicas, image=excluded.image, slots=excluded.slots",
            (model, replicas, image, slots),
        )
        return ModelRow(model, replicas, image, slots)

    async def models(self) -> list[ModelRow]:
        rows = await self._read(
            f"SELECT model, replicas, image, slots FROM models ORDER BY model{self._c}"
        )
        return [ModelRow(*r) for r in rows]

    async def model(self, model: str) -> ModelRow | None:
        r = await self._one(
            "SELECT model, replicas, image, slots FROM models WHERE model=?", (model,)
        )
        return ModelRow(*r) if r else None

    async def avoid_group(self, node_group: str, until: float) -> float:
        """Avoid the group until `until`, or longer if it already is; never shortened."""
        async with self.transaction():
            await self._write(
                "INSERT INTO avoided_groups VALUES (?, ?) ON CONFLICT(node_group) DO UPDATE SET "
                "until = CASE WHEN excluded.until > avoided_groups.until "
                "THEN excluded.until ELSE avoided_groups.until END",
                (node_group, until),
            )
            row = await self._one(
                "SELECT until FROM avoided_groups WHERE node_group=?", (node_group,)
            )
        assert row is not None
        return float(row[0])

    async def avoid_group_later(self, node_group: str, until: float) -> None:
        """`avoid_group` when the caller knows the window already (it keeps them in memory)."""
        await self._defer(
            "INSERT INTO avoided_groups VALUES (?, ?) ON CONFLICT(node_group) DO UPDATE SET "
            "until = CASE WHEN excluded.until > avoided_groups.until "
            "THEN excluded.until ELSE avoided_groups.until END",
            (node_group, until),
        )

    async def avoided_groups(self, now: float) -> dict[str, float]:
        """Groups avoided at `now`, with when their window ends."""
        rows = await self._read(
            "SELECT node_group, until FROM avoided_groups WHERE until > ?", (now,)
        )
        return {g: t for g, t in rows}

    # --- nodes at risk (advisories) ----------------------------------------------------------

    async def set_risk_later(
        self, node_id: str, key: str, source: str, reason: str, until: float
    ) -> None:
        """A node's advisory; the same key again keeps its first window (it is one advisory)."""
        await self._defer(
            "INSERT INTO node_risks VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT(node_id, advisory_key) DO NOTHING",
            (node_id, key, source, reason, until),
        )

    async def clear_risk_later(self, node_id: str, key: str) -> None:
        await self._defer(
            "DELETE FROM node_risks WHERE node_id = ? AND advisory_key = ?", (node_id, key)
        )

    async def node_risks(self, now: float) -> list[tuple[str, str, str, str, float]]:
        """(node, key, source, reason, until) of every advisory still in force at `now`."""
        rows = await self._read(
            "SELECT node_id, advisory_key, source, reason, until FROM node_risks "
            "WHERE until > ? ORDER BY node_id, advisory_key",
            (now,),
        )
        return [tuple(r) for r in rows]

    # --- taints ------------------------------------------------------------------------------

    async def add_taint(self, node_id: str, reclaim_id: str, reason: str) -> None:
        """Idempotent: the same reclamation's taint is stored once, with its first time."""
        await self._defer(
            "INSERT INTO taints VALUES (?, ?, 'spotdrain.io/reclaim', 'NoSchedule', ?, ?) "
            "ON CONFLICT DO NOTHING",
            (node_id, reclaim_id, reason, self.clock()),
            priority=True,
        )

    async def remove_taint(self, node_id: str, reclaim_id: str) -> None:
        await self._defer(
            "DELETE FROM taints WHERE node_id=? AND reclaim_id=?",
            (node_id, reclaim_id),
            priority=True,
        )

    async def taints(self, node_id: str) -> list[TaintRow]:
        rows = await self._read(
            f"SELECT {_TAINT_COLUMNS} FROM taints WHERE node_id=? "
            f"ORDER BY since, reclaim_id{self._c}",
            (node_id,),
        )
        return [TaintRow(*r) for r in rows]

    async def all_taints(self) -> dict[str, list[TaintRow]]:
        """Every node's taints in one read (rebuild and listings, never one query a node)."""
        rows = await self._read(
            f"SELECT {_TAINT_COLUMNS} FROM taints "
            f"ORDER BY node_id{self._c}, since, reclaim_id{self._c}"
        )
        out: dict[str, list[TaintRow]] = {}
        for r in rows:
            out.setdefault(r[0], []).append(TaintRow(*r))
        return out

    # --- events ------------------------------------------------------------------------------

    async def add_event(
        self,
        uid: str,
        kind: str,
        node_id: str,
        reclaim_id: str,
        wall_time: float,
        t_offset_s: float | None,
        details: dict[str, Any],
    ) -> int | None:
        """Store one event and fold it into its reclamation. None: this uid was stored before."""
        ids = await self.add_events(
            [NewEvent(uid, kind, node_id, reclaim_id, wall_time, t_offset_s, details)]
        )
        return ids[0]

    async def add_events(self, events: Sequence[NewEvent], fresh: bool = False) -> list[int | None]:
        """Store a batch in order, each event folded into its reclamation; the id of each, or
        None for a uid stored before. A large batch is several short transactions, so a Taint
        waits for at most one of them; a crash between two leaves the agent's batch
        unacknowledged and resent whole, and the uids already stored are stored once."""
        ids: list[int | None] = []
        for start in range(0, len(events), EVENTS_PER_TRANSACTION):
            chunk = events[start : start + EVENTS_PER_TRANSACTION]
            ids += await (self._add_fresh(chunk) if fresh else self._add_events(chunk))
        return ids

    async def _add_fresh(self, events: Sequence[NewEvent]) -> list[int | None]:
        """Events whose uids were never used (the coordinator's own): inserted with the next
        trip, without waiting for their ids."""
        async with self.transaction():
            tx = self._tx()
            assert tx is not None
            tx.conn.serialize_events()
            records = await self._records_of(events)
            for ev in events:
                tx.conn.defer(_INSERT_EVENT, self._event_args(ev, self.clock()))
                if ev.reclaim_id:
                    await self._fold(records, ev)
            await self._save_records(records)
        return [None] * len(events)

    def _event_args(self, ev: NewEvent, received: float) -> tuple[Any, ...]:
        details = ev.details_json
        if details is None:
            details = json.dumps(ev.details, sort_keys=True)
        return (ev.uid, ev.kind, ev.node_id, ev.reclaim_id, ev.wall_time, ev.t_offset_s, details,
                received)  # fmt: skip

    async def _save_records(self, records: dict[str, dict[str, Any] | None]) -> None:
        for reclaim_id, record in records.items():
            if record is not None:
                await self._defer(
                    "INSERT INTO reclamations VALUES (?, ?, ?, ?) ON CONFLICT(reclaim_id) "
                    "DO UPDATE SET record_json=excluded.record_json, "
                    "started_at=excluded.started_at",
                    (reclaim_id, record["node_id"], json.dumps(record), record["_started"]),
                )

    async def _add_events(self, events: Sequence[NewEvent]) -> list[int | None]:
        ids: list[int | None] = []
        received = self.clock()
        async with self.transaction():
            tx = self._tx()
            assert tx is not None
            tx.conn.serialize_events()
            records = await self._records_of(events)
            returned = await tx.conn.execute_each(
                _INSERT_EVENT + " RETURNING id",
                [self._event_args(ev, received) for ev in events],
            )
            for ev, row in zip(events, returned, strict=True):
                ids.append(int(row[0]) if row else None)
                if row and ev.reclaim_id:
                    await self._fold(records, ev)
            await self._save_records(records)
        return ids

    async def _records_of(self, events: Sequence[NewEvent]) -> dict[str, dict[str, Any] | None]:
        """The reclamation records these events fold into, in one read (None: none yet). One
        trip per transaction, not one per reclamation: inside a transaction every read holds
        the writer, and a hundred of them in a row (a mass reclamation's replacement events)
        kept the Taints' commits waiting."""
        found: dict[str, dict[str, Any] | None] = dict.fromkeys(
            ev.reclaim_id for ev in events if ev.reclaim_id
        )
        found.update(await self._reclamations(list(found)))
        return found

    async def _fold(self, records: dict[str, dict[str, Any] | None], ev: NewEvent) -> None:
        record = records[ev.reclaim_id]  # read beforehand, all at once (_records_of)
        if record is None:
            record = records[ev.reclaim_id] = timeline.new_record(ev.reclaim_id, ev.node_id)
        if record["node_id"] != ev.node_id:
            return  # another node's reclamation: a node touches only its own records
        timeline.fold(record, ev.kind, ev.wall_time, ev.details)
        record["_started"] = record["t0"] or record.get("_started") or ev.wall_time
        for image, kind, end in record.pop("_contract", []):
            await self._count_contract_later(image, kind, end)

    # --- workload contracts --------------------------------------------------------------------

    async def _count_contract_later(self, image: str, kind: str, end: str) -> None:
        column = {"exited": "exited", "killed": "killed", "overrun": "overrun"}[end]
        await self._defer(
            "INSERT INTO workload_contracts VALUES (?, ?, 0, 0, 0, NULL) ON CONFLICT DO NOTHING",
            (image, kind),
        )
        await self._defer(
            f"UPDATE workload_contracts SET {column} = {column} + 1 WHERE image = ? AND kind = ?",
            (image, kind),
        )

    async def contracts(self) -> list[ContractRow]:
        rows = await self._read(
            f"SELECT {_CONTRACT_COLUMNS} FROM workload_contracts "
            f"ORDER BY image{self._c}, kind{self._c}"
        )
        return [ContractRow(*r) for r in rows]

    async def flag_contract(self, image: str, kind: str, at: float) -> bool:
        """Mark an image's contract flagged; False when it was flagged already (once only)."""
        result = await self._write(
            "UPDATE workload_contracts SET flagged_at = ? "
            "WHERE image = ? AND kind = ? AND flagged_at IS NULL",
            (at, image, kind),
        )
        return result.rowcount > 0

    async def events_after(self, from_id: int, limit: int = 1000) -> list[EventRow]:
        rows = await self._read(
            f"SELECT {_EVENT_COLUMNS} FROM events WHERE id > ? ORDER BY id LIMIT ?",
            (from_id, limit),
        )
        return [EventRow(*r) for r in rows]

    async def events_of(self, reclaim_id: str) -> list[EventRow]:
        rows = await self._read(
            f"SELECT {_EVENT_COLUMNS} FROM events WHERE reclaim_id=? ORDER BY wall_time, id",
            (reclaim_id,),
        )
        return [EventRow(*r) for r in rows]

    async def last_event_id(self) -> int:
        row = await self._one("SELECT COALESCE(MAX(id), 0) FROM events")
        return int(row[0]) if row else 0

    # --- reclamations ------------------------------------------------------------------------

    async def reclamation(self, reclaim_id: str) -> dict[str, Any] | None:
        """The record of `reclaim_id`, or the latest one when it is empty."""
        record = await self._reclamation(reclaim_id)
        if record is not None:
            del record["_started"]
        return record

    async def reclamations(self, reclaim_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The records of these reclamations that exist, by id, in one read."""
        found = await self._reclamations(reclaim_ids)
        for record in found.values():
            del record["_started"]
        return found

    async def _reclamations(self, reclaim_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        ids = list(dict.fromkeys(reclaim_ids))
        for start in range(0, len(ids), RECORDS_PER_READ):
            part = ids[start : start + RECORDS_PER_READ]
            rows = await self._read(
                "SELECT reclaim_id, record_json, started_at FROM reclamations "
                f"WHERE reclaim_id IN ({', '.join('?' * len(part))})",
                part,
            )
            for reclaim_id, record_json, started_at in rows:
                record = found[reclaim_id] = json.loads(record_json)
                record["_started"] = started_at
        return found

    async def _reclamation(self, reclaim_id: str) -> dict[str, Any] | None:
        # With `_started`, the sort key kept beside the record, for the fold to write back.
        if reclaim_id:
            return (await self._reclamations([reclaim_id])).get(reclaim_id)
        row = await self._one(
            "SELECT record_json, started_at FROM reclamations "
            f"ORDER BY started_at DESC, reclaim_id{self._c} DESC LIMIT 1"
        )
        if row is None:
            return None
        record = json.loads(row[0])
        record["_started"] = row[1]
        return record

    async def reclamations_page(
        self, before: tuple[float, str] | None = None, limit: int = 50
    ) -> list[tuple[dict[str, Any], float]]:
        """One page of reclamations, newest first: at most `limit`, each with its sort key
        (started_at), all older than `before` (started_at, reclaim_id) when given. Keyset
        pagination, never OFFSET; read on a reader connection, off the writer."""
        order = f"ORDER BY started_at DESC, reclaim_id{self._c} DESC LIMIT ?"
        if before is None:
            rows = await self._read(f"SELECT record_json, started_at FROM reclamations {order}",
                                    (limit,))  # fmt: skip
        else:
            rows = await self._read(
                "SELECT record_json, started_at FROM reclamations WHERE started_at < ? "
                f"OR (started_at = ? AND reclaim_id{self._c} < ?) {order}",
                (before[0], before[0], before[1], limit),
            )
        records = [json.loads(r[0]) for r in rows]
        # Without the fold's own bookkeeping (`_started`, `_contract`).
        return [({k: v for k, v in rec.items() if not k.startswith("_")}, r[1])
                for rec, r in zip(records, rows, strict=True)]  # fmt: skip
