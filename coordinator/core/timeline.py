"""One record per reclamation, folded from its events. Pure: a dict and an event in, a dict out.

The agent owns the deadlines (computed once at T0, docs/design.md invariant 2); the coordinator
copies them from `notice_received` and never computes its own.
"""

from __future__ import annotations

from typing import Any

OUTCOME_KINDS = {"drained": "drained", "overrun": "overrun"}
LOST = "lost"  # a lost node's record: its reason and its outcome


def new_record(reclaim_id: str, node_id: str) -> dict[str, Any]:
    return {
        "reclaim_id": reclaim_id,
        "node_id": node_id,
        "notice_id": "",
        "reason": "",
        "source": "",
        "t0": 0.0,
        "terminate_at": 0.0,
        "grace_deadline": 0.0,
        "overrun_at": 0.0,
        "outcome": "",
        "spare_s": None,
        "steps": {},
    }


def fold(record: dict[str, Any], kind: str, wall_time: float, details: dict[str, Any]) -> None:
    """Apply one event to its reclamation's record, in place."""
    steps: dict[str, float] = record["steps"]
    if kind == "notice_received":
        for key in ("notice_id", "reason", "source"):
            record[key] = str(details.get(key, record[key]))
        for key in ("t0", "terminate_at", "grace_deadline", "overrun_at"):
            if isinstance(details.get(key), int | float):
                record[key] = float(details[key])
    if kind == "node_lost":
        # A node gone without notice (coordinator/fleet/lost.py): a record of its own kind,
        # T0 when it was last seen, counted apart from drains and overruns.
        record["reason"], record["source"] = LOST, "coordinator"
        record["outcome"] = record["outcome"] or LOST
        if isinstance(details.get("since"), int | float):
            record["t0"] = float(details["since"])
    if kind == "notice_updated" and details.get("moved"):  # the provider named an earlier D
        for key in ("terminate_at", "grace_deadline", "overrun_at"):
            if isinstance(details.get(key), int | float):
                record[key] = min(float(details[key]), record.get(key) or float("inf"))
    # First occurrence of each step; a local then remote taint keeps both.
    step = kind
    if kind == "tainted":
        step = f"tainted_{details.get('mode', '')}"
    steps.setdefault(step, wall_time)
    if kind in ("container_exited", "sigterm_sent", "sigkill_sent"):
        steps[f"last_{kind}"] = max(wall_time, steps.get(f"last_{kind}", wall_time))
    if kind in OUTCOME_KINDS and not record["outcome"]:
        record["outcome"] = OUTCOME_KINDS[kind]
        if kind == "drained" and isinstance(details.get("spare_s"), int | float):
            record["spare_s"] = float(details["spare_s"])
    if kind == "notice_cancelled" and details.get("lifted") and not record["outcome"]:
        record["outcome"] = "cancelled"
    _contract(record, kind, wall_time, details)


# How a signalled container's reclamation ended, for its image's contract
# (coordinator/capacity/contracts.py): it exited before G, it was killed at G, or it was still
# there at O.
EXITED, KILLED, OVERRUN = "exited", "killed", "overrun"


def _contract(record: dict[str, Any], kind: str, wall_time: float, details: dict[str, Any]) -> None:
    """Each container the reclamation SIGTERMed, by image and kind, and its end once known.
    Newly known ends go to record["_contract"] as (image, kind, end) for the store to count in
    the same transaction (each event is folded once, so each end is counted once)."""
    containers: dict[str, dict[str, Any]] = record.get("containers", {})
    cid = details.get("container")

    def ended(c: dict[str, Any], end: str) -> None:
        c["end"] = end
        record.setdefault("_contract", []).append((c["image"], c["kind"], end))

    if kind == "sigterm_sent" and isinstance(cid, str) and cid not in containers:
        image, wkind = details.get("image"), details.get("kind")
        if isinstance(image, str) and image and isinstance(wkind, str) and len(containers) < 1000:
            containers[cid] = {
                "image": image[:300],
                "kind": wkind[:40],
                "name": str(details.get("name", ""))[:300],
                "end": "",
            }
            record["containers"] = containers
    elif kind == "overrun":
        # Work still there at O: final for every tracked container not yet ended (O is past).
        still = details.get("still_running")
        names = {n for n in still if isinstance(n, str)} if isinstance(still, list) else set()
        for c in containers.values():
            if not c["end"] and c["name"] in names:
                ended(c, OVERRUN)
    elif kind == "container_exited" and isinstance(cid, str) and cid in containers:
        c = containers[cid]
        if not c["end"]:
            grace = record["grace_deadline"]
            ended(c, KILLED if grace and wall_time >= grace else EXITED)
