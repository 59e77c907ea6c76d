"""The coordinator's SQLite store: nodes, taints, lifecycle events, reclamation records, workers,
rentals, desired capacity per model and avoided node groups.

One file, WAL, schema versioned. Events are idempotent by the agent's uid (DESIGN.md invariant
10): storing the same uid twice stores it once and says so. Ids only grow, so consumers resume
with `events_after(id)`.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotdrain.coordinator import timeline

SCHEMA_VERSION = 3

SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE nodes (
    node_id TEXT PRIMARY KEY,
    spot INTEGER NOT NULL,
    node_group TEXT NOT NULL,
    gpus_json TEXT NOT NULL,
    registered_at REAL NOT NULL,
    last_seen REAL NOT NULL
);
CREATE TABLE taints (
    node_id TEXT NOT NULL,
    reclaim_id TEXT NOT NULL,
    key TEXT NOT NULL,
    effect TEXT NOT NULL,
    reason TEXT NOT NULL,
    since REAL NOT NULL,
    PRIMARY KEY (node_id, reclaim_id)
);
CREATE TABLE events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    uid TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    node_id TEXT NOT NULL,
    reclaim_id TEXT NOT NULL,
    wall_time REAL NOT NULL,
    t_offset_s REAL,
    details_json TEXT NOT NULL,
    received_at REAL NOT NULL
);
CREATE INDEX events_by_reclaim ON events (reclaim_id, id);
CREATE TABLE reclamations (
    reclaim_id TEXT PRIMARY KEY,
    node_id TEXT NOT NULL,
    record_json TEXT NOT NULL,
    started_at REAL NOT NULL
);
"""

# Each migration takes the schema from version N to N + 1; a new database runs them all.
MIGRATIONS: dict[int, str] = {
    1: """
ALTER TABLE nodes ADD COLUMN workload_enabled INTEGER NOT NULL DEFAULT 1;
CREATE TABLE workers (
    worker_id TEXT PRIMARY KEY,
    node_id TEXT NOT NULL,
    model TEXT NOT NULL,
    state TEXT NOT NULL,
    doc_json TEXT NOT NULL
);
CREATE INDEX workers_by_node ON workers (node_id, state);
CREATE INDEX workers_by_model ON workers (model, state);
-- A node's drain in progress (pause or notice): the deadlines the agent computed, stored once.
CREATE TABLE node_drains (
    node_id TEXT NOT NULL,
    reclaim_id TEXT NOT NULL,
    reason TEXT NOT NULL,
    terminate_at REAL NOT NULL,
    grace_deadline REAL NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL,
    PRIMARY KEY (node_id, reclaim_id)
);
""",
    2: """
-- The node's owner, whose reputation its rentals count for ('' until the agent says).
ALTER TABLE nodes ADD COLUMN provider TEXT NOT NULL DEFAULT '';
-- 1 once an operator set the spot flag: the agent's own claim no longer overrides it.
ALTER TABLE nodes ADD COLUMN spot_pinned INTEGER NOT NULL DEFAULT 0;
-- ended_at stays NULL while the rental holds its GPUs (active, or ended with its container not
-- yet reported stopped): the index finds what a node has booked.
CREATE TABLE rentals (
    rental_id TEXT PRIMARY KEY,
    node_id TEXT NOT NULL,
    ended_at REAL,
    doc_json TEXT NOT NULL
);
CREATE INDEX rentals_by_node ON rentals (node_id, ended_at);
CREATE TABLE models (
    model TEXT PRIMARY KEY,
    replicas INTEGER NOT NULL,
    image TEXT NOT NULL,
    slots INTEGER NOT NULL
);
-- A reclaimed node group gets no new placements and no acquisitions until `until`.
CREATE TABLE avoided_groups (
    node_group TEXT PRIMARY KEY,
    until REAL NOT NULL
);
""",
}


class StoreError(Exception):
    pass


@dataclass(frozen=True)
class EventRow:
    id: int
    uid: str
    kind: str
    node_id: str
    reclaim_id: str
    wall_time: float
    t_offset_s: float | None
    details_json: str
    received_at: float


@dataclass(frozen=True)
class TaintRow:
    node_id: str
    reclaim_id: str
    key: str
    effect: str
    reason: str
    since: float


@dataclass(frozen=True)
class NodeRow:
    node_id: str
    spot: bool
    node_group: str
    gpus: list[dict[str, Any]]
    registered_at: float
    last_seen: float
    workload_enabled: bool = True
    provider: str = ""
    spot_pinned: bool = False

    @property
    def owner(self) -> str:
        """The provider its rentals count for: the node itself when the agent names none."""
        return self.provider or self.node_id


@dataclass(frozen=True)
class ModelRow:
    model: str
    replicas: int
    image: str
    slots: int


_NODE_COLUMNS = (
    "node_id, spot, node_group, gpus_json, registered_at, last_seen, workload_enabled, "
    "provider, spot_pinned"
)


def _node_row(r: tuple[Any, ...]) -> NodeRow:
    return NodeRow(
        r[0], bool(r[1]), r[2], json.loads(r[3]), r[4], r[5], bool(r[6]), r[7], bool(r[8])
    )


@dataclass(frozen=True)
class DrainRow:
    node_id: str
    reclaim_id: str
    reason: str
    terminate_at: float
    grace_deadline: float
    started_at: float
    ended_at: float | None


class Store:
    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time) -> None:
        self.path = str(path)
        self.clock = clock
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode survives a process crash (our SIGKILL tests); only a power
            # loss can drop the last transactions.
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("PRAGMA busy_timeout=5000")
            self._migrate()
        except sqlite3.DatabaseError as e:
            raise StoreError(f"database {self.path}: {e}") from e

    def _migrate(self) -> None:
        has_meta = self.db.execute(
            "SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'"
        ).fetchone()
        if not has_meta:
            # executescript runs the base schema and its version stamp as one transaction.
            self.db.executescript(
                f"BEGIN; {SCHEMA} INSERT INTO meta VALUES ('schema_version', '1'); COMMIT;"
            )
        row = self.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        version = int(row[0]) if row else 0
        if version > SCHEMA_VERSION or version < 1:
            raise StoreError(
                f"database {self.path} has schema version {version}, this coordinator "
                f"knows 1 to {SCHEMA_VERSION}"
            )
        while version < SCHEMA_VERSION:
            self.db.executescript(
                f"BEGIN; {MIGRATIONS[version]} UPDATE meta SET value='{version + 1}' "
                "WHERE key='schema_version'; COMMIT;"
            )
            version += 1

    def _tx(self) -> _Tx:
        return _Tx(self.db)

    def close(self) -> None:
        self.db.close()

    # --- nodes -------------------------------------------------------------------------------

    def upsert_node(
        self,
        node_id: str,
        spot: bool,
        node_group: str,
        gpus: list[dict[str, Any]],
        provider: str = "",
        spot_locked: bool = False,
    ) -> dict[str, Any]:
        """A node's registration. Its spot and provider claims are taken unless something holds
        them: the spot flag when an operator pinned it, the node is rented (invariant 9) or
        `spot_locked` (render jobs on it); the provider while the node is rented (its rentals'
        reputation is that provider's). Returns the claims refused, for the caller to record."""
        now = self.clock()
        with self._tx():
            known = self.node(node_id)
            rented = self.active_rental_count(node_id) > 0
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
            self.db.execute(
                "INSERT INTO nodes (node_id, spot, node_group, gpus_json, registered_at, "
                "last_seen, provider) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(node_id) DO UPDATE "
                "SET spot=excluded.spot, node_group=excluded.node_group, "
                "gpus_json=excluded.gpus_json, last_seen=excluded.last_seen, "
                "provider=excluded.provider",
                (node_id, int(spot), node_group, json.dumps(gpus), now, now, provider),
            )
        return refused

    def set_spot(self, node_id: str, spot: bool) -> None:
        """An operator's setting of the flag; pinned from then on. The caller checks rentals."""
        self.db.execute(
            "UPDATE nodes SET spot=?, spot_pinned=1 WHERE node_id=?", (int(spot), node_id)
        )

    def touch_node(self, node_id: str) -> None:
        self.db.execute("UPDATE nodes SET last_seen=? WHERE node_id=?", (self.clock(), node_id))

    def nodes(self) -> list[NodeRow]:
        rows = self.db.execute(f"SELECT {_NODE_COLUMNS} FROM nodes ORDER BY node_id").fetchall()
        return [_node_row(r) for r in rows]

    def node(self, node_id: str) -> NodeRow | None:
        r = self.db.execute(
            f"SELECT {_NODE_COLUMNS} FROM nodes WHERE node_id=?", (node_id,)
        ).fetchone()
        return _node_row(r) if r else None

    def nodes_needing_recovery(self) -> list[str]:
        """Nodes whose workload is off or that have a drain in progress."""
        rows = self.db.execute(
            "SELECT node_id FROM nodes WHERE workload_enabled=0 UNION "
            "SELECT node_id FROM node_drains WHERE ended_at IS NULL"
        ).fetchall()
        return [r[0] for r in rows]

    def set_workload(self, node_id: str, enabled: bool) -> bool:
        """The node's workload flag (the coordinator owns it). Returns whether it changed."""
        now = self.clock()
        cur = self.db.execute(
            "UPDATE nodes SET workload_enabled=? WHERE node_id=? AND workload_enabled!=?",
            (int(enabled), node_id, int(enabled)),
        )
        if cur.rowcount == 0 and self.node(node_id) is None:
            # A pause from a node that never registered (it lost the coordinator at boot): the
            # flag still has to be stored, so the node is created disabled.
            self.db.execute(
                "INSERT INTO nodes (node_id, spot, node_group, gpus_json, registered_at, "
                "last_seen, workload_enabled) VALUES (?, 1, 'default', '[]', ?, ?, ?)",
                (node_id, now, now, int(enabled)),
            )
            return True
        return cur.rowcount > 0

    # --- drains ------------------------------------------------------------------------------

    def start_drain(
        self, node_id: str, reclaim_id: str, reason: str, terminate_at: float, grace_deadline: float
    ) -> DrainRow:
        """Record a node's drain. Idempotent: the first deadlines stored are kept for good."""
        self.db.execute(
            "INSERT OR IGNORE INTO node_drains VALUES (?, ?, ?, ?, ?, ?, NULL)",
            (node_id, reclaim_id, reason, terminate_at, grace_deadline, self.clock()),
        )
        row = self.db.execute(
            "SELECT * FROM node_drains WHERE node_id=? AND reclaim_id=?", (node_id, reclaim_id)
        ).fetchone()
        return DrainRow(*row)

    def drain(self, node_id: str, reclaim_id: str) -> DrainRow | None:
        row = self.db.execute(
            "SELECT * FROM node_drains WHERE node_id=? AND reclaim_id=?", (node_id, reclaim_id)
        ).fetchone()
        return DrainRow(*row) if row else None

    def end_drain(self, node_id: str, reclaim_id: str) -> None:
        self.db.execute(
            "UPDATE node_drains SET ended_at=? WHERE node_id=? AND reclaim_id=? "
            "AND ended_at IS NULL",
            (self.clock(), node_id, reclaim_id),
        )

    def active_drains(self, node_id: str | None = None) -> list[DrainRow]:
        sql = "SELECT * FROM node_drains WHERE ended_at IS NULL"
        args: tuple[Any, ...] = ()
        if node_id is not None:
            sql += " AND node_id=?"
            args = (node_id,)
        return [DrainRow(*r) for r in self.db.execute(sql + " ORDER BY started_at", args)]

    # --- workers -----------------------------------------------------------------------------

    def save_worker(
        self, worker_id: str, node_id: str, model: str, state: str, doc: dict[str, Any]
    ) -> None:
        self.db.execute(
            "INSERT INTO workers VALUES (?, ?, ?, ?, ?) ON CONFLICT(worker_id) DO UPDATE SET "
            "state=excluded.state, doc_json=excluded.doc_json",
            (worker_id, node_id, model, state, json.dumps(doc, sort_keys=True)),
        )

    def worker_docs(
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
        return [json.loads(r[0]) for r in self.db.execute(sql + " ORDER BY rowid", args)]

    # --- rentals -----------------------------------------------------------------------------

    def save_rental(self, rental_id: str, node_id: str, ended_at: float | None, doc: dict) -> None:
        self.db.execute(
            "INSERT INTO rentals VALUES (?, ?, ?, ?) ON CONFLICT(rental_id) DO UPDATE SET "
            "ended_at=excluded.ended_at, doc_json=excluded.doc_json",
            (rental_id, node_id, ended_at, json.dumps(doc, sort_keys=True)),
        )

    def rental_doc(self, rental_id: str) -> dict[str, Any] | None:
        row = self.db.execute(
            "SELECT doc_json FROM rentals WHERE rental_id=?", (rental_id,)
        ).fetchone()
        return json.loads(row[0]) if row else None

    def rental_docs(self, node_id: str | None = None, holding_only: bool = False) -> list[dict]:
        """Rentals, oldest first; `holding_only`: those holding their node's GPUs."""
        sql, args = "SELECT doc_json FROM rentals WHERE 1=1", []
        if node_id is not None:
            sql += " AND node_id=?"
            args.append(node_id)
        if holding_only:
            sql += " AND ended_at IS NULL"
        return [json.loads(r[0]) for r in self.db.execute(sql + " ORDER BY rowid", args)]

    def active_rental_count(self, node_id: str) -> int:
        """Rentals holding the node (an ended one counts until its container has stopped)."""
        row = self.db.execute(
            "SELECT COUNT(*) FROM rentals WHERE node_id=? AND ended_at IS NULL", (node_id,)
        ).fetchone()
        return int(row[0])

    # --- desired capacity and avoided groups -------------------------------------------------

    def set_model(self, model: str, replicas: int, image: str, slots: int) -> ModelRow:
        self.db.execute(
            "INSERT INTO models VALUES (?, ?, ?, ?) ON CONFLICT(model) DO UPDATE SET "
            "replicas=excluded.replicas, image=excluded.image, slots=excluded.slots",
            (model, replicas, image, slots),
        )
        return ModelRow(model, replicas, image, slots)

    def models(self) -> list[ModelRow]:
        return [ModelRow(*r) for r in self.db.execute("SELECT * FROM models ORDER BY model")]

    def model(self, model: str) -> ModelRow | None:
        r = self.db.execute("SELECT * FROM models WHERE model=?", (model,)).fetchone()
        return ModelRow(*r) if r else None

    def avoid_group(self, node_group: str, until: float) -> float:
        """Avoid the group until `until`, or longer if it already is; never shortened."""
        self.db.execute(
            "INSERT INTO avoided_groups VALUES (?, ?) ON CONFLICT(node_group) DO UPDATE SET "
            "until=max(until, excluded.until)",
            (node_group, until),
        )
        return self.avoided_groups(0.0)[node_group]

    def avoided_groups(self, now: float) -> dict[str, float]:
        """Groups avoided at `now`, with when their window ends."""
        rows = self.db.execute(
            "SELECT node_group, until FROM avoided_groups WHERE until > ?", (now,)
        )
        return {g: t for g, t in rows}

    # --- taints ------------------------------------------------------------------------------

    def add_taint(self, node_id: str, reclaim_id: str, reason: str) -> None:
        """Idempotent: the same reclamation's taint is stored once, with its first time."""
        self.db.execute(
            "INSERT OR IGNORE INTO taints VALUES "
            "(?, ?, 'spotdrain.io/reclaim', 'NoSchedule', ?, ?)",
            (node_id, reclaim_id, reason, self.clock()),
        )

    def remove_taint(self, node_id: str, reclaim_id: str) -> None:
        self.db.execute(
            "DELETE FROM taints WHERE node_id=? AND reclaim_id=?", (node_id, reclaim_id)
        )

    def taints(self, node_id: str) -> list[TaintRow]:
        rows = self.db.execute(
            "SELECT * FROM taints WHERE node_id=? ORDER BY since", (node_id,)
        ).fetchall()
        return [TaintRow(*r) for r in rows]

    # --- events ------------------------------------------------------------------------------

    def add_event(
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
        with self._tx():
            cur = self.db.execute(
                "INSERT OR IGNORE INTO events (uid, kind, node_id, reclaim_id, wall_time, "
                "t_offset_s, details_json, received_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    uid,
                    kind,
                    node_id,
                    reclaim_id,
                    wall_time,
                    t_offset_s,
                    json.dumps(details, sort_keys=True),
                    self.clock(),
                ),
            )
            if cur.rowcount == 0:
                return None
            if reclaim_id:
                self._fold(node_id, reclaim_id, kind, wall_time, details)
            return cur.lastrowid

    def _fold(
        self, node_id: str, reclaim_id: str, kind: str, wall_time: float, details: dict[str, Any]
    ) -> None:
        row = self.db.execute(
            "SELECT record_json FROM reclamations WHERE reclaim_id=?", (reclaim_id,)
        ).fetchone()
        record = json.loads(row[0]) if row else timeline.new_record(reclaim_id, node_id)
        timeline.fold(record, kind, wall_time, details)
        self.db.execute(
            "INSERT INTO reclamations VALUES (?, ?, ?, ?) ON CONFLICT(reclaim_id) DO UPDATE "
            "SET record_json=excluded.record_json",
            (reclaim_id, node_id, json.dumps(record), record["t0"] or wall_time),
        )

    def events_after(self, from_id: int, limit: int = 1000) -> list[EventRow]:
        rows = self.db.execute(
            "SELECT * FROM events WHERE id > ? ORDER BY id LIMIT ?", (from_id, limit)
        ).fetchall()
        return [EventRow(*r) for r in rows]

    def events_of(self, reclaim_id: str) -> list[EventRow]:
        rows = self.db.execute(
            "SELECT * FROM events WHERE reclaim_id=? ORDER BY wall_time, id", (reclaim_id,)
        ).fetchall()
        return [EventRow(*r) for r in rows]

    # --- reclamations ------------------------------------------------------------------------

    def reclamation(self, reclaim_id: str) -> dict[str, Any] | None:
        if reclaim_id:
            row = self.db.execute(
                "SELECT record_json FROM reclamations WHERE reclaim_id=?", (reclaim_id,)
            ).fetchone()
        else:
            row = self.db.execute(
                "SELECT record_json FROM reclamations ORDER BY started_at DESC, rowid DESC LIMIT 1"
            ).fetchone()
        return json.loads(row[0]) if row else None


class _Tx:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")
