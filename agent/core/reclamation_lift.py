"""How a reclamation ends early: the provider cancels its notice, or the owner resumes a pause.
Both stop verifying and signalling and ask the coordinator to lift the taints (LiftTaints),
except a cancel after something was stopped: that drain goes on under the same deadlines.
"""

from __future__ import annotations

from typing import Any

from spotdrain.agent.core.reclamation_commands import Command, Emit, LiftTaints
from spotdrain.agent.core.reclamation_record import ReclamationRecord


def cancelled(rec: ReclamationRecord, now: float) -> list[Command]:
    """The notice's cancel, recorded once (the same cancel read again records nothing)."""
    if rec.cancel_recorded:
        return []
    rec.cancel_recorded = True
    details: dict[str, Any] = {"lifted": False}
    if rec.outcome:
        details["outcome"] = rec.outcome
    if rec.lifted or not _stopped_nothing(rec):
        # Lifted already (a resumed pause), or something was stopped: it stays stopped and
        # the drain goes on (or has ended) under the same deadlines; the taints stay.
        return [Emit("notice_cancelled", details)]
    # Nothing was stopped under this notice, the node verified empty or not: the provider
    # keeps the machine, so it is ours to use again (design: a cancel lifts what nothing
    # was stopped under). An outcome already recorded (drained) stands, as in the record.
    details["lifted"] = True
    rec.lifted_by_cancel = True
    rec.outcome = rec.outcome or "cancelled"
    if rec.phase != "done":  # verified empty already: done stays done
        rec.move("done", now, "Cancelled")
    return [Emit("notice_cancelled", details), LiftTaints(rec.reclaim_id)]


def resumed(rec: ReclamationRecord, now: float) -> list[Command]:
    """The owner resumed the node: a pause (only) ends, drained or not."""
    if rec.reason != "pause" or rec.lifted:
        return []
    if rec.phase == "done":
        rec.resumed = True
        return [Emit("pause_resumed", {"during_drain": False}), LiftTaints(rec.reclaim_id)]
    # The owner has the machine back: stop verifying and signalling. Workers already
    # draining finish on their own gates' deadlines.
    rec.outcome = rec.outcome or "resumed"
    rec.resumed = True
    rec.move("done", now, "Resumed")
    return [Emit("pause_resumed", {"during_drain": True}), LiftTaints(rec.reclaim_id)]


def _stopped_nothing(rec: ReclamationRecord) -> bool:
    """No container was signalled (by this process or the one before) nor drained at its
    gate under this notice, and no signal was ever announced (one announced may have been
    delivered, even if withdrawn after a restart): still tainting, or the SIGTERM round is
    over and found nothing."""
    if rec.phase == "tainting":
        return True
    return (
        rec.sigterm_round_done
        and not rec.signal_announced
        and not rec.signalled
        and not rec.gated
        and not rec.announced
    )
