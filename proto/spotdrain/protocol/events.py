"""Lifecycle event kinds (docs/design.md "Lifecycle events") and their JSON form for spotctl."""

from __future__ import annotations

import json
from typing import Any

from spotdrain.v1 import spotdrain_pb2 as pb

KINDS = frozenset(
    {
        "notice_received",
        "notice_updated",
        "notice_invalid",
        "tainted",
        "worker_draining",
        "deadline_file_written",
        "sigterm_sent",
        "signal_failed",
        "container_exited",
        "sigkill_sent",
        "stream_interrupted",
        "verification_failed",
        "verified_empty",
        "drained",
        "overrun",
        "replacement_requested",
        "workload_disabled",
        "workload_enabled",
        "notice_cancelled",
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
        # recorded by the coordinator itself
        "identity_refused",
        "node_registered",
        "workload_contract_flagged",
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
