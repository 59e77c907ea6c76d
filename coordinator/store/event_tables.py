"""Events (idempotent by the agent's uid, docs/design.md invariant 10), the reclamation records
folded from them in the same transaction, and workload contracts counted from them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from spotdrain.coordinator.core import timeline
from spotdrain.coordinator.store.rows import (
    ContractRow,
    EventRow,
    NewEvent,
)
from spotdrain.coordinator.store.transactions import Transactions

# EventRow's field order (its EventHead first).
_EVENT_COLUMNS = (
    "uid, kind, node_id, reclaim_id, wall_time, t_offset_s, id, details_json, received_at"
)
_CONTRACT_COLUMNS = "image, kind, exited, killed, overrun, flagged_at"
EVENTS_PER_TRANSACTION = 100
RECORDS_PER_READ = 500  # reclamation records read in one statement (bound on its parameters)
_INSERT_EVENT = (
    "INSERT INTO events (uid, kind, node_id, reclaim_id, wall_time, t_offset_s, details_json, "
    "received_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(uid) DO NOTHING"
)


class EventTables(Transactions):
    # --- events ------------------------------------------------------------------------------

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
        return (
            ev.uid,
            ev.kind,
            ev.node_id,
            ev.reclaim_id,
            ev.wall_time,
            ev.t_offset_s,
            details,
            received,
        )

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

    async def open_lost_nodes(self, prefix: str) -> dict[str, str]:
        """Nodes lost and not back: node -> the id of its latest lost record (ids start with
        `prefix`) that has no `node_returned` step. Read at rebuild only."""
        rows = await self._read(
            "SELECT reclaim_id, node_id, record_json, started_at FROM reclamations "
            "WHERE reclaim_id LIKE ? ORDER BY started_at",
            (prefix + "%",),
        )
        lost: dict[str, str] = {}
        for reclaim_id, node_id, record_json, _ in rows:
            if "node_returned" in json.loads(record_json).get("steps", {}):
                lost.pop(node_id, None)
            else:
                lost[node_id] = reclaim_id
        return lost

    async def reclamations_page(
        self, before: tuple[float, str] | None = None, limit: int = 50
    ) -> list[tuple[dict[str, Any], float]]:
        """One page of reclamations, newest first: at most `limit`, each with its sort key
        (started_at), all older than `before` (started_at, reclaim_id) when given. Keyset
        pagination, never OFFSET; read on a reader connection, off the writer."""
        order = f"ORDER BY started_at DESC, reclaim_id{self._c} DESC LIMIT ?"
        if before is None:
            rows = await self._read(
                f"SELECT record_json, started_at FROM reclamations {order}", (limit,)
            )
        else:
            rows = await self._read(
                "SELECT record_json, started_at FROM reclamations WHERE started_at < ? "
                f"OR (started_at = ? AND reclaim_id{self._c} < ?) {order}",
                (before[0], before[0], before[1], limit),
            )
        records = [json.loads(r[0]) for r in rows]
        # Without the fold's own bookkeeping (`_started`, `_contract`).
        return [
            ({k: v for k, v in rec.items() if not k.startswith("_")}, r[1])
            for rec, r in zip(records, rows, strict=True)
        ]
