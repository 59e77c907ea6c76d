"""The schema, written once for both backends, and its migrations.

Each backend fills in the few words the two dialects spell differently (`{serial_pk}`,
`{real}`, `{json_num}`); everything else is SQL both SQLite 3.35+ and PostgreSQL accept. A new
database runs the base schema and then every migration in order, on either backend, so the two
can never drift apart; a database of a version this code does not know is refused.
"""

from __future__ import annotations

SCHEMA_VERSION = 9

BASE = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE nodes (
    node_id TEXT PRIMARY KEY,
    spot INTEGER NOT NULL,
    node_group TEXT NOT NULL,
    gpus_json TEXT NOT NULL,
    registered_at {real} NOT NULL,
    last_seen {real} NOT NULL
);
CREATE TABLE taints (
    node_id TEXT NOT NULL,
    reclaim_id TEXT NOT NULL,
    key TEXT NOT NULL,
    effect TEXT NOT NULL,
    reason TEXT NOT NULL,
    since {real} NOT NULL,
    PRIMARY KEY (node_id, reclaim_id)
);
CREATE TABLE events (
    id {serial_pk},
    uid TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    node_id TEXT NOT NULL,
    reclaim_id TEXT NOT NULL,
    wall_time {real} NOT NULL,
    t_offset_s {real},
    details_json TEXT NOT NULL,
    received_at {real} NOT NULL
);
CREATE INDEX events_by_reclaim ON events (reclaim_id, id);
CREATE TABLE reclamations (
    reclaim_id TEXT PRIMARY KEY,
    node_id TEXT NOT NULL,
    record_json TEXT NOT NULL,
    started_at {real} NOT NULL
);
"""

# Each migration takes the schema from version N to N + 1.
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
    terminate_at {real} NOT NULL,
    grace_deadline {real} NOT NULL,
    started_at {real} NOT NULL,
    ended_at {real},
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
    ended_at {real},
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
    until {real} NOT NULL
);
""",
    3: """
-- Creation order as a column (PostgreSQL has no rowid): listings stay oldest first.
ALTER TABLE workers ADD COLUMN created_at {real} NOT NULL DEFAULT 0;
UPDATE workers SET created_at = {json_num_created};
ALTER TABLE rentals ADD COLUMN started_at {real} NOT NULL DEFAULT 0;
UPDATE rentals SET started_at = {json_num_started};
CREATE INDEX workers_live ON workers (state, created_at);
-- Drain state that used to live only in the coordinator's memory (rebuild() reads it back):
-- paused workers to place again once they stop, each model's start backoff, and rentals a
-- node did not list when it came back, since when.
CREATE TABLE replace_on_stop (
    worker_id TEXT PRIMARY KEY,
    doc_json TEXT NOT NULL
);
CREATE TABLE start_backoff (
    model TEXT PRIMARY KEY,
    failures INTEGER NOT NULL,
    retry_at {real} NOT NULL
);
CREATE TABLE missing_rentals (
    rental_id TEXT PRIMARY KEY,
    since {real} NOT NULL
);
""",
    4: """
-- Nodes at risk: an advisory (rebalance recommendation, maintenance, live migration) a node's
-- agent reported. No new placements there until it is lifted or `until` passes; its workers
-- keep serving while replacements start elsewhere.
CREATE TABLE node_risks (
    node_id TEXT NOT NULL,
    advisory_key TEXT NOT NULL,
    source TEXT NOT NULL,
    reason TEXT NOT NULL,
    until {real} NOT NULL,
    PRIMARY KEY (node_id, advisory_key)
);
""",
    5: """
-- Per workload image and kind: how its reclamations ended (coordinator/capacity/contracts.py).
-- Counted in the transaction that stores the event deciding each end, so each is counted once.
CREATE TABLE workload_contracts (
    image TEXT NOT NULL,
    kind TEXT NOT NULL,
    exited INTEGER NOT NULL,
    killed INTEGER NOT NULL,
    overrun INTEGER NOT NULL,
    flagged_at {real},
    PRIMARY KEY (image, kind)
);
""",
    6: """
-- The leader lease of coordinator replicas on PostgreSQL (coordinator/replicas/leadership.py): one
-- row, the term growing with each new leader, the expiry on the database's clock (epoch seconds).
-- Every write of a leader is fenced by its term. Unused with one coordinator and on SQLite.
CREATE TABLE leader_lease (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    holder TEXT NOT NULL,
    term INTEGER NOT NULL,
    expires_at {real} NOT NULL
);
INSERT INTO leader_lease VALUES (1, '', 0, 0);
""",
    7: """
-- The work managers a node last registered with (Register.managers) as a JSON list: '[]' for a
-- node registered before, until its agent registers again.
ALTER TABLE nodes ADD COLUMN managers_json TEXT NOT NULL DEFAULT '[]';
""",
    8: """
-- The cloud instance a node last reported (Register.cloud) as a JSON object; NULL for a node
-- that never reported one (registered before, or its metadata service has not answered).
ALTER TABLE nodes ADD COLUMN cloud_json TEXT;
""",
}

SQLITE_WORDS = {
    "serial_pk": "INTEGER PRIMARY KEY AUTOINCREMENT",
    "real": "REAL",
    "json_num_created": "coalesce(json_extract(doc_json, '$.created_at'), 0)",
    "json_num_started": "coalesce(json_extract(doc_json, '$.started_at'), 0)",
}
POSTGRES_WORDS = {
    "serial_pk": "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
    "real": "DOUBLE PRECISION",
    "json_num_created": "coalesce((doc_json::jsonb->>'created_at')::double precision, 0)",
    "json_num_started": "coalesce((doc_json::jsonb->>'started_at')::double precision, 0)",
}


def statements(script: str, words: dict[str, str]) -> list[str]:
    """One script in one dialect, as statements (no statement here holds a semicolon)."""
    lines = [line for line in script.format(**words).splitlines() if not line.startswith("--")]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


def steps_from(version: int, words: dict[str, str]) -> list[tuple[int, list[str]]]:
    """(version reached, statements) for each step from `version` (0: a new database)."""
    steps = []
    if version == 0:
        base = statements(BASE, words)
        base.append("INSERT INTO meta VALUES ('schema_version', '1')")
        steps.append((1, base))
        version = 1
    while version < SCHEMA_VERSION:
        sql = statements(MIGRATIONS[version], words)
        sql.append(f"UPDATE meta SET value='{version + 1}' WHERE key='schema_version'")
        steps.append((version + 1, sql))
        version += 1
    return steps
