"""The durable outbox: every event the agent makes is written here, and sent from here.
(A drain step's events may go out a moment before they are written: the step's bundle holds
them until then, see DrainRunner._apply.)

SQLite in the state dir. An event leaves the outbox only when the coordinator acknowledges its
uid, so events made while the coordinator is away arrive when it is back; the coordinator stores
each uid once, so a resend after a lost ack is harmless (docs/design.md invariant 10).

An event's details are bounded when it is put: the coordinator refuses a batch holding details
above MAX_DETAILS_BYTES, so such an event would be resent and refused forever, holding back
every event behind it. It is stored with a bounded summary instead.

A disk that refuses the insert (full, read-only, failing) loses no event and stops nothing: the
event waits in a memory queue, which `pending()` hands to the link after the stored ones, so it
is still sent; the next insert that works first moves the queue into SQLite, in order (every
queued event is newer than every stored one). The queue holds MEMORY_EVENTS_KEPT events; beyond
that the oldest are dropped and counted in one `events_dropped` event (docs/design.md "How the
agent carries it out").
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from spotdrain.agent.drain.state import WriteHealth
from spotdrain.protocol.events import EventRecord
from spotdrain.protocol.limits import MAX_DETAILS_BYTES

log = logging.getLogger("spotdrain.agent.drain.outbox")

# What a truncated event keeps of its original details: top-level keys with short scalar values
# (exit_code, mode, container, ...), so the event still says what it was about.
SUMMARY_KEY_CHARS = 64
SUMMARY_VALUE_CHARS = 256
# The summary stays well inside MAX_DETAILS_BYTES however many short keys the original had.
SUMMARY_BYTES = 4 * 1024
# Events held in memory while the disk refuses them; beyond this the oldest are dropped (and
# counted). At a few hundred bytes each, 10,000 events stay within a few megabytes.
MEMORY_EVENTS_KEPT = 10_000
# While events wait in memory, pending() tries SQLite again at most this often (put() always
# tries): a disk freed while nothing happens still takes them back.
RETRY_EVERY_S = 1.0
DROPPED_KIND = "events_dropped"


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
    def __init__(
        self,
        path: Path,
        health: WriteHealth | None = None,
        connect: Callable[[str], sqlite3.Connection] | None = None,
        memory_kept: int = MEMORY_EVENTS_KEPT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.health = health or WriteHealth()
        self._connect = connect or (
            lambda p: sqlite3.connect(p, isolation_level=None, check_same_thread=False)
        )
        self.memory_kept = memory_kept
        self.clock = clock
        self.db: sqlite3.Connection | None = None
        # Events the disk refused, oldest first; each is newer than every row in SQLite.
        self._memory: OrderedDict[str, EventRecord] = OrderedDict()
        # Acknowledged rows whose DELETE the disk refused: never handed out again.
        self._acked: set[str] = set()
        self._dropped: Counter[str] = Counter()
        self._dropped_node = ""
        self._flushing = False
        self._held = 0
        self._last_try = float("-inf")
        self._open()

    def _open(self) -> sqlite3.Connection | None:
        """The database, opened on first use; None while it cannot be (the memory queue holds
        the events meanwhile)."""
        if self.db is not None:
            return self.db
        try:
            db = self._connect(str(self.path))
            try:
                db.execute("PRAGMA journal_mode=WAL")
                # FULL: an event the agent acted on must survive the host losing power mid-drain.
                db.execute("PRAGMA synchronous=FULL")
                db.execute(
                    "CREATE TABLE IF NOT EXISTS outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                    "uid TEXT NOT NULL UNIQUE, body TEXT NOT NULL)"
                )
            except BaseException:
                db.close()
                raise
        except sqlite3.Error as e:
            self.health.failed(self.path, e)
            return None
        self.db = db
        return db

    @staticmethod
    def event(
        kind: str,
        node_id: str,
        reclaim_id: str,
        wall_time: float,
        t_offset_s: float | None,
        details: dict[str, Any],
    ) -> EventRecord:
        """A new event with its uid, its details bounded; not stored yet (put)."""
        details, original_bytes = bounded_details(details)
        if original_bytes is not None:
            log.warning(
                "node %s: %s event details are %d bytes (limit %d): stored as a summary",
                node_id,
                kind,
                original_bytes,
                MAX_DETAILS_BYTES,
            )
        return EventRecord(
            str(uuid.uuid4()), kind, node_id, reclaim_id, wall_time, t_offset_s, details
        )

    def put(self, event: EventRecord) -> EventRecord:
        """Store an event made by `event`; one whose uid is stored already is not stored again
        (a drain step's events put again after a restart)."""
        self._memory[event.uid] = event
        if not self._held:
            self._flush()
            self._bound()
        return event

    @contextlib.contextmanager
    def hold(self, store: bool = True) -> Iterator[None]:
        """Events put inside go to SQLite together when it ends: one transaction (one fsync)
        for the events of one drain step instead of one each. `store=False` leaves them in
        the memory queue (sent all the same) until `store_held()`: for a caller whose events
        are durable elsewhere already (a drain step's, in its bundle), so the fsync can wait
        until the calls the step started are under way."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            if not self._held and store:
                self._flush()
                self._bound()

    def store_held(self) -> None:
        """Store what waits in memory: left there by hold(store=False), or refused by the disk."""
        if self._memory and not self._held:
            self._flush()
            self._bound()

    def unstored(self, reclaim_id: str) -> list[EventRecord]:
        """The events of one reclamation that are in memory only, oldest first."""
        if not reclaim_id:
            return []
        return [e for e in self._memory.values() if e.reclaim_id == reclaim_id]

    def _flush(self) -> bool:
        """Move the memory queue into SQLite, in order, one transaction a pass. True when the
        queue is empty."""
        if not self._memory or self._flushing:
            return not self._memory
        self._flushing = True  # a failure below records an event: it waits in the queue
        self._last_try = self.clock()
        try:
            db = self._open()
            while db is not None and self._memory:
                rows = [
                    (e.uid, json.dumps(e.__dict__, sort_keys=True)) for e in self._memory.values()
                ]
                try:
                    if len(rows) == 1:
                        db.execute(
                            "INSERT OR IGNORE INTO outbox (uid, body) VALUES (?, ?)", rows[0]
                        )
                    else:
                        db.execute("BEGIN")
                        db.executemany(
                            "INSERT OR IGNORE INTO outbox (uid, body) VALUES (?, ?)", rows
                        )
                        db.execute("COMMIT")
                except sqlite3.Error as e:
                    if db.in_transaction:
                        db.rollback()
                    self.health.failed(self.path, e)
                    return False
                for uid, _ in rows:
                    self._memory.pop(uid, None)
                self.health.wrote(self.path)  # may queue `state_write_resumed`: next pass
                self._delete_acked(db)
            return not self._memory
        finally:
            self._flushing = False

    def _bound(self) -> None:
        """Past MEMORY_EVENTS_KEPT held events, drop the oldest and count them by kind."""
        while len(self._memory) > self.memory_kept:
            uid = next((u for u, e in self._memory.items() if e.kind != DROPPED_KIND), None)
            if uid is None:
                return
            dropped = self._memory.pop(uid)
            if not self._dropped:
                log.error(
                    "node %s: %d events held in memory and the disk still refuses them: "
                    "dropping the oldest",
                    dropped.node_id,
                    self.memory_kept,
                )
            self._dropped[dropped.kind] += 1
            self._dropped_node = dropped.node_id

    def _dropped_event(self) -> None:
        """The count of dropped events so far, as one event at the head of the queue."""
        if not self._dropped:
            return
        details = {"count": sum(self._dropped.values()), "kinds": dict(self._dropped)}
        counted = self.event(DROPPED_KIND, self._dropped_node, "", time.time(), None, details)
        self._dropped.clear()
        self._memory[counted.uid] = counted
        self._memory.move_to_end(counted.uid, last=False)

    def pending(self, limit: int = 256) -> list[EventRecord]:
        """The oldest events not yet acknowledged: those in SQLite, then those in memory."""
        self._dropped_event()
        if self._memory and self.clock() - self._last_try >= RETRY_EVERY_S:
            self._flush()
        out: list[EventRecord] = []
        db = self.db
        if db is not None:
            try:
                rows = db.execute(
                    "SELECT body FROM outbox ORDER BY seq LIMIT ?", (limit + len(self._acked),)
                ).fetchall()
            except sqlite3.Error as e:
                self.health.failed(self.path, e)
                rows = []
            for (body,) in rows:
                event = EventRecord(**json.loads(body))
                if event.uid not in self._acked:
                    out.append(event)
        for event in self._memory.values():
            if len(out) >= limit:
                break
            out.append(event)
        return out[:limit]

    def acknowledge(self, uids: Iterable[str]) -> None:
        for uid in uids:
            if self._memory.pop(uid, None) is None:
                self._acked.add(uid)
        if self.db is not None:
            self._delete_acked(self.db)

    def _delete_acked(self, db: sqlite3.Connection) -> None:
        if not self._acked:
            return
        done = list(self._acked)
        # No fsync of their own: a delete lost with the power only sends an event again, which
        # the coordinator stores once (by uid); the next insert's fsync makes it durable. An
        # fsync per acknowledgement would stall the loop on the notice path.
        try:
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("BEGIN")
            db.executemany("DELETE FROM outbox WHERE uid=?", [(u,) for u in done])
            db.execute("COMMIT")
        except sqlite3.Error as e:
            if db.in_transaction:
                db.rollback()
            self.health.failed(self.path, e)
            return
        finally:
            with contextlib.suppress(sqlite3.Error):
                db.execute("PRAGMA synchronous=FULL")
        self._acked.difference_update(done)

    @property
    def held_in_memory(self) -> int:
        return len(self._memory)

    def retry(self) -> bool:
        """Try the disk again now (the drain loop's retry tick). True when nothing waits."""
        self._flush()
        if self.db is not None:
            self._delete_acked(self.db)
        return not self._memory and not self._acked

    def __len__(self) -> int:
        stored = 0
        if self.db is not None:
            try:
                stored = int(self.db.execute("SELECT count(*) FROM outbox").fetchone()[0])
            except sqlite3.Error:
                stored = len(self._acked)
        return max(stored - len(self._acked), 0) + len(self._memory) + bool(self._dropped)

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
