"""A reclamation's deadlines after they are set: how the provider's notice heard again may move
them (only earlier), and how they are published to the workloads (the deadline file) and to
the gates (DrainWorkers).

D, G and O are absolute and computed once, at the notice (Reclamation.begin); D is the earliest
the provider ever named (DESIGN "one interruption is one reclamation").
"""

from __future__ import annotations

from spotdrain.agent.core.reclamation_commands import (
    Command,
    DrainWorkers,
    Emit,
    WriteDeadlineFile,
)
from spotdrain.agent.core.reclamation_events import NoticeHeard
from spotdrain.agent.core.reclamation_record import ReclamationRecord

# The provider's notice heard again with a later D (kept, never moved) is recorded at most this
# often, with how many such were heard between: a source that re-stamps its document on every
# read (AWS's own mock) cannot fill the timeline.
LATER_NOTICE_RECORDED_EVERY_S = 10.0


def deadline_file(rec: ReclamationRecord) -> WriteDeadlineFile:
    return WriteDeadlineFile(rec.reclaim_id, rec.terminate_at, rec.grace_deadline, rec.reason)


def publish_deadlines(rec: ReclamationRecord) -> list[Command]:
    """The deadline file written and recorded, then every inference worker unrouted at its
    gate until G (docs/design.md "Hard notice timeline", step 4)."""
    return [
        deadline_file(rec),
        Emit(
            "deadline_file_written",
            {"terminate_at": rec.terminate_at, "grace_deadline": rec.grace_deadline},
        ),
        DrainWorkers(rec.reclaim_id, rec.grace_deadline),
    ]


def notice_heard_again(rec: ReclamationRecord, ev: NoticeHeard) -> list[Command]:
    """The provider's notice read again. The same document records nothing; an earlier D
    moves D, G and O earlier by the same shift while the drain is on (and republishes them);
    a later D, or any D once the drain has ended, is recorded at most once every
    LATER_NOTICE_RECORDED_EVERY_S and moves nothing. The caller checks the moved deadlines
    against the time (an earlier G or O may have passed already)."""
    said = ev.terminate_at if ev.terminate_at is not None else rec.heard_terminate_at
    if (ev.action, said) == (rec.heard_action, rec.heard_terminate_at):
        return []  # the same document read again (another poll, an agent restart)
    acted = ev.action != rec.heard_action
    rec.heard_action, rec.heard_terminate_at = ev.action, said
    earlier = said is not None and said < rec.terminate_at
    movable = earlier and rec.phase != "done" and not rec.lifted
    if not (acted or movable):
        since = rec.later_recorded_at
        if since is not None and ev.now - since < LATER_NOTICE_RECORDED_EVERY_S:
            rec.later_unrecorded += 1
            return []
        rec.later_recorded_at = ev.now
    if movable:
        assert said is not None
        shift = rec.terminate_at - said
        rec.terminate_at -= shift
        rec.grace_deadline -= shift
        rec.overrun_at -= shift
    details = {
        "action": ev.action,
        "heard_terminate_at": said,
        "terminate_at": rec.terminate_at,
        "grace_deadline": rec.grace_deadline,
        "overrun_at": rec.overrun_at,
        "moved": movable,
        "unrecorded": rec.later_unrecorded,
    }
    rec.later_unrecorded = 0
    commands: list[Command] = [Emit("notice_updated", details)]
    if movable and rec.phase == "draining":
        # The workloads' file and the gates learn the earlier deadlines at once.
        commands += publish_deadlines(rec)
    return commands
