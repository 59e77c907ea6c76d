"""The durable outbox: every event the agent makes is written here first, then sent.

SQLite in the state dir. An event leaves the outbox only when the coordinator acknowledges its
uid, so events made while the coordinator is away arrive when it is back; the coordinator stores
each uid once, so a resend after a lost ack is harmless (docs/design.md invariant 10).

An event's details are bounded when it is put: the coordinator refuses a batch holding details
above MAX_DETAILS_BYTES, so such an event would be resent and refused forever, holding back
every event behind it. It is stored with a bounded summary instead.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotdrain.limits import MAX_DETAILS_BYTES

log = logging.getLogger("spotdrain.agent.outbox")

# What a truncated event keeps of its original details: top-level keys with short scalar values
# (exit_code, mode, container, ...), so the event still says what it was about.
SUMMARY_KEY_CHARS = 64
SUMMARY_VALUE_CHARS = 256
# The summary stays well inside MAX_DETAILS_BYTES however many short keys the original had.
SUMMARY_BYTES = 4 * 1024


@dataclass(frozen=True)
class OutgoingEvent:
    uid: str
    kind: str
    node_id: str
    reclaim_id: str
    wall_time: float
    t_offset_s: float | None
    details: dict[str, Any]


def details_json(details: dict[str, Any]) -> str:
    """The wire form of an event's details (Event.details_json)."""
    return json.dumps(details, sort_keys=True)


def _short_scalar(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= SUMMARY_VALUE_CHARS
    return value is None or isinstance(value, bool | int | float)


def summarize_details(details: dict[str, Any], original_bytes: int) -> dict[str, Any]:
    """A bounded stand-in for details too large to send."""
    summary: dict[str, Any] = {"details_truncated": True, "original_bytes": original_bytes}
    for key in sorted(details):
        value = details[key]
        if key in summary or len(key) > SUMMARY_KEY_CHARS or not _short_scalar(value):
            continue
        summary[key] = value
        if len(details_json(summary).encode()) > SUMMARY_BYTES:
            del summary[key]
            break
    return summary


def bounded_details(details: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """The details as given when they fit MAX_DETAILS_BYTES, else a summary and the original
    size in bytes."""
    size = len(details_json(details).encode())
    if size <= MAX_DETAILS_BYTES:
        return details, None
    return summarize_details(details, size), size


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
        details, original_bytes = bounded_details(details)
        if original_bytes is not None:
            log.warning(
                "node %s: %s event details are %d bytes (limit %d): stored as a summary",
                node_id,
                kind,
                original_bytes,
                MAX_DETAILS_BYTES,
            )
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
