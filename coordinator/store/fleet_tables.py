"""The fleet's tables: nodes, drains, nodes at risk and taints."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from spotdrain.coordinator.store.rows import (
    DrainRow,
    NodeRow,
    TaintRow,
)
from spotdrain.coordinator.store.transactions import Transactions

_NODE_COLUMNS = (
    "node_id, spot, node_group, gpus_json, registered_at, last_seen, workload_enabled, "
    "provider, spot_pinned, managers_json, cloud_json"
)
_DRAIN_COLUMNS = "node_id, reclaim_id, reason, terminate_at, grace_deadline, started_at, ended_at"
_TAINT_COLUMNS = "node_id, reclaim_id, key, effect, reason, since"


def _node_row(r: Sequence[Any]) -> NodeRow:
    gpus = tuple(json.loads(r[3]))
    managers = tuple(json.loads(r[9]))
    cloud = json.loads(r[10]) if r[10] else None
    return NodeRow(
        r[0], bool(r[1]), r[2], gpus, r[4], r[5], bool(r[6]), r[7], bool(r[8]), managers, cloud
    )


class FleetTables(Transactions):
    # --- nodes -------------------------------------------------------------------------------

    async def upsert_node(
        self,
        node_id: str,
        spot: bool,
        node_group: str,
        gpus: Sequence[dict[str, Any]],
        provider: str = "",
        spot_locked: bool = False,
        managers: Sequence[dict[str, str]] = (),
        cloud: dict[str, Any] | None = None,
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
                "last_seen, provider, managers_json, cloud_json) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(node_id) DO UPDATE "
                "SET spot=excluded.spot, node_group=excluded.node_group, "
                "gpus_json=excluded.gpus_json, last_seen=excluded.last_seen, "
                "provider=excluded.provider, managers_json=excluded.managers_json, "
                # A registration without one keeps the identity read before (an agent
                # restarted before its metadata service answered is the same instance).
                "cloud_json=coalesce(excluded.cloud_json, nodes.cloud_json)",
                (
                    node_id,
                    int(spot),
                    node_group,
                    json.dumps(list(gpus)),
                    now,
                    now,
                    provider,
                    json.dumps(list(managers)),
                    None if cloud is None else json.dumps(cloud),
                ),
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
