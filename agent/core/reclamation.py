"""The agent's reclamation state machine: events and the time in, commands out.

Pure: no asyncio, docker, grpc, pynvml or files. The shell (agent/drain/runner.py) persists the
machine's state after every call and before it carries out the commands, so the bundle on disk
is always at least as new as anything the node did (docs/design.md invariants 2 and 8).

Order is fixed (invariant 1): no signal command is returned before a taint is in force.

The state it acts on is its record (reclamation_record.py: the stored fields, the phase table,
the invariants). SIGTERM-once and the signal rounds are the signal ledger's (signal_ledger.py);
checkpoint reports are reclamation_reports.py's; a notice heard again moves the deadlines in
reclamation_deadlines.py; a cancel or a resume ends it early (reclamation_lift.py). This module
holds the transitions between them and the one mutator, `handle`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

from spotdrain.agent.core.notice import Notice
from spotdrain.agent.core.reclamation_commands import (
    SIGKILL,
    SIGTERM,
    ApplyLocalTaint,
    Command,
    CutWorkers,
    DrainWorkers,
    Emit,
    LiftTaints,
    Observe,
    RequestTaint,
    RetryRemoteTaint,
    WatchExits,
)
from spotdrain.agent.core.reclamation_deadlines import (
    deadline_file,
    notice_heard_again,
    publish_deadlines,
)
from spotdrain.agent.core.reclamation_events import (
    MANAGER_NOTES,
    Cancelled,
    ContainerExited,
    ContainerSignalled,
    Event,
    ManagerNoted,
    NoticeHeard,
    Observed,
    Resumed,
    RoundListed,
    RoundTarget,
    SignalRoundDone,
    TaintAnswered,
    TaintsLifted,
    TaintUnanswered,
    Tick,
    WorkersDraining,
    WorkloadReported,
)
from spotdrain.agent.core.reclamation_lift import cancelled, resumed
from spotdrain.agent.core.reclamation_record import ReclamationRecord
from spotdrain.agent.core.reclamation_reports import held_reports, reported
from spotdrain.agent.core.signal_ledger import (
    deliver,
    previous_run_announcements,
    round_done,
    signal_result,
    start_round,
    strays,
)
from spotdrain.protocol import timing


@dataclass(frozen=True)
class Margins:
    """Where G and O sit before D. Configurable so tests run whole timelines in seconds."""

    default_notice_s: float = timing.NOTICE_S  # D = T0 + this when the notice names no time
    grace_s: float = timing.GRACE_S  # G = D - grace_s
    overrun_s: float = timing.OVERRUN_S  # O = D - overrun_s
    taint_answer_s: float = 0.8  # the remote Taint call's deadline
    observe_every_s: float = 0.5  # re-observe while work remains

    def __post_init__(self) -> None:
        if not 0 <= self.overrun_s <= self.grace_s:
            raise ValueError(f"need 0 <= overrun margin <= grace margin, got {self}")
        if self.taint_answer_s <= 0 or self.observe_every_s <= 0 or self.default_notice_s <= 0:
            raise ValueError(f"margins must be positive, got {self}")


def _stamp(commands: list[Command], now: float) -> list[Command]:
    return [
        dataclasses.replace(c, at=now) if isinstance(c, Emit) and c.at is None else c
        for c in commands
    ]


def reclaim_id_for(node_id: str, notice_key: str) -> str:
    """Deterministic, so a restarted agent and a duplicate notice name the same reclamation."""
    return "rcl-" + hashlib.sha256(f"{node_id}\0{notice_key}".encode()).hexdigest()[:16]


@dataclass
class Reclamation(ReclamationRecord):
    """One reclamation's rules: `begin` at the notice, `resume` after an agent restart, and
    `handle`, the one mutator, for everything the shell learns in between."""

    # --- construction ----------------------------------------------------------------------

    @classmethod
    def begin(
        cls, notice: Notice, node_id: str, now: float, margins: Margins, reason: str = "notice"
    ) -> tuple[Reclamation, list[Command]]:
        terminate_at = (
            notice.terminate_at
            if notice.terminate_at is not None
            else now + margins.default_notice_s
        )
        rec = cls(
            reclaim_id=reclaim_id_for(node_id, notice.key),
            node_id=node_id,
            notice_key=notice.key,
            notice_id=notice.notice_id,
            source=notice.source,
            reason=reason,
            t0=now,
            terminate_at=terminate_at,
            grace_deadline=terminate_at - margins.grace_s,
            overrun_at=terminate_at - margins.overrun_s,
            observe_every_s=margins.observe_every_s,
            taint_answer_s=margins.taint_answer_s,
            taint_answer_by=now + margins.taint_answer_s,
            heard_action=notice.action,
            heard_terminate_at=notice.terminate_at,
        )
        commands: list[Command] = [
            Emit(
                "notice_received",
                {
                    "notice_id": notice.notice_id,
                    "action": notice.action,
                    "source": notice.source,
                    "reason": reason,
                    "t0": rec.t0,
                    "terminate_at": rec.terminate_at,
                    "grace_deadline": rec.grace_deadline,
                    "overrun_at": rec.overrun_at,
                    "late": now >= rec.terminate_at,
                },
            ),
            RequestTaint(rec.reclaim_id, rec.taint_answer_by),
        ]
        return rec, _stamp(commands, now)

    def resume(self, now: float, delivered: set[str] | None = None) -> list[Command]:
        """After an agent restart: carry on from the stored progress, same deadlines.
        `delivered`: of the SIGTERMs the old process announced, those the engine says it was
        asked to send (None: it cannot tell, and every announced one counts as sent)."""
        previous = previous_run_announcements(self, delivered, now)
        if self.lifted:
            # A cancel or resume that the coordinator may not have heard of yet: say it again.
            lift = [] if self.lift_acknowledged else [LiftTaints(self.reclaim_id)]
            return _stamp([*previous, *lift], now)
        if self.phase == "done":
            if self.taint_mode == "local" and not self.remote_taint:
                return _stamp([*previous, RetryRemoteTaint(self.reclaim_id)], now)
            return _stamp(previous, now)
        commands: list[Command] = list(previous)
        if self.phase == "tainting":
            # The taint call's answer was lost with the old process; ask again with a fresh
            # 800 ms allowance. A local taint (if it was applied) is still on disk.
            self.taint_answer_by = now + self.taint_answer_s
            return _stamp(
                [RequestTaint(self.reclaim_id, self.taint_answer_by), *self._tick(now)], now
            )
        if self.taint_mode == "local":
            commands.append(ApplyLocalTaint(self.reclaim_id))
            if not self.remote_taint:
                commands.append(RetryRemoteTaint(self.reclaim_id))
        commands.append(deadline_file(self))
        self.observing = False
        # Rounds in flight died with the old process. What they announced counts as signalled
        # (above); anything else still running was never signalled and gets its signal as a
        # stray at the first observation, never a second time.
        self.rounds_in_flight = 0
        if self.sigterm_round:
            self.sigterm_round_done = True
        # Gates died with the old process; the new one re-adopts the workers: drain them again.
        commands.append(DrainWorkers(self.reclaim_id, self.grace_deadline))
        if not self.sigterm_round:
            self.sigterm_round = True
            commands.append(start_round(self, SIGTERM))
        else:
            live = tuple(c for c in self.signalled if c not in self.exited)
            if live:
                commands.append(WatchExits(live))
        return _stamp(commands + self._observe(now) + self._tick(now), now)

    # --- the one mutator -------------------------------------------------------------------

    def handle(self, event: Event) -> list[Command]:
        return _stamp(self._dispatch(event), event.now)

    def _dispatch(self, event: Event) -> list[Command]:
        match event:
            case TaintAnswered(now, listed):
                return self._taint_answered(now, listed)
            case TaintUnanswered(now, error, listed):
                return self._taint_unanswered(now, error, listed)
            case ContainerSignalled():
                return signal_result(self, event)
            case RoundListed():
                return deliver(self, event)
            case SignalRoundDone(now, signal):
                return self._observe(now) if round_done(self, now, signal) else []
            case ContainerExited(now, container, name, code, state):
                return self._exited(now, container, name, code, state)
            case Observed():
                return self._observed(event)
            case WorkersDraining(now, containers, names):
                return self._workers_draining(containers, names)
            case Resumed(now):
                return resumed(self, now)
            case TaintsLifted():
                self.lift_acknowledged = True
                return []
            case Tick(now, listed):
                return self._tick(now, listed)
            case Cancelled(now):
                return cancelled(self, now)
            case WorkloadReported():
                return reported(self, event)
            case ManagerNoted(now, kind, details):
                if kind not in MANAGER_NOTES:
                    raise ValueError(f"{self.reclaim_id}: {kind!r} is not a manager's note")
                return [Emit(kind, dict(details))]
            case NoticeHeard():
                before = self.terminate_at
                commands = notice_heard_again(self, event)
                if self.terminate_at < before:  # moved: an earlier G or O may have passed
                    commands += self._deadlines(event.now)
                return commands
        raise TypeError(event)

    def next_wakeup(self) -> float | None:
        """The earliest absolute time at which a Tick may change something."""
        if self.finished or self.lifted:
            return None
        times = []
        if self.next_observe_at is not None and not self.observing:
            times.append(self.next_observe_at)
        if self.phase == "tainting":
            times.append(self.taint_answer_by)
        if self.phase == "draining" and not self.sigkill_round:
            times.append(self.grace_deadline)
        if not self.outcome:
            times.append(self.overrun_at)
        return min(times) if times else None

    # --- transitions -----------------------------------------------------------------------

    def _taint_answered(
        self, now: float, listed: tuple[RoundTarget, ...] | None = None
    ) -> list[Command]:
        if self.remote_taint or self.lifted:
            return []
        self.remote_taint = True
        if self.phase == "tainting":
            self.taint_mode = "remote"
            return [Emit("tainted", {"mode": "remote"})] + self._evict(now, listed)
        # A background retry landed after the local fallback: the coordinator knows now.
        return [Emit("tainted", {"mode": "remote", "after_local": True})]

    def _taint_unanswered(
        self, now: float, error: str, listed: tuple[RoundTarget, ...] | None = None
    ) -> list[Command]:
        if self.phase != "tainting" or self.lifted:
            return []
        self.taint_mode = "local"
        commands: list[Command] = [
            ApplyLocalTaint(self.reclaim_id),
            Emit("tainted", {"mode": "local", "remote_error": error}),
            RetryRemoteTaint(self.reclaim_id),
        ]
        return commands + self._evict(now, listed)

    def _evict(self, now: float, listed: tuple[RoundTarget, ...] | None = None) -> list[Command]:
        # Invariant 1: only reached once a taint (remote or local) is in force.
        self.move("draining", now, f"tainted ({self.taint_mode})")
        self.sigterm_round = True
        # Unrouted, then signalled (docs/design.md "Hard notice timeline", step 4).
        commands: list[Command] = [
            *publish_deadlines(self),
            start_round(self, SIGTERM, listed=listed, now=now),
        ]
        return commands + self._tick(now)

    def _workers_draining(
        self, containers: tuple[str, ...], names: tuple[str, ...]
    ) -> list[Command]:
        commands: list[Command] = []
        new = []
        for container, name in zip(containers, names, strict=True):
            if container in self.gated:
                continue
            self.gated.append(container)
            self.names[container] = name
            commands.append(Emit("worker_draining", {"container": container, "name": name}))
            commands += held_reports(self, container, None)
            if container not in self.exited:
                new.append(container)
        if new:
            commands.append(WatchExits(tuple(new)))
        return commands

    def _exited(
        self, now: float, container: str, name: str, code: int, state: str = ""
    ) -> list[Command]:
        if container in self.exited:
            return []
        self.names.setdefault(container, name)
        # Reports it made before it exited come first (the shell read them before this event).
        commands: list[Command] = held_reports(self, container, None)
        self.exited[container] = code
        details: dict[str, Any] = {"container": container, "name": name, "exit_code": code}
        if state:
            details["state"] = state
        commands.append(Emit("container_exited", details))
        if all(c in self.exited for c in [*self.signalled, *self.gated]):
            # The last exit: verify now rather than at the next periodic observation.
            commands += self._observe(now)
        return commands

    def _observe(self, now: float) -> list[Command]:
        if self.verified_at is not None or self.lifted:
            return []  # verified, cancelled or resumed: nothing left to look for
        if self.observing:
            self.observe_again = True  # look again as soon as this observation returns
            return []
        self.observing = True
        self.observe_again = False
        self.next_observe_at = None
        return [Observe()]

    def _observed(self, ev: Observed) -> list[Command]:
        self.observing = False
        if self.phase != "draining":
            return []  # tainting: nothing was signalled yet; done: verified or cancelled
        # Deadlines first: an observation that comes back after O cannot make O pass unnoticed
        # (invariant 6: overrun is decided by what was verified by O, not by message order).
        commands = self._deadlines(ev.now)
        if ev.error:
            # Invariant 5: an observation that failed is not "empty".
            if ev.error != self.last_failure:
                commands.append(Emit("verification_failed", {"error": ev.error}))
            self.last_failure = ev.error
        elif ev.running or ev.gpu_processes:
            self.last_failure = ""
            commands += strays(self, ev.running, ev.rentals)
        else:
            self.verified_at = ev.now
            self.move("done", ev.now, "Observed(empty)")
            commands.append(Emit("verified_empty", {}))
            if not self.outcome:
                self.outcome = "drained"
                commands.append(Emit("drained", {"spare_s": round(self.terminate_at - ev.now, 3)}))
            return commands
        self.next_observe_at = ev.now + (0.0 if self.observe_again else self.observe_every_s)
        return commands + self._tick(ev.now)

    def _tick(self, now: float, listed: tuple[RoundTarget, ...] | None = None) -> list[Command]:
        commands = self._deadlines(now, listed)
        if self.next_observe_at is not None and now >= self.next_observe_at:
            commands += self._observe(now)
        return commands

    def _deadlines(
        self, now: float, listed: tuple[RoundTarget, ...] | None = None
    ) -> list[Command]:
        if self.phase == "tainting" and now >= self.taint_answer_by:
            return self._taint_unanswered(now, "no answer within the taint deadline", listed)
        commands: list[Command] = []
        if self.phase == "draining" and not self.sigkill_round and now >= self.grace_deadline:
            self.sigkill_round = True
            # Open streams end with an explicit `interrupted` error first (invariant 7).
            commands.append(CutWorkers(self.reclaim_id))
            commands.append(start_round(self, SIGKILL))
        if not self.outcome and self.verified_at is None and now >= self.overrun_at:
            # Invariant 6: work is still there at O (nothing verified it gone). Once.
            self.outcome = "overrun"  # the drain itself goes on: SIGKILL, verification
            commands.append(
                Emit(
                    "overrun",
                    {
                        "still_running": sorted(
                            self.names.get(c, c)
                            for c in [*self.signalled, *self.gated]
                            if c not in self.exited
                        ),
                        "last_failure": self.last_failure,
                    },
                )
            )
        return commands
