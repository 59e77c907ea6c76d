"""The agent's reclamation state machine: events and the time in, commands out.

Pure: no asyncio, docker, grpc, pynvml or files. The shell (agent/drain/runner.py) persists the
machine's state after every call and before it carries out the commands, so the bundle on disk
is always at least as new as anything the node did (docs/design.md invariants 2 and 8).

Order is fixed (invariant 1): no signal command is returned before a taint is in force.

SIGTERM at most once, across restarts too: a round first lists its targets (RoundListed), the
machine records them as announced and only then answers DeliverSignals, which the shell carries
out after saving the bundle (the first SIGTERM round, when the shell listed the node while the
Taint call was in flight, is announced in the taint's own step instead: TaintAnswered.listed).
A restarted agent finds the announced containers in the bundle and
counts them as signalled by the previous run: no second SIGTERM, ever (many runtimes take one as
"exit now, skip the cleanup"); SIGKILL at G still comes. Each container's place in this signal
ledger moves only along LEDGER_TRANSITIONS.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any

from spotdrain.agent.core.notice import Notice
from spotdrain.agent.core.reclamation_commands import (
    SIGKILL,
    SIGTERM,
    ApplyLocalTaint,
    Command,
    CutWorkers,
    DeliverSignals,
    DrainWorkers,
    Emit,
    LiftTaints,
    Observe,
    RequestTaint,
    RetryRemoteTaint,
    SignalContainers,
    WatchExits,
    WriteDeadlineFile,
)
from spotdrain.agent.core.reclamation_events import (
    Cancelled,
    ContainerExited,
    ContainerSignalled,
    Event,
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
from spotdrain.protocol import timing
from spotdrain.protocol.machine import (
    InvalidTransition,
    StateMachine,
    StoryEntry,
    Table,
    remember,
)

# Reports held for a container the reclamation has not signalled yet (a job that saw the
# deadline file before its SIGTERM): at most this many each, so a chatty one cannot grow the
# bundle without bound.
PENDING_REPORTS_KEPT = 16
# How a restarted agent reports the SIGTERMs its predecessor announced (sigterm_sent "by").
BY_PREVIOUS_RUN = "previous run"

# A container's place in the signal ledger (Reclamation.ledger): no signal yet (None), announced
# for a round (on disk before anything is sent, so possibly delivered by a process that has died
# since), delivered, or delivered as far as anyone can tell by the previous agent process.
TERM_ANNOUNCED = "SIGTERM announced"
TERM_SENT = "SIGTERM"
TERM_BY_PREVIOUS_RUN = "SIGTERM by previous run"
KILL_ANNOUNCED = "SIGKILL announced"
KILL_SENT = "SIGKILL"
LEDGER_TRANSITIONS: Table[str | None, str] = Table(
    "reclamation",
    {
        (None, TERM_ANNOUNCED): "a SIGTERM round is about to signal it",
        (TERM_ANNOUNCED, TERM_SENT): "delivered",
        (TERM_ANNOUNCED, None): "neither route delivered it, or its round ended without sending "
        "it (a cancel between the announcing step and the round): it may be signalled again",
        (TERM_ANNOUNCED, TERM_BY_PREVIOUS_RUN): "the agent restarted before the result came back",
        (None, KILL_ANNOUNCED): "the SIGKILL round (or a later stray) is about to kill it",
        (TERM_SENT, KILL_ANNOUNCED): "the SIGKILL round is about to kill it",
        (TERM_BY_PREVIOUS_RUN, KILL_ANNOUNCED): "the SIGKILL round is about to kill it",
        (KILL_ANNOUNCED, KILL_SENT): "delivered",
        # Not delivered, or the agent restarted: a SIGKILL may safely be sent again.
        (KILL_ANNOUNCED, None): "withdrawn",
        (KILL_ANNOUNCED, TERM_SENT): "withdrawn",
        (KILL_ANNOUNCED, TERM_BY_PREVIOUS_RUN): "withdrawn",
    },
)
# The reclamation's own phase: tainting until a taint is in force, then draining; done once
# verified empty, cancelled or resumed.
PHASE_TRANSITIONS: Table[str, str] = Table(
    "reclamation",
    {
        ("tainting", "draining"): "a taint (remote, or local after no answer) is in force",
        ("tainting", "done"): "cancelled or resumed before any taint was in force",
        ("draining", "done"): "verified empty, or cancelled or resumed",
    },
)
# The provider's notice heard again with a later D (kept, never moved) is recorded at most this
# often, with how many such were heard between: a source that re-stamps its document on every
# read (AWS's own mock) cannot fill the timeline.
LATER_NOTICE_RECORDED_EVERY_S = 10.0
OUTCOMES = ("", "drained", "overrun", "cancelled", "resumed")


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
class Reclamation(StateMachine[str, str]):
    """One reclamation: its absolute deadlines (computed once; only the provider naming an
    earlier D moves them, and only earlier: NoticeHeard) and its progress.

    Its state is `phase` (PHASE_TRANSITIONS). Its story (phase moves and signal-ledger moves) is
    kept in memory only, outside the dataclass fields, so the bundle's stored form is unchanged.
    """

    table = PHASE_TRANSITIONS
    story_limit = 64

    reclaim_id: str
    node_id: str
    notice_key: str
    notice_id: str
    source: str
    reason: str  # "notice" or "pause"
    t0: float
    terminate_at: float  # D
    grace_deadline: float  # G
    overrun_at: float  # O
    observe_every_s: float
    taint_answer_by: float
    taint_answer_s: float = 0.8
    # progress
    phase: str = "tainting"  # tainting -> draining -> done (verified empty, or cancelled)
    taint_mode: str = ""  # "", "local", "remote"
    remote_taint: bool = False
    sigterm_round: bool = False  # the SIGTERM round has been issued (never issued twice)
    sigterm_round_done: bool = False
    sigkill_round: bool = False
    rounds_in_flight: int = 0  # signal rounds asked for and not yet reported done
    signalled: dict[str, str] = field(default_factory=dict)  # container id -> last signal
    names: dict[str, str] = field(default_factory=dict)
    gated: list[str] = field(default_factory=list)  # inference workers draining at their gates
    exited: dict[str, int] = field(default_factory=dict)
    observing: bool = False
    observe_again: bool = False
    next_observe_at: float | None = None
    last_failure: str = ""
    verified_at: float | None = None
    outcome: str = ""  # "", "drained", "overrun", "cancelled", "resumed"
    resumed: bool = False  # a pause the owner has ended
    lift_acknowledged: bool = False  # the coordinator lifted the taints of a cancel or resume
    sigterm_at: dict[str, float] = field(default_factory=dict)  # container id -> its SIGTERM
    # What the provider said last (NoticeHeard), and when a later D was last recorded.
    heard_action: str = ""
    heard_terminate_at: float | None = None
    later_recorded_at: float | None = None
    later_unrecorded: int = 0  # later Ds heard since then, not recorded one by one
    # Workload reports by container name, held until the container is signalled or exits.
    pending_reports: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # Containers a round is about to signal: id -> {signal, name, kind, image, at}. In the bundle
    # before any of them is sent (write before act), so a restart knows who may have had it.
    announced: dict[str, dict[str, Any]] = field(default_factory=dict)
    # SIGTERMs the previous agent process announced and may have sent (never sent again).
    sigterm_by_previous_run: list[str] = field(default_factory=list)
    # The notice's cancel has been recorded: the same cancel read again (an agent restarted
    # while the cancel is still the notice file's content) records nothing more.
    cancel_recorded: bool = False
    # The cancel lifted the taints (nothing was stopped); the outcome it had, if any, stands.
    lifted_by_cancel: bool = False
    # A signal was announced under this notice, so it may have reached a container even if it
    # was withdrawn since (a SIGKILL announced before a restart): a cancel then lifts nothing.
    signal_announced: bool = False

    def __post_init__(self) -> None:
        self.story: list[StoryEntry[str]] = []

    @property
    def state(self) -> str:
        return self.phase

    @state.setter
    def state(self, phase: str) -> None:
        self.phase = phase

    @property
    def ident(self) -> str:
        return self.reclaim_id

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
        reported = self._announced_by_previous_run(delivered, now)
        if self.lifted:
            # A cancel or resume that the coordinator may not have heard of yet: say it again.
            lift = [] if self.lift_acknowledged else [LiftTaints(self.reclaim_id)]
            return _stamp([*reported, *lift], now)
        if self.phase == "done":
            if self.taint_mode == "local" and not self.remote_taint:
                return _stamp([*reported, RetryRemoteTaint(self.reclaim_id)], now)
            return _stamp(reported, now)
        commands: list[Command] = list(reported)
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
        commands.append(self._deadline_file())
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
            commands.append(self._signal(SIGTERM))
        else:
            live = tuple(c for c in self.signalled if c not in self.exited)
            if live:
                commands.append(WatchExits(live))
        return _stamp(commands + self._observe(now) + self._tick(now), now)

    def _announced_by_previous_run(self, delivered: set[str] | None, now: float) -> list[Command]:
        """The announcements the old process left: each SIGTERM may have been delivered, so it
        counts as sent (reported with `by: previous run`) and is never sent again, unless the
        engine says it was never asked to (`delivered` without it): then it is withdrawn and
        the container, still running and never signalled, gets its SIGTERM at the next look.
        A SIGKILL is withdrawn (the next look kills it again if it still runs, which is
        harmless) and reported the same way, since it may have been delivered: a container
        that exits 137 has its sigkill_sent."""
        commands: list[Command] = []
        for container, entry in list(self.announced.items()):
            if entry["signal"] == SIGTERM and delivered is not None and container not in delivered:
                self._ledger_move(container, entry["before"], now=now)
                continue
            if entry["signal"] == SIGTERM:
                self._ledger_move(container, TERM_BY_PREVIOUS_RUN, now=now)
                self.sigterm_at.setdefault(container, entry["at"])
                details: dict[str, Any] = {
                    "container": container,
                    "name": entry["name"],
                    "by": BY_PREVIOUS_RUN,
                    "announced_at": entry["at"],
                }
                for key in ("image", "kind"):
                    if entry.get(key):
                        details[key] = entry[key]
                commands.append(Emit("sigterm_sent", details))
                commands += self._held_reports(container, None)
            else:
                self._ledger_move(container, entry["before"], now=now)
                commands.append(
                    Emit(
                        "sigkill_sent",
                        {
                            "container": container,
                            "name": entry["name"],
                            "by": BY_PREVIOUS_RUN,
                            "announced_at": entry["at"],
                        },
                    )
                )
        return commands

    # --- the signal ledger ---------------------------------------------------------------------

    def ledger(self, container: str) -> str | None:
        """Where a container stands in the signal ledger (see LEDGER_TRANSITIONS)."""
        entry = self.announced.get(container)
        if entry is not None:
            return TERM_ANNOUNCED if entry["signal"] == SIGTERM else KILL_ANNOUNCED
        signal = self.signalled.get(container)
        if signal == SIGKILL:
            return KILL_SENT
        if signal == SIGTERM:
            if container in self.sigterm_by_previous_run:
                return TERM_BY_PREVIOUS_RUN
            return TERM_SENT
        return None

    def _ledger_move(
        self,
        container: str,
        finish: str | None,
        target: RoundTarget | None = None,
        now: float = 0.0,
    ) -> None:
        """A container's move in the signal ledger, checked against LEDGER_TRANSITIONS and told
        in the reclamation's story."""
        start = self.ledger(container)
        ident = f"{self.reclaim_id}: container {container}"
        LEDGER_TRANSITIONS.check(ident, start, finish, self.story)
        entry = (now, f"ledger {container}", str(start), str(finish))
        remember(self.story, entry, self.story_limit)
        if finish in (TERM_ANNOUNCED, KILL_ANNOUNCED):
            assert target is not None
            self.signal_announced = True
            self.announced[container] = {
                "signal": SIGTERM if finish == TERM_ANNOUNCED else SIGKILL,
                "name": target.name,
                "kind": target.kind,
                "image": target.image,
                "at": now,
                "before": start,
            }
            return
        self.announced.pop(container, None)
        if finish == TERM_SENT:
            self.signalled[container] = SIGTERM
        elif finish == KILL_SENT:
            self.signalled[container] = SIGKILL
        elif finish == TERM_BY_PREVIOUS_RUN:
            self.signalled[container] = SIGTERM
            if container not in self.sigterm_by_previous_run:
                self.sigterm_by_previous_run.append(container)
        # None, or back to what it was before a withdrawn SIGKILL: nothing more to change.

    def broken_invariants(self) -> list[str]:
        """The reclamation's own invariants (dask's validate_state); tests call validate() after
        every step, which raises InvalidState naming each one broken."""
        broken = super().broken_invariants()
        if not self.t0 <= self.taint_answer_by or not (
            self.grace_deadline <= self.overrun_at <= self.terminate_at
        ):
            broken.append("deadlines out of order")
        if self.outcome not in OUTCOMES:
            broken.append(f"unknown outcome {self.outcome!r}")
        if self.phase == "tainting" and (self.signalled or self.announced or self.sigterm_round):
            broken.append("signalled before a taint was in force (invariant 1)")
        if self.sigkill_round and not self.sigterm_round:
            broken.append("a SIGKILL round without the SIGTERM round")
        if self.rounds_in_flight < 0:
            broken.append("negative rounds in flight")
        if self.announced and not self.rounds_in_flight:
            broken.append(f"announced without a round in flight: {sorted(self.announced)}")
        for container, entry in self.announced.items():
            if entry.get("signal") not in (SIGTERM, SIGKILL):
                broken.append(f"{container} announced for {entry.get('signal')!r}")
            elif entry["signal"] == SIGTERM and container in self.signalled:
                broken.append(f"{container} announced for a second SIGTERM")
        for container in self.sigterm_by_previous_run:
            if container not in self.signalled:
                broken.append(f"{container} signalled by the previous run but not recorded")
        if self.outcome == "drained" and (
            self.verified_at is None or self.verified_at >= self.overrun_at
        ):
            broken.append("drained without an empty look before O (invariants 5, 6)")
        if self.verified_at is not None and self.phase != "done":
            broken.append("verified empty but not done")
        return broken

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
                return self._signalled(event)
            case RoundListed():
                return self._listed(event)
            case SignalRoundDone(now, signal):
                return self._round_done(now, signal)
            case ContainerExited(now, container, name, code):
                return self._exited(now, container, name, code)
            case Observed():
                return self._observed(event)
            case WorkersDraining(now, containers, names):
                return self._workers_draining(containers, names)
            case Resumed(now):
                return self._resumed(now)
            case TaintsLifted():
                self.lift_acknowledged = True
                return []
            case Tick(now, listed):
                return self._tick(now, listed)
            case Cancelled(now):
                return self._cancelled(now)
            case WorkloadReported():
                return self._reported(event)
            case NoticeHeard():
                return self._heard(event)
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

    @property
    def lifted(self) -> bool:
        """Cancelled or resumed: nothing more may be signalled, and the taints must go."""
        return self.resumed or self.lifted_by_cancel or self.outcome in ("cancelled", "resumed")

    @property
    def finished(self) -> bool:
        """Nothing more to do. A local taint keeps it open until the coordinator has the taint;
        a lift (cancel, resume) keeps it open until the coordinator has lifted it."""
        if self.lifted:
            return self.lift_acknowledged
        if self.taint_mode == "local" and not self.remote_taint:
            return False
        return self.phase == "done"

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
        commands: list[Command] = [
            self._deadline_file(),
            Emit(
                "deadline_file_written",
                {"terminate_at": self.terminate_at, "grace_deadline": self.grace_deadline},
            ),
            # Unrouted, then signalled (docs/design.md "Hard notice timeline", step 4).
            DrainWorkers(self.reclaim_id, self.grace_deadline),
            self._signal(SIGTERM, listed=listed, now=now),
        ]
        return commands + self._tick(now)

    def _deadline_file(self) -> WriteDeadlineFile:
        return WriteDeadlineFile(
            self.reclaim_id, self.terminate_at, self.grace_deadline, self.reason
        )

    def _listed(self, ev: RoundListed) -> list[Command]:
        if self.lifted:
            return [DeliverSignals(ev.signal, ())]  # cancelled or resumed: nothing more to send
        return [DeliverSignals(ev.signal, self._announce(ev))]

    def _announce(self, ev: RoundListed) -> tuple[str, ...]:
        """A round's targets: announce those it may signal, and only those. A SIGTERM goes to a
        container at most once, whoever sent it (this process or the one before it)."""
        approved: list[str] = []
        for target in ev.targets:
            c = target.container
            if c in self.exited or c in approved:
                continue
            start = self.ledger(c)
            if ev.signal == SIGTERM:
                if start is not None or c in self.gated:
                    continue
                self._ledger_move(c, TERM_ANNOUNCED, target, ev.now)
            else:
                if start in (TERM_ANNOUNCED, KILL_ANNOUNCED, KILL_SENT):
                    continue
                self._ledger_move(c, KILL_ANNOUNCED, target, ev.now)
            self.names[c] = target.name
            approved.append(c)
        return tuple(approved)

    def _signalled(self, ev: ContainerSignalled) -> list[Command]:
        kind = "sigterm_sent" if ev.signal == SIGTERM else "sigkill_sent"
        details: dict[str, Any] = {"container": ev.container, "name": ev.name, "via": ev.via}
        announced = TERM_ANNOUNCED if ev.signal == SIGTERM else KILL_ANNOUNCED
        if self.ledger(ev.container) != announced:
            # Only an announced container may be signalled (write before act).
            raise InvalidTransition(
                "reclamation",
                f"{self.reclaim_id}: container {ev.container}",
                self.ledger(ev.container),
                ev.signal,
                self.story,
                why="only an announced container may be signalled",
            )
        if ev.error:
            details["error"] = ev.error
            self._ledger_move(ev.container, self.announced[ev.container]["before"], now=ev.now)
            return [Emit("signal_failed", {**details, "signal": ev.signal})]
        for key in ("image", "kind"):
            if getattr(ev, key):
                details[key] = getattr(ev, key)
        self.names[ev.container] = ev.name
        new = ev.container not in self.signalled
        self._ledger_move(
            ev.container, TERM_SENT if ev.signal == SIGTERM else KILL_SENT, now=ev.now
        )
        if ev.signal == SIGTERM:
            self.sigterm_at.setdefault(ev.container, ev.now)
        commands: list[Command] = [Emit(kind, details)]
        commands += self._held_reports(ev.container, ev.now)
        if new and ev.container not in self.exited:
            commands.append(WatchExits((ev.container,)))
        return commands

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
            commands += self._held_reports(container, None)
            if container not in self.exited:
                new.append(container)
        if new:
            commands.append(WatchExits(tuple(new)))
        return commands

    def _resumed(self, now: float) -> list[Command]:
        if self.reason != "pause" or self.lifted:
            return []
        if self.phase == "done":
            self.resumed = True
            return [Emit("pause_resumed", {"during_drain": False}), LiftTaints(self.reclaim_id)]
        # The owner has the machine back: stop verifying and signalling. Workers already
        # draining finish on their own gates' deadlines.
        self.outcome = self.outcome or "resumed"
        self.resumed = True
        self.move("done", now, "Resumed")
        return [Emit("pause_resumed", {"during_drain": True}), LiftTaints(self.reclaim_id)]

    def _signal(
        self,
        signal: str,
        skip: frozenset[str] = frozenset(),
        listed: tuple[RoundTarget, ...] | None = None,
        now: float = 0.0,
    ) -> SignalContainers:
        self.rounds_in_flight += 1
        if listed is None:
            return SignalContainers(signal, skip)
        # Announced here: in the bundle this step saves, before the round sends anything.
        skip_kinds = SignalContainers(signal).skip_kinds
        wanted = tuple(t for t in listed if t.container not in skip and t.kind not in skip_kinds)
        announced = self._announce(RoundListed(now, signal, wanted))
        return SignalContainers(signal, skip, announced)

    def _round_done(self, now: float, signal: str) -> list[Command]:
        self.rounds_in_flight = max(0, self.rounds_in_flight - 1)
        # The round's results all came before this: what it announced and never sent (a cancel
        # or resume reached the shell between the announcing step and the round) was not
        # signalled, and a later notice for the same machine may signal it.
        pending = TERM_ANNOUNCED if signal == SIGTERM else KILL_ANNOUNCED
        for container in [c for c in self.announced if self.ledger(c) == pending]:
            self._ledger_move(container, self.announced[container]["before"], now=now)
        first = signal == SIGTERM and not self.sigterm_round_done
        if signal == SIGTERM:
            self.sigterm_round_done = True
        if first or signal == SIGKILL:
            return self._observe(now)
        # A stray round: look again at the usual pace, not at once (a stray the round could
        # not signal, such as an ungated inference worker, would make it spin).
        if not self.observing and self.next_observe_at is None:
            self.next_observe_at = now + self.observe_every_s
        return []

    def _exited(self, now: float, container: str, name: str, code: int) -> list[Command]:
        if container in self.exited:
            return []
        self.names.setdefault(container, name)
        # Reports it made before it exited come first (the shell read them before this event).
        commands: list[Command] = self._held_reports(container, None)
        self.exited[container] = code
        commands.append(
            Emit("container_exited", {"container": container, "name": name, "exit_code": code})
        )
        if all(c in self.exited for c in [*self.signalled, *self.gated]):
            # The last exit: verify now rather than at the next periodic observation.
            commands += self._observe(now)
        return commands

    def _reported(self, ev: WorkloadReported) -> list[Command]:
        """A checkpoint report. Recorded between the container's SIGTERM and its exit: one that
        arrives before the signal is held until then, one after the exit is dropped. Nothing
        here touches a deadline, a signal or verification."""
        container = next((c for c, n in self.names.items() if n == ev.name), None)
        if container is not None and container in self.exited:
            return []
        doc: dict[str, Any] = {
            "report": ev.report,
            "generation": ev.generation,
            "seen_at": ev.now,
            "reported_at": ev.reported_at,
        }
        if ev.nbytes is not None:
            doc["bytes"] = ev.nbytes
        if container is None or (container not in self.signalled and container not in self.gated):
            held = self.pending_reports.setdefault(ev.name, [])
            if len(held) < PENDING_REPORTS_KEPT:
                held.append(doc)
            return []
        return [self._report_emit(container, doc, ev.now)]

    def _held_reports(self, container: str, now: float | None) -> list[Command]:
        name = self.names.get(container, "")
        return [
            self._report_emit(container, doc, now if now is not None else doc["seen_at"])
            for doc in self.pending_reports.pop(name, [])
        ]

    def _report_emit(self, container: str, doc: dict[str, Any], at: float) -> Emit:
        """The event for one report, stamped at `at`: when it was read, or, for one held
        until its container's SIGTERM, that SIGTERM (so the timeline keeps its order)."""
        at = max(at, doc["seen_at"])
        details: dict[str, Any] = {
            "container": container,
            "name": self.names.get(container, ""),
            "generation": doc["generation"],
        }
        if "bytes" in doc:
            details["bytes"] = doc["bytes"]
        sigterm = self.sigterm_at.get(container)
        details["since_sigterm_s"] = None if sigterm is None else round(max(at - sigterm, 0.0), 3)
        if doc["seen_at"] < (sigterm or doc["seen_at"]):
            details["before_sigterm"] = True
        details["reported_at"] = doc["reported_at"]
        return Emit(doc["report"], details, at=at)

    def _heard(self, ev: NoticeHeard) -> list[Command]:
        said = ev.terminate_at if ev.terminate_at is not None else self.heard_terminate_at
        if (ev.action, said) == (self.heard_action, self.heard_terminate_at):
            return []  # the same document read again (another poll, an agent restart)
        acted = ev.action != self.heard_action
        self.heard_action, self.heard_terminate_at = ev.action, said
        earlier = said is not None and said < self.terminate_at
        movable = earlier and self.phase != "done" and not self.lifted
        if not (acted or movable):
            # A later D (kept), or an earlier one after the drain ended: at most one record
            # every LATER_NOTICE_RECORDED_EVERY_S.
            since = self.later_recorded_at
            if since is not None and ev.now - since < LATER_NOTICE_RECORDED_EVERY_S:
                self.later_unrecorded += 1
                return []
            self.later_recorded_at = ev.now
        commands: list[Command] = []
        if movable:
            assert said is not None
            shift = self.terminate_at - said
            self.terminate_at -= shift
            self.grace_deadline -= shift
            self.overrun_at -= shift
        details = {
            "action": ev.action,
            "heard_terminate_at": said,
            "terminate_at": self.terminate_at,
            "grace_deadline": self.grace_deadline,
            "overrun_at": self.overrun_at,
            "moved": movable,
            "unrecorded": self.later_unrecorded,
        }
        self.later_unrecorded = 0
        commands.append(Emit("notice_updated", details))
        if movable and self.phase == "draining":
            # The workloads' file and the gates learn the earlier deadlines at once.
            commands += [
                self._deadline_file(),
                Emit(
                    "deadline_file_written",
                    {"terminate_at": self.terminate_at, "grace_deadline": self.grace_deadline},
                ),
                DrainWorkers(self.reclaim_id, self.grace_deadline),
            ]
        if movable:
            commands += self._deadlines(ev.now)  # an earlier G or O may have passed already
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
            commands += self._strays(ev.running, ev.rentals)
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

    def _strays(self, running: tuple[str, ...], rentals: tuple[str, ...] = ()) -> list[Command]:
        """Running containers that lack the signal they are due: never signalled (started by
        hand, missed by a round that died with the agent), or not yet killed after G. Before G
        a rental is due nothing."""
        if self.rounds_in_flight or not self.sigterm_round_done:
            return []  # a round still under way may reach them: no second SIGTERM
        if self.sigkill_round:
            signal = SIGKILL
            done = frozenset(c for c, sig in self.signalled.items() if sig == SIGKILL)
        else:
            signal = SIGTERM
            done = frozenset(self.signalled) | frozenset(self.gated) | frozenset(rentals)
        done |= frozenset(self.announced)
        if not frozenset(running) - done:
            return []
        return [self._signal(signal, skip=done)]

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
            commands.append(self._signal(SIGKILL))
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

    def _cancelled(self, now: float) -> list[Command]:
        if self.cancel_recorded:
            return []
        self.cancel_recorded = True
        details: dict[str, Any] = {"lifted": False}
        if self.outcome:
            details["outcome"] = self.outcome
        if self.lifted or not self._stopped_nothing():
            # Lifted already (a resumed pause), or something was stopped: it stays stopped and
            # the drain goes on (or has ended) under the same deadlines; the taints stay.
            return [Emit("notice_cancelled", details)]
        # Nothing was stopped under this notice, the node verified empty or not: the provider
        # keeps the machine, so it is ours to use again (design: a cancel lifts what nothing
        # was stopped under). An outcome already recorded (drained) stands, as in the record.
        details["lifted"] = True
        self.lifted_by_cancel = True
        self.outcome = self.outcome or "cancelled"
        if self.phase != "done":  # verified empty already: done stays done
            self.move("done", now, "Cancelled")
        return [Emit("notice_cancelled", details), LiftTaints(self.reclaim_id)]

    def _stopped_nothing(self) -> bool:
        """No container was signalled (by this process or the one before) nor drained at its
        gate under this notice, and no signal was ever announced (one announced may have been
        delivered, even if withdrawn after a restart): still tainting, or the SIGTERM round is
        over and found nothing."""
        if self.phase == "tainting":
            return True
        return (
            self.sigterm_round_done
            and not self.signal_announced
            and not self.signalled
            and not self.gated
            and not self.announced
        )

    # --- persistence -----------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Reclamation:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(doc) - names
        if unknown:
            raise ValueError(f"reclamation bundle has unknown fields {sorted(unknown)}")
        return cls(**doc)
