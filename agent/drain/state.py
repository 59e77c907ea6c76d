"""The agent's durable state in its state dir: reclamation bundles, local taints, files for
workloads. Every write is atomic (spotdrain.workload.write_atomic) so a crash leaves old or
new, never half; nothing about a drain lives only in memory while the disk takes writes
(docs/design.md invariant 8).

When the disk does not take them (full, read-only, failing), the agent keeps its promise from
memory: the stores hold what they could not write, `WriteHealth` records `state_write_failed`
once per path (until that path writes again, `state_write_resumed`), and every later save
retries. A failed write never raises out of a store (docs/design.md "How the agent carries it
out").
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from spotdrain.agent.core.reclamation import Reclamation
from spotdrain.protocol.events import EventRecord
from spotdrain.workload import Deadline, write_atomic

log = logging.getLogger("spotdrain.agent.drain.state")
STEP_EVENTS = "step_events"  # a bundle's key for the events of the step that wrote it

Writer = Callable[[Path, Any, int], None]
Reporter = Callable[[str, dict[str, Any]], None]


def write_json(path: Path, doc: Any, mode: int = 0o644, durable: bool = True) -> None:
    """Write `doc` as JSON through the one atomic write (spotdrain.workload.write_atomic),
    making the directory first (a state dir the disk refused at start is made by a later
    save)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(doc, indent=1, sort_keys=True).encode()
    write_atomic(path, data, mode, durable)


# SQLite's result codes for the disk's refusals, as the errno a file write would have given.
_SQLITE_ERRNO = {
    "SQLITE_FULL": "ENOSPC",
    "SQLITE_READONLY": "EROFS",
    "SQLITE_IOERR": "EIO",
    "SQLITE_CANTOPEN": "EACCES",
    "SQLITE_PERM": "EPERM",
}


def errno_name(error: BaseException) -> str:
    """ENOSPC, EROFS, EIO...: what a failed write says, for an OSError or an sqlite3.Error."""
    if isinstance(error, OSError) and error.errno is not None:
        return errno.errorcode.get(error.errno, str(error.errno))
    if isinstance(error, sqlite3.Error):
        name = getattr(error, "sqlite_errorname", "") or ""
        for prefix, mapped in _SQLITE_ERRNO.items():
            if name.startswith(prefix):
                return mapped
        return name or type(error).__name__
    return type(error).__name__


class WriteHealth:
    """Which state files the disk refuses now. A path's first failure is recorded as
    `state_write_failed` (path, errno) and not again until the path writes once more, which is
    recorded as `state_write_resumed`. Until a reporter is attached (the outbox is opened before
    the drain runner that records events), reports wait here."""

    def __init__(self, report: Reporter | None = None) -> None:
        self.failing: dict[str, str] = {}  # path -> errno name of its last failure
        self._report = report
        self._waiting: list[tuple[str, dict[str, Any]]] = []

    def attach(self, report: Reporter) -> None:
        self._report = report
        waiting, self._waiting = self._waiting, []
        for kind, details in waiting:
            report(kind, details)

    def failed(self, path: Path | str, error: BaseException) -> None:
        key, name = str(path), errno_name(error)
        if key in self.failing:
            self.failing[key] = name
            return
        self.failing[key] = name
        log.error("state write to %s failed (%s: %s); carrying on from memory", key, name, error)
        self._tell("state_write_failed", {"path": key, "errno": name, "error": str(error)[:256]})

    def wrote(self, path: Path | str) -> None:
        key = str(path)
        if self.failing.pop(key, None) is not None:
            log.warning("state write to %s works again", key)
            self._tell("state_write_resumed", {"path": key})

    def _tell(self, kind: str, details: dict[str, Any]) -> None:
        if self._report is None:
            self._waiting.append((kind, details))
        else:
            self._report(kind, details)


class BundleStore:
    """One JSON file per reclamation under <state>/reclamations/. Finished ones are kept for a
    while (a notice read again is the same reclamation), then forgotten as the node core's
    Retention says (docs/design.md "How the agent carries it out").

    A bundle the disk refused is held in memory (`unsaved`) and counts as stored for every
    question asked here (exists, load_all), so a full disk forgets no reclamation while the
    agent runs; each save, and retry(), writes the held ones again."""

    def __init__(
        self, state_dir: Path, health: WriteHealth | None = None, write: Writer = write_json
    ) -> None:
        self.dir = state_dir / "reclamations"
        self.health = health or WriteHealth()
        self._write = write
        self.unsaved: dict[str, Reclamation] = {}
        self._events: dict[str, list[dict[str, Any]]] = {}
        # Read by load_all(with_events=True): each bundle's last step's events (the fields of
        # EventRecord), for the outbox to take again.
        self.step_events: dict[str, list[dict[str, Any]]] = {}
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self.health.failed(self.dir, e)  # the first save makes it (write_json does)

    def path(self, reclaim_id: str) -> Path:
        return self.dir / f"{reclaim_id}.json"

    def save(self, rec: Reclamation, events: Sequence[EventRecord] = ()) -> bool:
        """Write the bundle, with the events of the step that made it (the outbox gets them
        next; a restarted agent puts them there again, see `step_events`). False (and held in
        memory) when the disk refused it."""
        self.unsaved[rec.reclaim_id] = rec
        self._events[rec.reclaim_id] = [dataclasses.asdict(e) for e in events]
        ok = self._save_one(rec)
        if ok and self.unsaved:
            self.retry()
        return ok

    def retry(self) -> bool:
        """Write every held bundle; stops at the first refusal. True when none is left."""
        for rec in list(self.unsaved.values()):
            if not self._save_one(rec):
                return False
        return True

    def _save_one(self, rec: Reclamation) -> bool:
        path = self.path(rec.reclaim_id)
        doc = rec.to_json()
        events = self._events.get(rec.reclaim_id)
        if events:
            doc[STEP_EVENTS] = events
        try:
            self._write(path, doc, 0o600)
        except OSError as e:
            self.health.failed(path, e)
            return False
        if self.unsaved.get(rec.reclaim_id) is rec:
            del self.unsaved[rec.reclaim_id]
        self.health.wrote(path)
        return True

    def forget(self, reclaim_id: str) -> None:
        """Delete a finished reclamation's bundle. One the disk will not delete is left there:
        read at the next start, it is forgotten again."""
        self.unsaved.pop(reclaim_id, None)
        self._events.pop(reclaim_id, None)
        try:
            self.path(reclaim_id).unlink(missing_ok=True)
        except OSError as e:
            log.warning("reclamation bundle %s not deleted: %s", self.path(reclaim_id), e)

    def exists(self, reclaim_id: str) -> bool:
        return reclaim_id in self.unsaved or self.path(reclaim_id).exists()

    def load(self, reclaim_id: str) -> Reclamation | None:
        """One reclamation, finished or not (None when there is no bundle for it)."""
        if reclaim_id in self.unsaved:
            return self.unsaved[reclaim_id]
        path = self.path(reclaim_id)
        try:
            return self._read(path)[0]
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as e:
            raise RuntimeError(f"reclamation bundle {path} is unreadable: {e}") from e

    def load_all(self, with_events: bool = False) -> list[Reclamation]:
        recs: dict[str, Reclamation] = {}
        try:
            paths = sorted(self.dir.glob("rcl-*.json"))
        except OSError:
            paths = []
        for path in paths:
            if path.stem in self.unsaved:
                continue  # memory is newer than the disk
            try:
                recs[path.stem], events = self._read(path)
                if events and with_events:  # the restart's: see DrainRunner._rebuild
                    self.step_events[path.stem] = events
            except (ValueError, TypeError) as e:
                # A bundle we cannot read is a bug or disk damage; refuse to guess its deadlines.
                raise RuntimeError(f"reclamation bundle {path} is unreadable: {e}") from e
        recs.update(self.unsaved)
        return [recs[k] for k in sorted(recs)]

    def _read(self, path: Path) -> tuple[Reclamation, list[dict[str, Any]]]:
        """A bundle: the reclamation, and the events of the step that wrote it."""
        doc = json.loads(path.read_text())
        events = doc.pop(STEP_EVENTS, [])
        return Reclamation.from_json(doc), events


class LocalTaints:
    """Taints the agent applied itself because the coordinator did not answer in time.

    While one stands, the agent refuses to start any workload (docs/design.md invariant 4). The
    set in memory is what counts; the file is its copy for a restarted agent, written again by
    retry() after the disk refused it.
    """

    def __init__(
        self, state_dir: Path, health: WriteHealth | None = None, write: Writer = write_json
    ) -> None:
        self.path = state_dir / "local_taints.json"
        self.health = health or WriteHealth()
        self._write = write
        try:
            self._held = list(json.loads(self.path.read_text()))
        except FileNotFoundError:
            self._held = []
        self.dirty = False

    def current(self) -> list[str]:
        return list(self._held)

    def apply(self, reclaim_id: str) -> None:
        if reclaim_id not in self._held:
            self._held.append(reclaim_id)
            self.dirty = True
            self.retry()

    def lift(self, reclaim_id: str) -> None:
        if reclaim_id in self._held:
            self._held.remove(reclaim_id)
            self.dirty = True
            self.retry()

    def retry(self) -> bool:
        if not self.dirty:
            return True
        try:
            self._write(self.path, list(self._held), 0o600)
        except OSError as e:
            self.health.failed(self.path, e)
            return False
        self.dirty = False
        self.health.wrote(self.path)
        return True

    def refuse_start(self) -> str | None:
        """Why a workload start must be refused now, or None."""
        held = self._held
        return f"node is locally tainted for {', '.join(held)}" if held else None


def write_deadline_file(
    path: Path, reclaim_id: str, terminate_at: float, grace_deadline: float, reason: str
) -> None:
    # Readable by workloads (bind-mounted read-only). The format has one definition, in
    # spotdrain.workload (the module workloads read it with); `reclaim_at` is G there.
    deadline = Deadline(reclaim_id, terminate_at, grace_deadline, reason)
    # Atomic, but no fsync: it is on the notice path, it lives in /run (gone with the power
    # anyway), and a restarted agent writes it again from the bundle before anything reads it.
    write_json(path, deadline.to_json(), durable=False)
