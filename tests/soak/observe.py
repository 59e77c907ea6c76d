"""What the soak compares: the events each agent stored in its outbox, the events the
coordinator stored, and the signals the Docker engine delivered.

- `install_ledger(state_dir)`: before an agent first starts, its outbox database is created by
  the agent's own Outbox class and given a trigger that copies every row the agent inserts into
  a table of the soak's (`soak_ledger`). The copy is in the agent's own transaction, so it
  holds exactly the events the agent stored, survives a SIGKILL as they do, and stays when the
  outbox deletes a row the coordinator acknowledged.
- `EventMirror`: the coordinator's stored events, read incrementally through Admin.WatchEvents
  (each call from the last id seen), through faults: a call to a frozen or dead coordinator
  times out and is simply made again.
- `EngineSignals`: the engine's own `kill` events (each signal the API delivered, by container).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import docker
import grpc

from spotdrain.agent.drain.outbox import Outbox
from spotdrain.protocol.events import stored_event_to_dict
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

LEDGER_TABLE = "soak_ledger"
_TRIGGER = f"""
CREATE TABLE IF NOT EXISTS {LEDGER_TABLE} (
  uid TEXT PRIMARY KEY, reclaim_id TEXT NOT NULL, kind TEXT NOT NULL, body TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS soak_ledger_reclamation ON {LEDGER_TABLE} (reclaim_id);
CREATE TRIGGER IF NOT EXISTS soak_ledger_copy AFTER INSERT ON outbox BEGIN
  INSERT OR IGNORE INTO {LEDGER_TABLE} (uid, reclaim_id, kind, body) VALUES (NEW.uid,
    coalesce(json_extract(NEW.body, '$.reclaim_id'), ''),
    coalesce(json_extract(NEW.body, '$.kind'), ''), NEW.body);
END;
"""


def outbox_path(state_dir: Path) -> Path:
    return state_dir / "outbox.sqlite"


def install_ledger(state_dir: Path) -> None:
    """The outbox as the agent makes it, plus the soak's copy of every row put into it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    Outbox(outbox_path(state_dir)).close()
    db = sqlite3.connect(outbox_path(state_dir))
    try:
        db.executescript(_TRIGGER)
    finally:
        db.close()


def read_ledger(state_dir: Path, reclaim_id: str | None = None) -> list[dict[str, Any]]:
    """Every event the agent has stored in its outbox so far (uid, kind, reclaim_id, details,
    ...), or those of one reclamation, in the order the agent stored them."""
    db = sqlite3.connect(outbox_path(state_dir), timeout=30)
    try:
        if reclaim_id is None:
            rows = db.execute(f"SELECT body FROM {LEDGER_TABLE} ORDER BY rowid").fetchall()
        else:
            rows = db.execute(
                f"SELECT body FROM {LEDGER_TABLE} WHERE reclaim_id = ? ORDER BY rowid",
                (reclaim_id,),
            ).fetchall()
    finally:
        db.close()
    return [json.loads(body) for (body,) in rows]


def outbox_rows(state_dir: Path) -> int:
    """Events the agent still holds for the coordinator."""
    db = sqlite3.connect(outbox_path(state_dir), timeout=30)
    try:
        return int(db.execute("SELECT count(*) FROM outbox").fetchone()[0])
    finally:
        db.close()


class EventMirror:
    """The coordinator's event log, as far as it has been read. Thread-safe; `refresh` reads
    what is new, at most once per `every_s` however many threads ask."""

    def __init__(
        self, channel: grpc.Channel, call_timeout_s: float = 5.0, every_s: float = 0.2
    ) -> None:
        self.stub = pb_grpc.AdminStub(channel)
        self.call_timeout_s = call_timeout_s
        self.every_s = every_s
        self.last_id = 0
        self.events: list[dict[str, Any]] = []
        self.uids: set[str] = set()
        self.by_reclamation: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.errors = 0  # calls that failed (coordinator frozen or down): made again later
        self._lock = threading.Lock()
        self._read_at = 0.0

    def refresh(self) -> None:
        with self._lock:
            if time.monotonic() - self._read_at < self.every_s:
                return
            try:
                for stored in self.stub.WatchEvents(
                    pb.WatchEventsRequest(from_id=self.last_id), timeout=self.call_timeout_s
                ):
                    ev = stored_event_to_dict(stored)
                    self.last_id = max(self.last_id, stored.id)
                    self.events.append(ev)
                    self.uids.add(ev["uid"])
                    if ev["reclaim_id"]:
                        self.by_reclamation[ev["reclaim_id"]].append(ev)
            except grpc.RpcError:
                self.errors += 1
            self._read_at = time.monotonic()

    def of(self, reclaim_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.by_reclamation.get(reclaim_id, ()))

    def has_all(self, uids: set[str]) -> bool:
        with self._lock:
            return uids <= self.uids

    def everything(self, timeout_s: float = 120.0) -> list[dict[str, Any]]:
        """One full read from the first id (what the counts are made of), retried until the
        coordinator answers."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return [
                    stored_event_to_dict(s)
                    for s in self.stub.WatchEvents(
                        pb.WatchEventsRequest(from_id=0), timeout=max(30.0, self.call_timeout_s)
                    )
                ]
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def timeline(self, reclaim_id: str) -> pb.Timeline | None:
        try:
            return self.stub.GetTimeline(
                pb.GetTimelineRequest(reclaim_id=reclaim_id), timeout=self.call_timeout_s
            )
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise


class EngineSignals:
    """Every signal the engine delivered through its API (its `kill` events), by container id,
    read on a thread of its own for the soak's whole run."""

    def __init__(self, client: docker.DockerClient) -> None:
        self.by_container: dict[str, Counter[int]] = defaultdict(Counter)
        self._lock = threading.Lock()
        self._stream = client.events(decode=True, filters={"type": "container", "event": "kill"})
        self._thread = threading.Thread(target=self._read, name="engine-signals", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with contextlib.suppress(Exception):  # the stream ends when close() shuts it
            for event in self._stream:
                actor = event.get("Actor", {})
                signal = actor.get("Attributes", {}).get("signal")
                with contextlib.suppress(TypeError, ValueError):
                    with self._lock:
                        self.by_container[actor.get("ID", "")][int(signal)] += 1

    def count(self, container_id: str, signal: int) -> int:
        with self._lock:
            return self.by_container.get(container_id, Counter())[signal]

    def close(self) -> None:
        self._stream.close()
