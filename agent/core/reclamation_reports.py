"""Workload reports (checkpoint_started, checkpoint_committed) on a reclamation's timeline.

A report is recorded between its container's SIGTERM and its exit: one that arrives before the
signal is held in the record (bounded) until then, one after the exit is dropped. Nothing here
touches a deadline, a signal or verification (docs/design.md "Workload status directory").
"""

from __future__ import annotations

from typing import Any

from spotdrain.agent.core.reclamation_commands import Command, Emit
from spotdrain.agent.core.reclamation_events import WorkloadReported
from spotdrain.agent.core.reclamation_record import ReclamationRecord

# Reports held for a container the reclamation has not signalled yet (a job that saw the
# deadline file before its SIGTERM): at most this many each, so a chatty one cannot grow the
# bundle without bound.
PENDING_REPORTS_KEPT = 16


def reported(rec: ReclamationRecord, ev: WorkloadReported) -> list[Command]:
    """A report read from a status directory: recorded now, held, or dropped (see above)."""
    container = next((c for c, n in rec.names.items() if n == ev.name), None)
    if container is not None and container in rec.exited:
        return []
    doc: dict[str, Any] = {
        "report": ev.report,
        "generation": ev.generation,
        "seen_at": ev.now,
        "reported_at": ev.reported_at,
    }
    if ev.nbytes is not None:
        doc["bytes"] = ev.nbytes
    if container is None or (container not in rec.signalled and container not in rec.gated):
        held = rec.pending_reports.setdefault(ev.name, [])
        if len(held) < PENDING_REPORTS_KEPT:
            held.append(doc)
        return []
    return [_report_emit(rec, container, doc, ev.now)]


def held_reports(rec: ReclamationRecord, container: str, now: float | None) -> list[Command]:
    """The reports held for a container that is now signalled, draining or gone, stamped at
    `now` (its SIGTERM) or, without one, when each was read."""
    name = rec.names.get(container, "")
    return [
        _report_emit(rec, container, doc, now if now is not None else doc["seen_at"])
        for doc in rec.pending_reports.pop(name, [])
    ]


def _report_emit(rec: ReclamationRecord, container: str, doc: dict[str, Any], at: float) -> Emit:
    """The event for one report, stamped at `at`: when it was read, or, for one held
    until its container's SIGTERM, that SIGTERM (so the timeline keeps its order)."""
    at = max(at, doc["seen_at"])
    details: dict[str, Any] = {
        "container": container,
        "name": rec.names.get(container, ""),
        "generation": doc["generation"],
    }
    if "bytes" in doc:
        details["bytes"] = doc["bytes"]
    sigterm = rec.sigterm_at.get(container)
    details["since_sigterm_s"] = None if sigterm is None else round(max(at - sigterm, 0.0), 3)
    if doc["seen_at"] < (sigterm or doc["seen_at"]):
        details["before_sigterm"] = True
    details["reported_at"] = doc["reported_at"]
    return Emit(doc["report"], details, at=at)
