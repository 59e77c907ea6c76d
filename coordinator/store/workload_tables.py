"""The workloads' tables: workers, the drain state that outlives the process, rentals, desired
capacity and avoided node groups."""

from __future__ import annotations

import json
from typing import Any

from spotdrain.coordinator.store.rows import (
    ModelRow,
    StartBackoff,
)
from spotdrain.coordinator.store.transactions import Transactions


class WorkloadTables(Transactions):
    async def _docs(
        self, table: str, equal: dict[str, str | None], where: str, order: str
    ) -> list[dict[str, Any]]:
        """The documents of `table`'s rows whose columns equal `equal`'s values (None: any) and
        that meet `where` (SQL of our own, "" for none), in `order`."""
        sql, args = f"SELECT doc_json FROM {table} WHERE 1=1", []
        for column, value in equal.items():
            if value is not None:
                sql += f" AND {column}=?"
                args.append(value)
        if where:
            sql += f" AND {where}"
        rows = await self._read(sql + f" ORDER BY {order}{self._c}", args)
        return [json.loads(r[0]) for r in rows]

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
        live = "state!='stopped'" if live_only else ""
        equal = {"node_id": node_id, "model": model}
        return await self._docs("workers", equal, live, "created_at, worker_id")

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
        holding = "ended_at IS NULL" if holding_only else ""
        return await self._docs("rentals", {"node_id": node_id}, holding, "started_at, rental_id")

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
