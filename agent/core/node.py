"""The node's rules over all its reclamations: events and the time in, commands out.

One reclamation (agent/core/reclamation.py) knows its own deadlines and signals; the node holds
every live one and the recently finished ones, and decides what concerns them together:

- which notice is which reclamation: a notice heard again (another read, another source, a
  restarted agent) is routed to the reclamation it opened, finished or not; a cancel of a notice
  this node never had is recorded, and changes nothing;
- the deadline file: one per node, it shows the reclamation in force with the earliest G; a
  later one never moves it, and a lift shows the next one in force (or removes it);
- SIGTERM at most once per container across reclamations (one preemption heard by two sources):
  a round's targets, and a listing made ahead, leave out what another reclamation SIGTERMed or
  announced;
- which reclamation a workload's report belongs to;
- the owner's pause and resume, and whether a workload may start (invariant 4), from memory: the
  bundles are read once, at start (the node is made from them), so a start never waits on the
  disk;
- which finished bundles are forgotten (Retention).

Pure: no asyncio, no files, no clock. The shell (agent/drain/executor.py) carries out the commands
in order: a Stepped saves that reclamation's bundle before any of its commands runs.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from spotdrain.agent.core.notice import Notice, NoticeInvalid
from spotdrain.agent.core.reclamation import Margins, Reclamation, reclaim_id_for
from spotdrain.agent.core.reclamation_commands import (
    SIGTERM,
    Command,
    ForgetBundles,
    LiftTaints,
    NodeCommand,
    Record,
    ReleaseEvents,
    RemoveDeadlineFile,
    ResumeCoordinator,
    Settled,
    Stepped,
    StopResumingCoordinator,
    WriteDeadlineFile,
)
from spotdrain.agent.core.reclamation_events import (
    Cancelled,
    ContainerExited,
    DeadlinesDue,
    Event,
    ForReclamation,
    ManagerNoted,
    NodeEvent,
    NoticeArrived,
    NoticeHeard,
    PauseAsked,
    ReportInvalid,
    ReportLanded,
    Restarted,
    ResumeAsked,
    Resumed,
    RoundListed,
    RoundTarget,
    TaintAnswered,
    TaintUnanswered,
    Tick,
    WorkloadReported,
)
from spotdrain.agent.core.signal_ledger import (
    TERM_ANNOUNCED,
    TERM_BY_PREVIOUS_RUN,
    TERM_SENT,
    ledger,
)
from spotdrain.protocol.machine import InvalidState

# A rental stopped past a G is attributed to that reclamation if it is live or among this many
# finished while this agent ran (an older one's G says nothing of a stop today).
RECENT_ATTRIBUTED = 8
_SIGTERMED = (TERM_ANNOUNCED, TERM_SENT, TERM_BY_PREVIOUS_RUN)


@dataclass(frozen=True)
class Retention:
    """When a finished reclamation's bundle is forgotten: once it is outside the `kept` newest
    finished ones AND its D passed more than `kept_s` ago. Until then it answers its notice read
    again (one provider event is one reclamation), `settled` and the late exit. A pause still
    in force is never forgotten: it is the node's pause."""

    kept: int = 32
    kept_s: float = 7 * 24 * 3600.0

    def __post_init__(self) -> None:
        if self.kept < 0 or self.kept_s < 0:
            raise ValueError(f"retention must not be negative, got {self}")


class Node:
    """Every reclamation of one node, and the rules between them. One mutator: handle()."""

    def __init__(
        self,
        node_id: str,
        margins: Margins,
        pause_notice_s: float,
        retention: Retention = Retention(),
        bundles: Iterable[Reclamation] = (),
    ) -> None:
        """`bundles`: every bundle in the state directory, read once when the agent starts; the
        node holds them from then on (a start never waits on the disk)."""
        self.node_id = node_id
        self.margins = margins
        self.pause_notice_s = pause_notice_s
        self.retention = retention
        self.live: dict[str, Reclamation] = {}
        # Finished ones still remembered, in the order they finished (oldest first).
        self.finished: dict[str, Reclamation] = {}
        # The ones finished while this agent ran, newest last: what a stop may be attributed to.
        self._finished_here: list[str] = []
        for rec in sorted(bundles, key=lambda rec: rec.t0):
            (self.finished if rec.finished else self.live)[rec.reclaim_id] = rec

    # --- the one mutator ---------------------------------------------------------------------

    def handle(self, event: NodeEvent, now: float) -> list[NodeCommand]:
        match event:
            case Restarted(delivered):
                sent = None if delivered is None else set(delivered)
                out: list[NodeCommand] = self._prune(now)
                for rec in list(self.live.values()):
                    out += self._carry(rec, rec.resume(now, sent))
                return out
            case NoticeArrived(parsed):
                return self._notice(parsed, now)
            case PauseAsked():
                return self._pause(now)
            case ResumeAsked():
                return self._resume(now)
            case ForReclamation(rid, ev):
                return self._route(rid, ev)
            case DeadlinesDue(listed):
                out = []
                for rec in list(self.live.values()):
                    tick = Tick(now, listed.get(rec.reclaim_id))
                    out += self._step(rec, self._sigterm_once(rec, tick), now)
                return out
            case ReportLanded(name, report, generation, nbytes, reported_at):
                owner = self.report_owner(name)
                if owner is None:
                    return []  # a periodic checkpoint outside any reclamation
                ev = WorkloadReported(now, name, report, generation, nbytes, reported_at)
                return self._step(owner, ev, now)
            case ReportInvalid(name, entry, why):
                owner = self.report_owner(name)
                return [
                    Record(
                        "workload_report_invalid",
                        owner.reclaim_id if owner else "",
                        now - owner.t0 if owner else None,
                        {"name": name, "file": entry, "reason": why},
                    )
                ]
        raise TypeError(event)

    # --- what the shell asks -----------------------------------------------------------------

    def get(self, reclaim_id: str) -> Reclamation | None:
        return self.live.get(reclaim_id) or self.finished.get(reclaim_id)

    def current_pause(self) -> Reclamation | None:
        """The owner's pause in force (drained or draining, not resumed), if any."""
        pauses = [rec for rec in self._all() if rec.reason == "pause" and not rec.lifted]
        return min(pauses, key=lambda rec: rec.reclaim_id, default=None)

    def refuse_start(self) -> str | None:
        """Why no workload may start now (invariant 4), as far as reclamations go, or None."""
        if any(not rec.lifted for rec in self.live.values()):
            return "node is draining"
        if self.current_pause() is not None:
            return "node is paused by its owner"
        return None

    def past_grace(self, now: float) -> Reclamation | None:
        """The reclamation whose grace deadline has passed (its SIGKILL round took whatever
        still ran), if any: what a container stopping now was stopped by."""
        recent = [self.finished[rid] for rid in self._finished_here if rid in self.finished]
        due = [
            rec
            for rec in (*self.live.values(), *recent)
            if not rec.lifted and rec.grace_deadline <= now
        ]
        return min(due, key=lambda rec: rec.grace_deadline, default=None)

    def report_owner(self, name: str) -> Reclamation | None:
        """The live reclamation a container's report belongs to: the one that knows it (it
        signalled or gated it), else the newest one still draining (it may not have reached
        it yet: the machine holds the report until it does)."""
        draining = [rec for rec in self.live.values() if not rec.lifted and rec.phase != "done"]
        known = [rec for rec in draining if name in rec.names.values()]
        return max(known or draining, key=lambda rec: rec.t0, default=None)

    def sigtermed_elsewhere(self, reclaim_id: str) -> frozenset[str]:
        """Containers another reclamation has SIGTERMed (or announced): a second notice for
        the same machine (two sources, one preemption) must not signal them again."""
        return frozenset(
            c
            for o in self._all()
            if o.reclaim_id != reclaim_id
            for c in (*o.announced, *o.signalled)
            if ledger(o, c) in _SIGTERMED
        )

    # --- invariants --------------------------------------------------------------------------

    def broken_invariants(self) -> list[str]:
        broken = []
        for rid in self.live.keys() & self.finished.keys():
            broken.append(f"{rid} both live and finished")
        for held, finished in ((self.live, False), (self.finished, True)):
            for rid, rec in held.items():
                if rid != rec.reclaim_id:
                    broken.append(f"{rec.reclaim_id} held as {rid}")
                if rec.finished != finished:
                    broken.append(f"{rid} {'not ' if finished else ''}finished but held so")
                broken += [f"{rid}: {why}" for why in rec.broken_invariants()]
        in_force = sorted(
            rec.reclaim_id for rec in self._all() if rec.reason == "pause" and not rec.lifted
        )
        if len(in_force) > 1:
            broken.append(f"{len(in_force)} pauses in force: {in_force}")
        sigtermed = Counter(
            c
            for rec in self._all()
            for c in {*rec.announced, *rec.signalled}
            if ledger(rec, c) in _SIGTERMED
        )
        twice = sorted(c for c, n in sigtermed.items() if n > 1)
        if twice:
            broken.append(f"SIGTERMed by two reclamations: {twice}")
        return broken

    def validate(self) -> None:
        """Raise InvalidState naming every invariant broken (tests call it after each step)."""
        broken = self.broken_invariants()
        if broken:
            raise InvalidState("node", self.node_id, broken)

    # --- transitions -------------------------------------------------------------------------

    def _notice(self, parsed: Notice | NoticeInvalid, now: float) -> list[NodeCommand]:
        if isinstance(parsed, NoticeInvalid):
            invalid = {"reason": parsed.reason, "content_hash": parsed.content_hash}
            return [Record("notice_invalid", details=invalid)]
        # A finished reclamation takes its cancel and its updates too: the same provider event
        # is one reclamation however often it is read (an agent restarted with a cancel still
        # in the notice file reads it again; AWS's mock re-stamps its document on every read).
        rec = self.get(reclaim_id_for(self.node_id, parsed.key))
        if parsed.action == "cancel":
            if rec is None:  # a cancel of a notice this node never had
                unknown = {"notice_id": parsed.notice_id, "lifted": False, "known": False}
                return [Record("notice_cancelled", details=unknown)]
            return self._step(rec, Cancelled(now), now)
        if rec is not None:
            # Heard again: the machine decides what, if anything, it changes (D only earlier).
            return self._step(rec, NoticeHeard(now, parsed.action, parsed.terminate_at), now)
        rec, commands = Reclamation.begin(parsed, self.node_id, now, self.margins)
        self.live[rec.reclaim_id] = rec
        return self._carry(rec, commands)

    def _pause(self, now: float) -> list[NodeCommand]:
        """A reclamation with D = now + the pause notice. Pausing a paused node changes nothing:
        the pause in force keeps its deadlines (invariant 2)."""
        if self.current_pause() is not None:
            return []
        notice = Notice(
            key=f"pause:{now:.6f}",
            notice_id=f"pause-{int(now)}",
            action="pause",
            terminate_at=now + self.pause_notice_s,
            source="owner",
        )
        rec, commands = Reclamation.begin(notice, self.node_id, now, self.margins, "pause")
        self.live[rec.reclaim_id] = rec
        return [StopResumingCoordinator(), *self._carry(rec, commands)]

    def _resume(self, now: float) -> list[NodeCommand]:
        """Every pause ends: its taints are lifted, workloads go back on."""
        pauses = sorted(
            (rec for rec in self._all() if rec.reason == "pause" and not rec.lifted),
            key=lambda rec: rec.reclaim_id,
        )
        if not pauses:
            # Nothing paused here, but the coordinator may still hold the flag off (a pause
            # made while this agent's state was lost): turn it on.
            return [ResumeCoordinator()]
        out: list[NodeCommand] = []
        for rec in pauses:
            self.finished.pop(rec.reclaim_id, None)
            self.live[rec.reclaim_id] = rec
            out += self._step(rec, Resumed(now), now)
        return out

    def _route(self, reclaim_id: str, event: Event) -> list[NodeCommand]:
        rec = self.live.get(reclaim_id)
        if rec is not None:
            return self._step(rec, self._sigterm_once(rec, event), event.now)
        rec = self.finished.get(reclaim_id)
        if rec is not None and isinstance(event, ContainerExited | ManagerNoted):
            # Verified empty (and finished) before the engine's wait came back, or before a
            # manager's late note (a requeue that landed, the DRAIN lifted): it still belongs
            # in its timeline.
            return self._step(rec, event, event.now)
        return []

    def _sigterm_once(self, rec: Reclamation, event: Event) -> Event:
        """A round's SIGTERM targets, and the listing made during the Taint call, without the
        containers another reclamation SIGTERMed. That listing only counts while the
        reclamation is still tainting (its first SIGTERM round announces it in this step)."""
        if isinstance(event, RoundListed):
            if event.signal != SIGTERM:
                return event
            return dataclasses.replace(event, targets=self._not_sigtermed(rec, event.targets))
        if not isinstance(event, TaintAnswered | TaintUnanswered | Tick) or event.listed is None:
            return event
        if rec.phase != "tainting":
            return dataclasses.replace(event, listed=None)
        return dataclasses.replace(event, listed=self._not_sigtermed(rec, event.listed))

    def _not_sigtermed(
        self, rec: Reclamation, targets: tuple[RoundTarget, ...]
    ) -> tuple[RoundTarget, ...]:
        already = self.sigtermed_elsewhere(rec.reclaim_id)
        return tuple(t for t in targets if t.container not in already)

    def _step(self, rec: Reclamation, event: Event, now: float) -> list[NodeCommand]:
        rid = rec.reclaim_id
        out = self._carry(rec, rec.handle(event))
        if rec.lifted or rec.phase == "done":
            out.append(ReleaseEvents(rid))  # no SIGTERM round left to wait for
        if rec.outcome:
            out.append(Settled(rid, rec.outcome))
        if rec.finished:
            self.live.pop(rid, None)
            self.finished.pop(rid, None)
            self.finished[rid] = rec
            if rid in self._finished_here:
                self._finished_here.remove(rid)
            self._finished_here = [*self._finished_here, rid][-RECENT_ATTRIBUTED:]
            out += self._prune(now, stepped=rid)
        elif rid not in self.live:
            # A finished one reopened (a cancel that lifts a drained node): live again until
            # the coordinator confirms the lift, so its TaintsLifted reaches it.
            self.finished.pop(rid, None)
            self.live[rid] = rec
        return out

    def _carry(self, rec: Reclamation, commands: list[Command]) -> list[NodeCommand]:
        """The reclamation's commands, its deadline file replaced by the node's: the file comes
        first (before the bundle is saved: a restarted agent writes it again, or removes it)."""
        files: list[NodeCommand] = []
        rest: list[Command] = []
        for cmd in commands:
            if isinstance(cmd, WriteDeadlineFile):
                files.append(self._deadline_file(rec, cmd))
                continue
            if isinstance(cmd, LiftTaints):
                files.append(self._deadline_file_after_lift(rec))
            rest.append(cmd)
        return [*files, Stepped(rec.reclaim_id, tuple(rest))]

    def _deadline_file(self, rec: Reclamation, cmd: WriteDeadlineFile) -> WriteDeadlineFile:
        # With two reclamations in force (one preemption heard by two sources) the file keeps
        # the earlier G; a later one never moves it.
        first = self._earliest_other(rec)
        if first is not None and first.grace_deadline < cmd.grace_deadline:
            return self._file_for(first)
        return cmd

    def _deadline_file_after_lift(self, rec: Reclamation) -> WriteDeadlineFile | RemoveDeadlineFile:
        # A lift removes the file only when no other drain is in force (one preemption heard by
        # two sources, one of them withdrawn); else it names that drain.
        other = self._earliest_other(rec)
        if other is not None and other.phase == "draining":
            return self._file_for(other)
        return RemoveDeadlineFile()

    @staticmethod
    def _file_for(rec: Reclamation) -> WriteDeadlineFile:
        return WriteDeadlineFile(rec.reclaim_id, rec.terminate_at, rec.grace_deadline, rec.reason)

    def _earliest_other(self, rec: Reclamation) -> Reclamation | None:
        """The other reclamation in force with the earliest grace deadline, if any."""
        others = [
            o
            for o in self._all()
            if o.reclaim_id != rec.reclaim_id and not o.lifted and not o.finished
        ]
        return min(others, key=lambda o: o.grace_deadline, default=None)

    def _prune(self, now: float, stepped: str = "") -> list[NodeCommand]:
        """Forget the finished bundles Retention lets go (never the one this step moved: its
        commands are still to be carried out)."""
        keep = self.retention
        prunable = [
            rec for rec in self.finished.values() if not (rec.reason == "pause" and not rec.lifted)
        ]
        older = sorted(prunable, key=lambda rec: rec.t0, reverse=True)[keep.kept :]
        gone = tuple(
            rec.reclaim_id
            for rec in older
            if rec.terminate_at < now - keep.kept_s and rec.reclaim_id != stepped
        )
        for rid in gone:
            del self.finished[rid]
        return [ForgetBundles(gone)] if gone else []

    def _all(self) -> list[Reclamation]:
        return [*self.live.values(), *self.finished.values()]
