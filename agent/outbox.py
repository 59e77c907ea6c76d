"""The durable outbox: every event the agent makes is written here first, then sent.

SQLite in the state dir. An event leaves the outbox only when the coordinator acknowledges its
uid, so events made while the coordinator is away arrive when it is back; the coordinator stores
each uid once, so a resend after a lost ack is harmless (DESIGN.md invariant 10).
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class OutgoingEvent:
    uid: str
    kind: str
    node_id: str
    reclaim_id: str
    wall_time: float
    t_offset_s: float | None
    details: dict[str, Any]


class Outbox:
    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        # FULL: an event the agent acted on must survive the host losing power mid-drain.
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
            "uid TEXT NOT NULL UNIQUE, body TEXT NOT NULL)"
        )

    def put(
        self,
        kind: str,
        node_id: str,
        reclaim_id: str,
        wall_time: float,
        t_offset_s: float | None,
        details: dict[str, Any],
    ) -> OutgoingEvent:
        event = OutgoingEvent(
            uid=str(uuid.uuid4()),
            kind=kind,
            node_id=node_id,
            reclaim_id=reclaim_id,
            wall_time=wall_time,
            t_offset_s=t_offset_s,
            details=details,
        )
        body = json.dumps(event.__dict__, sort_keys=True)
        self.db.execute("INSERT INTO outbox (uid, body) VALUES (?, ?)", (event.uid, body))
        return event

    def pending(self, limit: int = 256) -> list[OutgoingEvent]:
        rows = self.db.execute("SELECT body FROM outbox ORDER BY seq LIMIT ?", (limit,)).fetchall()
        return [OutgoingEvent(**json.loads(r[0])) for r in rows]

    def acknowledge(self, uids: Iterable[str]) -> None:
        self.db.executemany("DELETE FROM outbox WHERE uid=?", [(u,) for u in uids])

    def __len__(self) -> int:
        return int(self.db.execute("SELECT count(*) FROM outbox").fetchone()[0])

    def close(self) -> None:
        self.db.close()
