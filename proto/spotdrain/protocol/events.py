"""Lifecycle event kinds (docs/design.md "Lifecycle events") and their JSON form for spotctl."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from spotdrain.v1 import spotdrain_pb2 as pb

# Every event kind the agent and the coordinator emit, defined once;
# tests/common/test_event_kinds.py reads the code and fails on a kind emitted or compared against
# that is missing here. The coordinator stores an agent's kinds as sent, never refusing one not
# listed: an agent newer than its coordinator would otherwise have its whole outbox refused.
KINDS = frozenset(
    {
        # a reclamation's story, told by the agent
        "notice_received",
        "notice_updated",
        "notice_invalid",
        "notice_cancelled",
        "pause_resumed",
        "tainted",
        "worker_draining",
        "deadline_file_written",
        "sigterm_sent",
        "signal_failed",
        "container_exited",
        "sigkill_sent",
        "stream_interrupted",
        "stream_continued",  # reported by a router: the cut stream went on elsewhere
        "verification_failed",
        # what a work manager (Docker, Slurm) notes beside the signals
        "manager_cordoned",
        "manager_cordon_failed",
        "manager_uncordoned",
        "requeued",
        "kill_wait_warning",
        "verified_empty",
        "drained",
        "overrun",
        # notice sources and early warnings
        "notice_source_down",
        "notice_source_up",
        "notice_acknowledged",
        "notice_acknowledge_failed",
        "advisory_received",
        "advisory_lifted",
        # what a workload reports through its status directory (spotdrain.workload)
        "checkpoint_started",
        "checkpoint_committed",
        "workload_report_invalid",
        # the agent's own disk and outbox
        "state_write_failed",
        "state_write_resumed",
        "events_dropped",
        # recorded by the coordinator: workers and placement
        "worker_starting",
        "worker_ready",
        "worker_stopped",
        "worker_refused",
        "worker_missing",
        "worker_start_timeout",
        "placement_refused",
        "workload_disabled",
        "workload_enabled",
        "workload_contract_flagged",
        # recorded by the coordinator: capacity and replacements
        "model_replicas_set",
        "capacity_short",
        "capacity_start_failed",
        "replacement_requested",
        "replacement_result",
        "replacement_unavailable",
        # recorded by the coordinator: rentals, nodes and callers
        "rental_created",
        "rental_reclaim_set",
        "rental_reclaim_lifted",
        "rental_ended",
        "node_spot_changed",
        "node_lost",
        "node_returned",
        "spot_change_refused",
        "provider_change_refused",
        "identity_refused",
        "recovery_failed",
    }
)


def stored_event_to_dict(stored: pb.StoredEvent) -> dict[str, Any]:
    ev = stored.event
    out: dict[str, Any] = {
        "id": stored.id,
        "kind": ev.kind,
        "node": ev.node_id,
        "reclaim_id": ev.reclaim_id or None,
        "wall_time": ev.wall_time,
        "t_offset_s": ev.t_offset_s if ev.HasField("t_offset_s") else None,
        "uid": ev.uid,
    }
    details = json.loads(ev.details_json) if ev.details_json else {}
    for key, value in (details if isinstance(details, dict) else {}).items():
        # The stored fields win: a detail may not pass itself off as another node's event or
        # another kind; one that shares a name is kept beside them as `detail.<name>`.
        out[f"detail.{key}" if key in out else key] = value
    return out


@dataclass(frozen=True)
class EventHead:
    """What every event carries beside its details, wherever it is held: its uid makes a repeat
    harmless; wall_time is the sender's clock, t_offset_s the seconds since its reclamation's
    notice (None outside one)."""

    uid: str
    kind: str
    node_id: str
    reclaim_id: str
    wall_time: float
    t_offset_s: float | None


@dataclass(frozen=True)
class EventRecord(EventHead):
    """One event as an agent's outbox holds it and the coordinator's store takes it (the wire's
    Event)."""

    details: dict[str, Any]


def event_message(ev: EventHead, details_json: str) -> pb.Event:
    """The wire's Event, for the agent's link and the coordinator's answers alike: the head's
    fields by the same names."""
    msg = pb.Event(details_json=details_json)
    for name in _HEAD_FIELDS:
        value = getattr(ev, name)
        if value is not None:  # t_offset_s: absent outside a reclamation, not 0
            setattr(msg, name, value)
    return msg


_HEAD_FIELDS = tuple(f.name for f in fields(EventHead))
