"""The agent's reclamation state machine, told as stories on a fake clock.

Short margins keep the numbers readable: the notice arrives at T0 = 1000 with D = T0 + 30, so the
grace deadline G = D - 10 and the overrun check O = D - 2; the coordinator has 0.8 s to answer
the taint (docs/design.md "Hard notice timeline"). Nothing here sleeps or does I/O: time is the
`now` of each event.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from spotdrain.agent.core.notice import Notice
from spotdrain.agent.core.reclamation import Margins, Reclamation, reclaim_id_for
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
)
from spotdrain.agent.core.signal_ledger import (
    BY_PREVIOUS_RUN,
    KILL_ANNOUNCED,
    KILL_SENT,
    LEDGER_TRANSITIONS,
    TERM_ANNOUNCED,
    TERM_BY_PREVIOUS_RUN,
    TERM_SENT,
    ledger,
    ledger_move,
)
from spotdrain.protocol.machine import InvalidState, InvalidTransition

T0 = 1000.0
D = T0 + 30
G = D - 10
O = D - 2  # noqa: E741 - the name docs/design.md gives the overrun check
MARGINS = Margins(
    default_notice_s=30, grace_s=10, overrun_s=2, taint_answer_s=0.8, observe_every_s=0.5
)
NODE = "gpu-node-7"


def notice(terminate_at: float | None = D, notice_id: str = "i-0abc") -> Notice:
    return Notice(
        key="id:" + notice_id,
        notice_id=notice_id,
        action="terminate",
        terminate_at=terminate_at,
        source="aws-imds",
    )


# --- matching whole command lists ------------------------------------------------------------


class match:  # noqa: N801 - reads as a value in the expected lists
    """Equal to a command of type `cls` whose given fields are equal (the others may vary)."""

    def __init__(self, cls: type, **partial: Any) -> None:
        self.cls, self.partial = cls, partial

    def __eq__(self, other: object) -> bool:
        return type(other) is self.cls and all(
            getattr(other, k) == v for k, v in self.partial.items()
        )

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.partial.items())
        return f"match({self.cls.__name__}, {fields})"


class emit(match):  # noqa: N801
    """Equal to Emit(kind, details) whose details include the given ones."""

    def __init__(self, kind: str, **details: Any) -> None:
        super().__init__(Emit, kind=kind)
        self.details = details

    def __eq__(self, other: object) -> bool:
        return (
            super().__eq__(other)
            and isinstance(other, Emit)
            and all(k in other.details and other.details[k] == v for k, v in self.details.items())
        )

    def __repr__(self) -> str:
        fields = "".join(f", {k}={v!r}" for k, v in self.details.items())
        return f"emit({self.partial['kind']!r}{fields})"


def kinds(commands: list[Command]) -> list[str]:
    """A log as words: Emit kinds, and `SignalContainers(SIGTERM)` for the signal rounds."""
    out = []
    for c in commands:
        if isinstance(c, Emit):
            out.append(c.kind)
        elif isinstance(c, SignalContainers):
            out.append(f"SignalContainers({c.signal})")
        else:
            out.append(type(c).__name__)
    return out


EVICT = [
    match(WriteDeadlineFile, terminate_at=D, grace_deadline=G, reason="notice"),
    emit("deadline_file_written", terminate_at=D, grace_deadline=G),
    match(DrainWorkers, grace_deadline=G),
    SignalContainers(SIGTERM),
]
LOCAL_FALLBACK = [
    match(ApplyLocalTaint),
    emit("tainted", mode="local"),
    match(RetryRemoteTaint),
]


# --- the story recorder, with invariants checked at teardown -------------------------------


def check_story(log: list[tuple[float, Command]], rec: Reclamation, deadlines: tuple) -> None:
    """The invariants every story keeps, whatever happened (docs/design.md "Invariants")."""
    commands = [c for _, c in log]
    names = kinds(commands)
    # Invariant 1: no signal before a taint is in force (and a local taint before its event).
    if any(isinstance(c, SignalContainers) for c in commands):
        first_signal = next(i for i, c in enumerate(commands) if isinstance(c, SignalContainers))
        assert "tainted" in names[:first_signal], names
    for i, c in enumerate(commands):
        if c == emit("tainted", mode="local"):
            assert any(isinstance(p, ApplyLocalTaint) for p in commands[:i]), names
    # Invariant 5 and 6: one outcome, once.
    assert names.count("drained") <= 1 and names.count("overrun") <= 1, names
    assert not ("drained" in names and "overrun" in names), names
    assert names.count("verified_empty") <= 1, names
    # Nothing is verified or drained before the node is tainted.
    for kind in ("verified_empty", "drained"):
        if kind in names:
            assert "tainted" in names[: names.index(kind)], names
    # Invariant 6: drained only before O.
    for now, c in log:
        if c == emit("drained"):
            assert now < rec.overrun_at, (now, rec.overrun_at)
    # Every event carries the time of the fact that caused it (docs/design.md "Lifecycle events").
    for now, c in log:
        if isinstance(c, Emit):
            assert getattr(c, "at", now) == now, (now, c)
    # Invariant 2: the deadlines never move, but earlier when the provider names an earlier D.
    moved = [c for _, c in log if c == emit("notice_updated", moved=True)]
    if moved:
        last = moved[-1].details  # type: ignore[union-attr]
        expected = (deadlines[0], last["terminate_at"], last["grace_deadline"], last["overrun_at"])
        assert all(now <= first for now, first in zip(expected[1:], deadlines[1:], strict=True))
        deadlines = expected
    assert (rec.reclaim_id, rec.terminate_at, rec.grace_deadline, rec.overrun_at) == deadlines
    # Once cancelled with the taints lifted, no container is ever signalled.
    if "LiftTaints" in names:
        after = names[names.index("LiftTaints") :]
        assert not any(n.startswith("SignalContainers") for n in after), names
    # A cancel lifts only what nothing was stopped under: no signal, no worker at its gate.
    if "LiftTaints" in names and "pause_resumed" not in names:
        before = set(names[: names.index("LiftTaints")])
        assert not before & {"sigterm_sent", "sigkill_sent", "worker_draining"}, names


@dataclass
class Story:
    """One reclamation driven through the machine; every command is logged with its time."""

    margins: Margins = MARGINS
    rec: Reclamation = field(init=False)
    log: list[tuple[float, Command]] = field(default_factory=list)
    deadlines: tuple = ()
    # Strict: a delivery must follow the machine's own DeliverSignals (the world below); else a
    # ContainerSignalled stands for a whole round that listed that one container first.
    strict: bool = False

    def begin(
        self, n: Notice | None = None, now: float = T0, reason: str = "notice"
    ) -> list[Command]:
        self.rec, commands = Reclamation.begin(n or notice(), NODE, now, self.margins, reason)
        self.deadlines = self._deadlines()
        return self._log(now, commands)

    def __call__(self, event: Event) -> list[Command]:
        announced = self.rec.announced.get(getattr(event, "container", ""), {})
        if (
            isinstance(event, ContainerSignalled)
            and not self.strict
            and announced.get("signal") != event.signal
        ):
            # A delivery stands for a round that listed the container first (write before act);
            # the stories about the announcement itself feed RoundListed themselves.
            target = RoundTarget(event.container, event.name, event.kind, event.image)
            listed = self.rec.handle(RoundListed(event.now, event.signal, (target,)))
            assert listed == [DeliverSignals(event.signal, (event.container,))], listed
        return self._log(event.now, self.rec.handle(event))

    def restart(self, now: float, delivered: set[str] | None = None) -> list[Command]:
        """The agent process dies and comes back: only the persisted bundle survives (and the
        engine's word on which announced SIGTERMs it was asked to send, when it answers)."""
        bundle = json.loads(json.dumps(self.rec.to_json()))
        self.rec = Reclamation.from_json(bundle)
        return self._log(now, self.rec.resume(now, delivered))

    def check(self) -> None:
        check_story(self.log, self.rec, self.deadlines)

    @property
    def kinds(self) -> list[str]:
        return kinds([c for _, c in self.log])

    def _deadlines(self) -> tuple:
        r = self.rec
        return (r.reclaim_id, r.terminate_at, r.grace_deadline, r.overrun_at)

    def _log(self, now: float, commands: list[Command]) -> list[Command]:
        self.log += [(now, c) for c in commands]
        self.rec.validate()  # like dask's validate_state(), after every step
        return commands


@pytest.fixture
def story() -> Story:
    s = Story()
    yield s
    s.check()  # like dask's validate_state(): every story keeps the invariants


def signalled(c: str, now: float, signal: str = SIGTERM) -> ContainerSignalled:
    return ContainerSignalled(now, container=c, name=f"job-{c}", signal=signal, via="api")


def exited(c: str, now: float, code: int = 0) -> ContainerExited:
    return ContainerExited(now, container=c, name=f"job-{c}", exit_code=code)


def tainted_with(story: Story, *containers: str, now: float = T0 + 0.05) -> None:
    """The opening everyone shares: notice, remote taint, SIGTERM round over `containers`."""
    story.begin()
    story(TaintAnswered(now))
    for c in containers:
        story(signalled(c, now + 0.01))
    assert story(SignalRoundDone(now + 0.02, SIGTERM)) == [Observe()]


# --- the healthy path ------------------------------------------------------------------------


def test_healthy_coordinator_two_jobs_checkpoint_and_the_node_drains_with_time_to_spare(
    story: Story,
) -> None:
    """AWS gives 30 s. The coordinator taints at once, two training jobs checkpoint on SIGTERM,
    the GPUs empty, and the node reports drained with 29.35 s to spare."""
    assert story.begin() == [
        emit(
            "notice_received",
            notice_id="i-0abc",
            action="terminate",
            source="aws-imds",
            reason="notice",
            t0=T0,
            terminate_at=D,
            grace_deadline=G,
            overrun_at=O,
            late=False,
        ),
        RequestTaint(story.rec.reclaim_id, answer_by=T0 + 0.8),
    ]
    assert story.rec.next_wakeup() == T0 + 0.8

    # Invariant 1: the taint is in force strictly before the deadline file and the SIGTERM.
    assert story(TaintAnswered(T0 + 0.05)) == [emit("tainted", mode="remote"), *EVICT]
    assert story(signalled("c1", T0 + 0.06)) == [
        emit("sigterm_sent", container="c1", name="job-c1", via="api"),
        WatchExits(("c1",)),
    ]
    assert story(signalled("c2", T0 + 0.07)) == [emit("sigterm_sent"), WatchExits(("c2",))]
    assert story(SignalRoundDone(T0 + 0.08, SIGTERM)) == [Observe()]
    # Both still checkpointing, one CUDA process each: nothing to report yet.
    assert story(Observed(T0 + 0.1, running=("c1", "c2"), gpu_processes=(4101, 4102))) == []
    assert story.rec.next_wakeup() == pytest.approx(T0 + 0.6)

    assert story(exited("c1", T0 + 0.3)) == [emit("container_exited", container="c1", exit_code=0)]
    # The last exit: verify at once rather than at the next periodic look.
    assert story(exited("c2", T0 + 0.5)) == [
        emit("container_exited", container="c2", exit_code=0),
        Observe(),
    ]
    assert story(Observed(T0 + 0.65)) == [
        emit("verified_empty"),
        emit("drained", spare_s=pytest.approx(29.35)),
    ]
    assert story.rec.finished and story.rec.next_wakeup() is None
    # A late, duplicate exit report changes nothing.
    assert story(exited("c2", T0 + 0.7)) == []


@pytest.mark.parametrize(
    "silence",
    [
        pytest.param(Tick(T0 + 0.8), id="the-800ms-timer-fires"),
        pytest.param(TaintUnanswered(T0 + 0.8, error="DEADLINE_EXCEEDED"), id="the-call-fails"),
    ],
)
def test_silent_coordinator_the_agent_taints_locally_and_signals_anyway(
    story: Story, silence: Event
) -> None:
    """The coordinator is down. After 800 ms the agent applies its own taint, keeps retrying the
    remote one in the background, and signals the jobs; when the coordinator finally answers it
    is told, but nobody gets a second SIGTERM."""
    story.begin()
    assert story(silence) == [*LOCAL_FALLBACK, *EVICT]
    assert story(signalled("c1", T0 + 0.81)) == [emit("sigterm_sent"), WatchExits(("c1",))]
    # The background retry lands 5 s later.
    assert story(TaintAnswered(T0 + 5)) == [emit("tainted", mode="remote", after_local=True)]
    # The original call's failure, or a duplicate answer, arriving late is not news.
    assert story(TaintUnanswered(T0 + 5.1, error="UNAVAILABLE")) == []
    assert story(TaintAnswered(T0 + 5.2)) == []
    assert story.kinds.count("SignalContainers(SIGTERM)") == 1
    assert story.rec.taint_mode == "local" and story.rec.remote_taint


def test_a_job_ignoring_sigterm_is_killed_at_the_grace_deadline_exactly_once(
    story: Story,
) -> None:
    """A renderer traps SIGTERM and keeps going. At G it gets SIGKILL; one more tick a second
    later does not start a second kill round. It dies with 137 and the node still drains."""
    tainted_with(story, "c1")
    assert story(Observed(T0 + 0.2, running=("c1",), gpu_processes=(777,))) == []
    assert story.rec.next_wakeup() == pytest.approx(T0 + 0.7)
    assert story(Tick(T0 + 0.75)) == [Observe()]
    assert story(Observed(T0 + 0.8, running=("c1",), gpu_processes=(777,))) == []
    assert story.rec.next_wakeup() == pytest.approx(T0 + 1.3)
    # The shell sleeps to G (say re-observation was slow); the kill round comes first.
    assert story(Tick(G)) == [match(CutWorkers), SignalContainers(SIGKILL), Observe()]
    assert story(signalled("c1", G + 0.01, SIGKILL)) == [
        emit("sigkill_sent", container="c1", via="api")
    ]  # no second WatchExits: c1 is already watched
    assert story(Observed(G + 0.1, running=("c1",), gpu_processes=(777,))) == []
    assert story(Tick(G + 1)) == [Observe()]
    assert story(exited("c1", G + 1.05, code=137)) == [emit("container_exited", exit_code=137)]
    assert story(Observed(G + 1.1)) == [
        emit("verified_empty"),
        emit("drained", spare_s=pytest.approx(8.9)),
    ]
    assert story.kinds.count("SignalContainers(SIGKILL)") == 1
    assert story.kinds.index("CutWorkers") == story.kinds.index("SignalContainers(SIGKILL)") - 1


def test_a_slurm_job_is_requeued_and_its_manager_notes_go_into_the_record(
    story: Story,
) -> None:
    """A host running Slurm: the DRAIN lands 12 ms after the notice, the requeueable job is
    requeued by its SIGTERM round, leaves the node PENDING (to restart elsewhere), and the node
    drains. The manager's notes are recorded as they come, before and after the drain."""
    story.begin()
    noted = ManagerNoted(T0 + 0.012, "manager_cordoned", {"manager": "slurm", "ms": 12.0})
    assert story(noted) == [emit("manager_cordoned", manager="slurm", ms=12.0)]
    story(TaintAnswered(T0 + 0.05))
    requeued = ContainerSignalled(T0 + 0.07, "slurm:101", "train", SIGTERM, "requeue")
    assert story(requeued) == [
        emit("sigterm_sent", container="slurm:101", via="requeue"),
        WatchExits(("slurm:101",)),
    ]
    story(SignalRoundDone(T0 + 0.08, SIGTERM))
    assert story(Observed(T0 + 0.1, running=("slurm:101",))) == []  # the requeue under way
    left = ContainerExited(T0 + 2.0, "slurm:101", "train", 0, state="PENDING")
    assert story(left) == [
        emit("container_exited", container="slurm:101", exit_code=0, state="PENDING"),
        Observe(),
    ]
    assert kinds(story(Observed(T0 + 2.1))) == ["verified_empty", "drained"]
    lifted = ManagerNoted(T0 + 40, "manager_uncordoned", {"manager": "slurm"})
    assert story(lifted) == [emit("manager_uncordoned")]


def test_a_manager_note_of_a_kind_not_listed_is_refused(story: Story) -> None:
    story.begin()
    with pytest.raises(ValueError, match="not a manager's note"):
        story(ManagerNoted(T0 + 0.1, "tainted", {}))


# --- when verification cannot succeed -------------------------------------------------------


def test_a_gpu_process_outliving_every_container_is_an_overrun_and_never_drained(
    story: Story,
) -> None:
    """The container is gone but a zombie CUDA process (pid 4242) still holds the GPU. The node
    is not empty: at O it is an overrun, once; when the process finally disappears the emptiness
    is recorded, but the node never counts as drained (invariant 6)."""
    tainted_with(story, "c1")
    assert story(exited("c1", T0 + 1)) == [emit("container_exited")]  # an Observe is in flight
    assert story(Observed(T0 + 1.1, gpu_processes=(4242,))) == [Observe()]  # asked again
    assert story(Observed(T0 + 1.2, gpu_processes=(4242,))) == []
    assert story(Tick(T0 + 1.75)) == [Observe()]
    assert story(Observed(T0 + 1.8, gpu_processes=(4242,))) == []
    assert story(Tick(G)) == [match(CutWorkers), SignalContainers(SIGKILL), Observe()]
    assert story(SignalRoundDone(G + 0.1, SIGKILL)) == []  # an Observe is in flight
    assert story(Observed(G + 0.2, gpu_processes=(4242,))) == [Observe()]
    assert story(Observed(G + 0.3, gpu_processes=(4242,))) == []
    assert story.rec.next_wakeup() == pytest.approx(G + 0.8)

    assert story(Tick(O)) == [
        emit("overrun", still_running=[], last_failure=""),
        Observe(),
    ]
    assert story(Observed(O + 0.1, gpu_processes=(4242,))) == []
    assert story(Tick(O + 0.65)) == [Observe()]
    assert story(Tick(O + 0.7)) == []
    assert story(Observed(O + 1, gpu_processes=(4242,))) == []
    assert story(Tick(D - 0.45)) == [Observe()]
    assert story(Observed(D - 0.4)) == [emit("verified_empty")]  # not drained
    assert story.rec.finished and story.rec.next_wakeup() is None
    assert story(Tick(D)) == []
    assert story.kinds.count("overrun") == 1 and "drained" not in story.kinds


def test_the_drain_goes_on_after_an_overrun(story: Story) -> None:
    """O passes with a job still running: the overrun is recorded, but the agent keeps killing
    and looking. A job someone starts after O is killed too, and the emptiness is recorded
    when it comes (never as drained)."""
    tainted_with(story, "c1")
    assert story(Observed(T0 + 0.2, running=("c1",))) == []
    assert story(Tick(G)) == [match(CutWorkers), SignalContainers(SIGKILL), Observe()]
    assert story(signalled("c1", G + 0.05, SIGKILL)) == [emit("sigkill_sent")]
    assert story(SignalRoundDone(G + 0.06, SIGKILL)) == []  # a look is in flight: again after
    assert story(Observed(G + 0.1, running=("c1",))) == [Observe()]  # dying, killed already
    assert story(Observed(G + 0.2, running=("c1",))) == []
    assert story(Tick(O)) == [emit("overrun", still_running=["job-c1"]), Observe()]
    assert story(Observed(O + 0.1, running=("c1", "c7"))) == [
        SignalContainers(SIGKILL, skip=frozenset({"c1"}))
    ]
    assert story(signalled("c7", O + 0.2, SIGKILL)) == [emit("sigkill_sent"), WatchExits(("c7",))]
    assert story(exited("c1", O + 0.3, code=137)) == [emit("container_exited")]
    assert story(exited("c7", O + 0.4, code=137)) == [emit("container_exited"), Observe()]
    assert story(Observed(O + 0.5)) == [emit("verified_empty")]
    assert story.rec.finished and story.rec.next_wakeup() is None


def test_a_drain_under_the_local_taint_stays_open_until_the_coordinator_has_the_taint(
    story: Story,
) -> None:
    """The coordinator is down for the whole drain. The node drains under its local taint; the
    reclamation is not finished while the coordinator does not know the node is tainted, and a
    restart keeps retrying. When the retry lands, it is done."""
    story.begin()
    story(Tick(T0 + 0.8))
    assert story(SignalRoundDone(T0 + 0.9, SIGTERM)) == [Observe()]
    assert story(Observed(T0 + 1)) == [emit("verified_empty"), emit("drained", spare_s=29.0)]
    assert not story.rec.finished
    assert story.restart(T0 + 5) == [match(RetryRemoteTaint)]
    assert story(TaintAnswered(T0 + 6)) == [emit("tainted", mode="remote", after_local=True)]
    assert story.rec.finished and story.rec.next_wakeup() is None
    assert story.restart(T0 + 7) == []


def test_nvml_and_docker_errors_are_never_empty_and_are_reported_once_each(story: Story) -> None:
    """NVML reports the GPU lost, then Docker times out. A failed look is not an empty node
    (invariant 5): each distinct failure is reported once, not on every retry, and at O the
    node is an overrun carrying the last failure."""
    tainted_with(story)  # the SIGTERM round found no container
    lost = "nvmlDeviceGetComputeRunningProcesses: NVML_ERROR_GPU_IS_LOST"
    docker = "docker: list containers: read timeout"
    assert story(Observed(T0 + 0.2, error=lost)) == [emit("verification_failed", error=lost)]
    assert story(Tick(T0 + 0.75)) == [Observe()]
    assert story(Observed(T0 + 0.8, error=lost)) == []  # the same failure again: no new event
    assert story(Tick(T0 + 1.35)) == [Observe()]
    assert story(Observed(T0 + 1.4, error=docker)) == [emit("verification_failed", error=docker)]
    assert story(Tick(T0 + 1.95)) == [Observe()]
    assert story(Observed(T0 + 2.0, error=docker)) == []
    assert story(Tick(G)) == [match(CutWorkers), SignalContainers(SIGKILL), Observe()]
    assert story(Observed(G + 0.1, error=docker)) == []
    assert story(Tick(O)) == [emit("overrun", last_failure=docker), Observe()]
    assert story(Observed(O + 0.1, error=docker)) == []
    assert "verified_empty" not in story.kinds and "drained" not in story.kinds
    assert story.kinds.count("verification_failed") == 2


# --- restarts and deadlines ------------------------------------------------------------------


def test_an_agent_restart_mid_drain_keeps_the_deadlines_and_sends_no_second_sigterm(
    story: Story,
) -> None:
    """systemd restarts the agent 12 s into the drain. It reloads the bundle: same D, G and O,
    one job already gone, the other still watched; nobody gets SIGTERM twice (invariants 2, 8)."""
    tainted_with(story, "c1", "c2")
    story(exited("c1", T0 + 3))
    before = story.rec.to_json()

    assert story.restart(T0 + 12) == [
        match(WriteDeadlineFile, terminate_at=D, grace_deadline=G),
        match(DrainWorkers, grace_deadline=G),
        WatchExits(("c2",)),
        Observe(),
    ]
    after = story.rec.to_json()
    for key in ("t0", "terminate_at", "grace_deadline", "overrun_at", "reclaim_id", "signalled"):
        assert after[key] == before[key]
    assert story(Observed(T0 + 12.1, running=("c2",))) == []  # c2 is known: not a stray
    assert story(Tick(G)) == [match(CutWorkers), SignalContainers(SIGKILL), Observe()]


def test_a_restart_after_the_local_fallback_reapplies_the_local_taint_and_keeps_retrying(
    story: Story,
) -> None:
    """The coordinator is down and the agent crashes after its local fallback. The local taint
    (the agent's own start refusal) and the background retry come back with it."""
    story.begin()
    story(Tick(T0 + 0.8))
    story(signalled("c1", T0 + 0.9))
    assert story.restart(T0 + 4) == [
        match(ApplyLocalTaint),
        match(RetryRemoteTaint),
        match(WriteDeadlineFile, terminate_at=D),
        match(DrainWorkers),
        WatchExits(("c1",)),
        Observe(),
    ]


def test_an_agent_down_through_the_grace_deadline_kills_and_records_the_overrun_on_return(
    story: Story,
) -> None:
    """The agent is down from T0+1 until past O. On return, the deadlines have passed: it kills
    what is left and records the overrun at once; it does not grant itself new time."""
    tainted_with(story, "c1")
    assert story.restart(O + 0.5) == [
        match(WriteDeadlineFile),
        match(DrainWorkers),
        WatchExits(("c1",)),
        Observe(),
        match(CutWorkers),
        SignalContainers(SIGKILL),
        emit("overrun", still_running=["job-c1"]),
    ]


def test_a_restart_while_the_taint_call_was_in_flight_asks_again(story: Story) -> None:
    """The agent dies 0.3 s after sending the Taint call: it asks again, with a fresh 800 ms."""
    story.begin()
    assert story.restart(T0 + 0.3) == [match(RequestTaint, answer_by=pytest.approx(T0 + 1.1))]
    assert story.rec.next_wakeup() == pytest.approx(T0 + 1.1)
    assert story(Tick(T0 + 1.0)) == []
    assert story(Tick(T0 + 1.15)) == [*LOCAL_FALLBACK, *EVICT]


def test_a_restart_right_after_the_sigterm_round_was_persisted_catches_the_jobs_as_strays(
    story: Story,
) -> None:
    """The bundle says 'SIGTERM round issued' but the agent died before delivering it. The
    round is not repeated blindly; the first observation finds the unsignalled jobs and
    signals exactly them."""
    story.begin()
    story(TaintAnswered(T0 + 0.05))
    assert story.restart(T0 + 2) == [match(WriteDeadlineFile), match(DrainWorkers), Observe()]
    assert story(Observed(T0 + 2.1, running=("c1", "c2"))) == [SignalContainers(SIGTERM)]


def test_a_restart_right_after_the_sigkill_round_was_persisted_still_kills(story: Story) -> None:
    """The agent persisted 'SIGKILL round issued' at G and died before the Docker calls. The
    job that ignores SIGTERM must still be killed after the restart."""
    tainted_with(story, "c1")
    story(Tick(G))
    commands = story.restart(G + 1)
    assert SignalContainers(SIGKILL) in commands or any(
        isinstance(c, SignalContainers) and c.signal == SIGKILL
        for c in story(Observed(G + 1.1, running=("c1",)))
    )


def test_two_restarts_while_tainting_each_give_800ms_not_more(story: Story) -> None:
    """The agent crash-loops while the Taint call is in flight: restarted at T0+10 and T0+20.
    Each restart may wait 800 ms for the coordinator, not 10.8 s (invariant 2: a restart never
    extends a deadline)."""
    story.begin()
    assert story.restart(T0 + 10) == [match(RequestTaint, answer_by=pytest.approx(T0 + 10.8))]
    assert story.restart(T0 + 20) == [match(RequestTaint, answer_by=pytest.approx(T0 + 20.8))]


def test_next_wakeup_never_sleeps_past_a_pending_deadline(story: Story) -> None:
    """The shell sleeps until next_wakeup(). It must wake by the taint deadline, by G while no
    SIGKILL round was sent, and by O while there is no outcome."""
    story.begin()
    assert story.rec.next_wakeup() == T0 + 0.8
    story(TaintAnswered(T0 + 0.05))
    story(signalled("c1", T0 + 0.06))
    story(SignalRoundDone(T0 + 0.07, SIGTERM))  # Observe in flight, nothing else scheduled
    assert story.rec.next_wakeup() == G
    story(Observed(T0 + 0.1, running=("c1",)))
    assert story.rec.next_wakeup() == pytest.approx(T0 + 0.6)
    story(Tick(G))  # SIGKILL round sent, Observe in flight
    assert story.rec.next_wakeup() == O
    story(Tick(O))
    assert story.rec.next_wakeup() is None  # overrun recorded; an Observe is in flight


def test_a_slow_observation_does_not_make_the_shell_spin(story: Story) -> None:
    """NVML takes 3 s to answer. The last job exits meanwhile, which asks for another look.
    The shell's timer must not fire again and again while the first look is still out; the
    second look goes out the moment the first returns."""
    tainted_with(story, "c1")  # Observe in flight from the round
    assert story(exited("c1", T0 + 0.5)) == [emit("container_exited")]  # 'look again'
    for now in (T0 + 0.6, T0 + 0.7, T0 + 0.8):
        wake = story.rec.next_wakeup()
        assert wake is not None and wake > now, f"woken at {now} for {wake}, to do nothing"
        assert story(Tick(now)) == []
    # The slow look was taken before the exit: it still sees c1. Look again at once.
    assert story(Observed(T0 + 3, running=("c1",))) == [Observe()]
    assert story(Observed(T0 + 3.1)) == [emit("verified_empty"), emit("drained")]


# --- a notice that is already late ----------------------------------------------------------


def test_a_notice_already_past_its_deadline_signals_kills_and_records_the_overrun(
    story: Story,
) -> None:
    """The relay was down and the notice arrives 5 s after D. Once the node is tainted, SIGTERM
    and SIGKILL go out at once and the overrun is recorded: never drained."""
    late = notice(terminate_at=T0 - 5)
    assert story.begin(late) == [
        emit("notice_received", terminate_at=T0 - 5, late=True),
        match(RequestTaint, answer_by=T0 + 0.8),
    ]
    assert story(TaintAnswered(T0 + 0.05)) == [
        emit("tainted", mode="remote"),
        match(WriteDeadlineFile, terminate_at=T0 - 5, grace_deadline=T0 - 15),
        emit("deadline_file_written"),
        match(DrainWorkers),
        SignalContainers(SIGTERM),
        match(CutWorkers),
        SignalContainers(SIGKILL),
        emit("overrun"),
    ]
    story(signalled("c1", T0 + 0.06, SIGKILL))
    story(SignalRoundDone(T0 + 0.07, SIGKILL))
    assert story(Observed(T0 + 0.2)) == [emit("verified_empty")]


def test_a_late_notice_is_still_signalled_when_the_shell_ticks_at_next_wakeup(
    story: Story,
) -> None:
    """Same late notice, but the shell does what next_wakeup() says: O is already past, so it
    ticks at once, before the coordinator answers. The overrun is recorded then; the jobs still
    get SIGTERM and SIGKILL once the taint is in force."""
    story.begin(notice(terminate_at=T0 - 5))
    wake = story.rec.next_wakeup()
    assert wake is not None and wake <= T0
    assert story(Tick(T0)) == [emit("overrun", still_running=[])]
    assert story(TaintAnswered(T0 + 0.05)) == [
        emit("tainted", mode="remote"),
        match(WriteDeadlineFile, terminate_at=T0 - 5),
        emit("deadline_file_written"),
        match(DrainWorkers),
        SignalContainers(SIGTERM),
        match(CutWorkers),
        SignalContainers(SIGKILL),
    ]


def test_a_tight_notice_with_a_silent_coordinator_still_falls_back_to_the_local_taint(
    story: Story,
) -> None:
    """D is T0+2.5 (O = T0+0.5) and the coordinator is down. O passes while the agent is still
    waiting on the Taint call; at T0+0.8 it must still taint locally and signal."""
    story.begin(notice(terminate_at=T0 + 2.5))
    assert story(Tick(T0 + 0.5)) == [emit("overrun")]  # O: nothing verified it empty
    assert story(Tick(T0 + 0.8)) == [
        *LOCAL_FALLBACK,
        match(WriteDeadlineFile, terminate_at=T0 + 2.5, grace_deadline=T0 - 7.5),
        emit("deadline_file_written"),
        match(DrainWorkers),
        SignalContainers(SIGTERM),
        match(CutWorkers),
        SignalContainers(SIGKILL),  # G = D - 10 is long past
    ]
    assert story(signalled("c1", T0 + 0.9, SIGKILL)) == [emit("sigkill_sent"), WatchExits(("c1",))]
    assert story(SignalRoundDone(T0 + 1, SIGKILL)) == [Observe()]
    assert story(Observed(T0 + 1.1)) == [emit("verified_empty")]  # never drained


@pytest.mark.parametrize("when", [O, D + 1], ids=["at-O", "after-D"])
def test_an_empty_observation_arriving_after_o_is_not_a_drain(when: float) -> None:
    """The last look was slow and comes back only at `when`, before the shell's timer for O has
    fired. Nothing verified the node empty by O: that is an overrun, not a drain."""
    story = Story()  # no teardown check: this story breaks it
    tainted_with(story, "c1")
    story(exited("c1", T0 + 1))
    story(Observed(T0 + 1.1, running=("c1",)))  # the in-flight look predates the exit
    outcome = kinds(story(Observed(when)))
    assert "drained" not in outcome and "overrun" in story.kinds, outcome


# --- the same notice heard again ---------------------------------------------------------------


def test_a_rewritten_notice_with_a_later_d_is_recorded_and_moves_nothing(story: Story) -> None:
    """The provider rewrites its notice from T+60 to T+300 (AWS has been seen to): the same
    interruption, D stays the earliest heard, and the update is in the timeline."""
    story.begin(notice(terminate_at=T0 + 60))
    story(TaintAnswered(T0 + 0.05))
    assert story(NoticeHeard(T0 + 1, "terminate", T0 + 300)) == [
        emit(
            "notice_updated",
            action="terminate",
            heard_terminate_at=T0 + 300,
            terminate_at=T0 + 60,
            moved=False,
            unrecorded=0,
        ),
    ]
    assert story.rec.terminate_at == T0 + 60
    # The same document read again (the next poll, an agent restart): nothing at all.
    assert story(NoticeHeard(T0 + 2, "terminate", T0 + 300)) == []
    restarted = Reclamation.from_json(json.loads(json.dumps(story.rec.to_json())))
    assert restarted.handle(NoticeHeard(T0 + 3, "terminate", T0 + 300)) == []


def test_an_earlier_d_heard_mid_drain_moves_d_g_and_o_earlier_and_tells_the_workloads(
    story: Story,
) -> None:
    """T+300 first, then T+60: the drain runs to the earlier deadlines from then on (the
    deadline file and the gates are told), and G passing at once kills at once."""
    story.begin(notice(terminate_at=T0 + 300))
    tainted_with_d = story(TaintAnswered(T0 + 0.05))
    assert match(WriteDeadlineFile, terminate_at=T0 + 300) in tainted_with_d
    grace, overrun = MARGINS.grace_s, MARGINS.overrun_s
    assert story(NoticeHeard(T0 + 1, "terminate", T0 + 60)) == [
        emit(
            "notice_updated",
            heard_terminate_at=T0 + 60,
            terminate_at=T0 + 60,
            grace_deadline=T0 + 60 - grace,
            overrun_at=T0 + 60 - overrun,
            moved=True,
        ),
        match(WriteDeadlineFile, terminate_at=T0 + 60, grace_deadline=T0 + 60 - grace),
        emit("deadline_file_written", terminate_at=T0 + 60, grace_deadline=T0 + 60 - grace),
        match(DrainWorkers, grace_deadline=T0 + 60 - grace),
    ]
    assert story.rec.next_wakeup() == T0 + 60 - grace
    # A later one again never moves it back.
    story(NoticeHeard(T0 + 2, "terminate", T0 + 300))
    assert story.rec.terminate_at == T0 + 60
    # An earlier D whose G has already passed: the SIGKILL round comes in the same step.
    commands = story(NoticeHeard(T0 + 5, "terminate", T0 + 12))
    assert match(CutWorkers) in commands and SignalContainers(SIGKILL) in commands


def test_a_notice_re_stamped_on_every_read_is_one_record_every_ten_seconds() -> None:
    """AWS's own mock re-stamps `time` on every read: a later D each second for two minutes is
    one reclamation with a notice_updated every ten seconds, each counting the ones between."""
    rec, _ = Reclamation.begin(notice(terminate_at=T0 + 120), NODE, T0, MARGINS)
    updates = []
    for second in range(1, 121):
        for cmd in rec.handle(NoticeHeard(T0 + second, "terminate", T0 + 120 + second)):
            assert cmd == emit("notice_updated", moved=False, terminate_at=T0 + 120)
            updates.append(cmd.details["unrecorded"])  # type: ignore[union-attr]
    assert updates == [0] + [9] * 11
    assert rec.terminate_at == T0 + 120


def test_a_notice_heard_after_a_cancel_or_the_drain_moves_nothing(story: Story) -> None:
    tainted_with(story, "c1")
    story(ContainerExited(T0 + 1, "c1", "c1", 0))
    story(Observed(T0 + 1.1))
    assert story.rec.outcome == "drained"
    assert story(NoticeHeard(T0 + 2, "terminate", T0 + 5)) == [
        emit("notice_updated", moved=False, terminate_at=D)
    ]


# --- cancellation ----------------------------------------------------------------------------


def test_a_cancel_while_tainting_lifts_the_taints_and_nothing_is_ever_signalled(
    story: Story,
) -> None:
    """The provider withdraws the notice 100 ms in, before the taint answered: the node goes
    back to work and no job is touched, even when the old timers still fire."""
    story.begin()
    assert story(Cancelled(T0 + 0.1)) == [
        emit("notice_cancelled", lifted=True),
        LiftTaints(story.rec.reclaim_id),
    ]
    # Open until the coordinator has lifted the taint too; no timer of its own any more.
    assert not story.rec.finished and story.rec.next_wakeup() is None
    for later in (TaintAnswered(T0 + 0.2), Tick(T0 + 0.8), Tick(G), Tick(O), Tick(D)):
        assert story(later) == []
    assert story(TaintsLifted(T0 + 0.3)) == [] and story.rec.finished
    # The same cancel read again (an agent restarted while it is still the notice file's
    # content): recorded once, not again.
    assert story(Cancelled(T0 + 40)) == []


def test_a_cancel_of_a_finished_drain_is_recorded_once(story: Story) -> None:
    """The notice is withdrawn after the node was drained: recorded with the outcome, once."""
    tainted_with(story, "c1")
    story(ContainerExited(T0 + 1, "c1", "c1", 0))
    story(Observed(T0 + 1.1))
    assert story.rec.outcome == "drained" and story.rec.finished
    assert story(Cancelled(T0 + 2)) == [emit("notice_cancelled", lifted=False, outcome="drained")]
    assert story(Cancelled(T0 + 3)) == []


def test_a_cancel_after_jobs_were_signalled_is_recorded_and_the_drain_goes_on(
    story: Story,
) -> None:
    """The notice is withdrawn after a job already got SIGTERM: it is checkpointing and
    leaving, so the taints stay and the drain finishes under the same deadlines."""
    tainted_with(story, "c1")
    assert story(Cancelled(T0 + 1)) == [emit("notice_cancelled", lifted=False)]
    assert story(Observed(T0 + 1.1, running=("c1",))) == []
    assert story(Tick(G)) == [match(CutWorkers), SignalContainers(SIGKILL), Observe()]
    assert story(exited("c1", G + 0.5, code=137)) == [emit("container_exited")]
    assert story(Observed(G + 0.6)) == [
        emit("verified_empty"),
        emit("drained", spare_s=pytest.approx(9.4)),
    ]


def test_a_cancel_after_the_sigterm_round_found_nothing_lifts_the_taints(story: Story) -> None:
    """The node ran no job when the notice came: nothing was stopped, so a cancel hands the node
    straight back."""
    tainted_with(story)
    assert story(Cancelled(T0 + 0.2)) == [
        emit("notice_cancelled", lifted=True),
        LiftTaints(story.rec.reclaim_id),
    ]
    assert story(Observed(T0 + 0.3)) == []  # the look in flight no longer matters
    assert story(Tick(G)) == [] and story(Tick(O)) == []


def test_a_cancel_of_a_late_notice_before_anything_was_stopped_lifts_the_taints(
    story: Story,
) -> None:
    """A notice already past its D arrives and the overrun is recorded at once; 100 ms later,
    before the coordinator answered the taint, the provider cancels it. Nothing was stopped:
    the taints are lifted and no job is ever signalled."""
    story.begin(notice(terminate_at=T0 - 5))
    assert story(Tick(T0)) == [emit("overrun")]
    assert story(Cancelled(T0 + 0.1)) == [
        emit("notice_cancelled", lifted=True),
        LiftTaints(story.rec.reclaim_id),
    ]
    assert story(Tick(T0 + 0.8)) == []


def test_a_provider_cancel_after_an_empty_node_was_verified_lifts_the_taints(
    story: Story,
) -> None:
    """Nothing runs on the node: it is verified empty at once and counted drained. 84 s before
    D the provider removes the Terminate (the agent restarted in between). Nothing was stopped
    under the notice, so the machine is the provider's to keep and ours to use: the taints are
    lifted, and the timeline says so, with the outcome the drain had."""
    tainted_with(story)
    assert story(Observed(T0 + 0.2)) == [emit("verified_empty"), emit("drained")]
    assert story.rec.finished
    story.restart(T0 + 1)
    assert story(Cancelled(T0 + 2)) == [
        emit("notice_cancelled", lifted=True, outcome="drained"),
        LiftTaints(story.rec.reclaim_id),
    ]
    assert story.rec.lifted and story.rec.outcome == "drained"  # as the record has it
    # Open until the coordinator has lifted the taint too; no timer of its own any more.
    assert not story.rec.finished and story.rec.next_wakeup() is None
    assert story(Tick(G)) == [] and story(Tick(O)) == []
    story.restart(T0 + 3)  # a lift the coordinator had not confirmed is asked again
    assert story.log[-1][1] == LiftTaints(story.rec.reclaim_id)
    assert story(TaintsLifted(T0 + 4)) == [] and story.rec.finished
    assert story(Cancelled(T0 + 5)) == []


def test_a_cancel_after_a_worker_drained_at_its_gate_keeps_the_taints(story: Story) -> None:
    """An inference worker was drained at its gate and has left, and the node was verified
    empty: something was stopped under the notice, so a cancel is recorded and the taints
    stay."""
    story.begin()
    story(TaintAnswered(T0 + 0.05))
    story(WorkersDraining(T0 + 0.06, ("w1",), ("worker-1",)))
    assert story(SignalRoundDone(T0 + 0.07, SIGTERM)) == [Observe()]
    story(exited("w1", T0 + 1))
    assert "drained" in kinds(story(Observed(T0 + 1.1)))
    assert story(Cancelled(T0 + 2)) == [emit("notice_cancelled", lifted=False, outcome="drained")]


def test_a_cancel_while_a_stray_has_its_sigterm_announced_keeps_the_taints(story: Story) -> None:
    """The node was empty when the notice came, but a look then found a job started by hand,
    and the round that signals it has announced it: its SIGTERM may be on its way. A cancel now
    lifts nothing; the drain goes on."""
    tainted_with(story)
    stray = story(Observed(T0 + 0.2, running=("c9",)))
    assert stray == [match(SignalContainers, signal=SIGTERM)]
    assert story(listed(T0 + 0.25, "c9")) == [DeliverSignals(SIGTERM, ("c9",))]
    assert story(Cancelled(T0 + 0.3)) == [emit("notice_cancelled", lifted=False)]
    assert story(signalled("c9", T0 + 0.31))[0] == emit("sigterm_sent", container="c9")


# --- strays and failures ---------------------------------------------------------------------


def test_a_container_started_by_hand_during_the_drain_is_signalled_like_the_rest(
    story: Story,
) -> None:
    """An operator `docker run`s a job with the node label past the taint. The next look sees
    it: it gets SIGTERM (the others are skipped), and after G a later stray gets SIGKILL."""
    tainted_with(story, "c1")
    assert story(Observed(T0 + 1, running=("c1", "c9"))) == [
        SignalContainers(SIGTERM, skip=frozenset({"c1"}))
    ]
    assert story(signalled("c9", T0 + 1.1)) == [emit("sigterm_sent"), WatchExits(("c9",))]
    assert story(SignalRoundDone(T0 + 1.2, SIGTERM)) == []  # a stray round: the usual pace
    assert story(Tick(T0 + 1.2 + 0.5)) == [Observe()]
    assert story(Observed(T0 + 1.3, running=("c1", "c9"))) == []  # both have had SIGTERM
    assert story(Tick(G)) == [match(CutWorkers), SignalContainers(SIGKILL), Observe()]
    assert story(signalled("c1", G + 0.01, SIGKILL)) == [emit("sigkill_sent")]
    assert story(signalled("c9", G + 0.02, SIGKILL)) == [emit("sigkill_sent")]
    assert story(SignalRoundDone(G + 0.03, SIGKILL)) == []  # a look is in flight
    assert story(Observed(G + 0.1, running=("c1", "c9", "c10"))) == [
        SignalContainers(SIGKILL, skip=frozenset({"c1", "c9"})),
        Observe(),
    ]


def test_a_signal_that_could_not_be_delivered_is_reported_and_retried_as_a_stray(
    story: Story,
) -> None:
    """The engine hangs and the pid route fails too: the failure is an event, not a crash,
    and the container, still unsignalled, is signalled again at the next look."""
    story.begin()
    story(TaintAnswered(T0 + 0.05))
    failed = ContainerSignalled(T0 + 2, "c1", "job-c1", SIGTERM, via="pid", error="ESRCH")
    assert story(failed) == [
        emit("signal_failed", container="c1", signal=SIGTERM, via="pid", error="ESRCH")
    ]
    assert story(SignalRoundDone(T0 + 2.1, SIGTERM)) == [Observe()]
    assert story(Observed(T0 + 2.2, running=("c1",))) == [SignalContainers(SIGTERM)]


# --- configuration and identity --------------------------------------------------------------


@pytest.mark.parametrize(
    "margins",
    [
        dict(grace_s=10, overrun_s=11),
        dict(overrun_s=-1),
        dict(taint_answer_s=0),
        dict(observe_every_s=0),
        dict(default_notice_s=-5),
    ],
    ids=["overrun-beyond-grace", "negative-overrun", "no-taint-time", "no-observe", "no-notice"],
)
def test_margins_that_would_break_the_timeline_are_refused(margins: dict[str, float]) -> None:
    """An overrun check before the grace deadline would count an overrun before SIGKILL."""
    with pytest.raises(ValueError, match="margin"):
        Margins(**margins)


def test_equal_grace_and_overrun_margins_are_allowed() -> None:
    assert Margins(grace_s=5, overrun_s=5).overrun_s == 5


def test_the_reclamation_id_is_deterministic_and_per_node() -> None:
    """A restarted agent and a duplicate notice name the same reclamation; two nodes receiving
    the same provider notice id do not."""
    one = reclaim_id_for("gpu-node-7", "id:i-0abc")
    assert one == reclaim_id_for("gpu-node-7", "id:i-0abc")
    assert one != reclaim_id_for("gpu-node-8", "id:i-0abc")
    assert one != reclaim_id_for("gpu-node-7", "id:i-0abd")
    assert one.startswith("rcl-") and len(one) == 20
    # No ambiguity from concatenation.
    assert reclaim_id_for("a", "bc") != reclaim_id_for("ab", "c")


def test_a_notice_without_a_time_gets_the_default_notice_period() -> None:
    rec, _ = Reclamation.begin(notice(terminate_at=None), NODE, T0, MARGINS)
    assert (rec.terminate_at, rec.grace_deadline, rec.overrun_at) == (D, G, O)


def test_a_bundle_with_unknown_fields_is_refused() -> None:
    """A bundle from a newer agent is not silently half-read."""
    rec, _ = Reclamation.begin(notice(), NODE, T0, MARGINS)
    with pytest.raises(ValueError, match="unknown fields"):
        Reclamation.from_json({**rec.to_json(), "extended_deadline": D + 60})


# --- property: any order of what the world can do ----------------------------------------


DELAYS = st.sampled_from([0.0, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 2.0, 5.0])
SHORT_DELAYS = st.sampled_from([0.0, 0.05, 0.1, 0.3, 0.8])
POOL = ("c1", "c2", "c3")


class ReclamationWorld(RuleBasedStateMachine):
    """A node with a few jobs and GPU processes, a shell that carries out the machine's commands
    and wakes when next_wakeup() says, and a world that does anything in any order: jobs exit on
    their own or not at all, signals fail, NVML errs, the coordinator answers late or never, the
    agent restarts, the notice is cancelled. The story's invariants must hold after every step.

    Signal rounds run as the shell runs them: one at a time, each listing what runs, waiting for
    the machine's DeliverSignals, then delivering exactly that. An agent that dies mid-round may
    have got any of its announced signals out first; no container ever hears SIGTERM twice."""

    @initialize(
        d_offset=st.sampled_from([None, 30.0, 30.0, 12.0, 5.0, 2.5, 1.0, 0.0, -5.0]),
        coordinator=st.sampled_from(["answers", "is silent", "is left to the rules"]),
        running=st.sets(st.sampled_from(POOL)),
        zombies=st.sets(st.just(4242)),
    )
    def begin(
        self, d_offset: float | None, coordinator: str, running: set[str], zombies: set[int]
    ) -> None:
        self.story = Story(strict=True)
        self.now = T0
        self.running = set(running)
        self.zombies = set(zombies)  # CUDA processes outliving their container
        self.exited: set[str] = set()  # exited in the world, exit not yet reported
        self.watched: set[str] = set()
        # Signal rounds in flight, in order: [signal, skip, targets]; targets None until listed.
        self.rounds: list[list[Any]] = []
        self.sigterms: dict[str, int] = {}  # SIGTERMs each container really received
        self.observes = 0  # Observe commands in flight
        self.strays = iter(f"s{i}" for i in range(100))
        self.strays_started = 0
        self.heard: list[float] = []  # every D the provider named after the first
        n = notice(terminate_at=None if d_offset is None else T0 + d_offset)
        self._carry_out(self.story.begin(n, T0))
        if coordinator == "answers":
            self._deliver(TaintAnswered(self._at(0.05)))
        elif coordinator == "is silent":
            self._deliver(Tick(self._at(0.8)))

    # the shell

    def _carry_out(self, commands: list[Command]) -> None:
        for c in commands:
            if isinstance(c, SignalContainers):
                self.rounds.append([c.signal, c.skip, None])
            elif isinstance(c, Observe):
                self.observes += 1
            elif isinstance(c, WatchExits):
                self.watched |= set(c.containers)

    def _at(self, dt: float) -> float:
        """Time passes; a timer due by now fires first, as the shell's would."""
        self.now += dt
        wake = self.story.rec.next_wakeup()
        if wake is not None and wake <= self.now:
            self._carry_out(self.story(Tick(self.now)))
        return self.now

    def _deliver(self, event: Event) -> None:
        self._carry_out(self.story(event))

    # the coordinator

    @rule(dt=SHORT_DELAYS)
    def taint_answered(self, dt: float) -> None:
        self._deliver(TaintAnswered(self._at(dt)))

    @rule(dt=SHORT_DELAYS)
    def taint_failed(self, dt: float) -> None:
        self._deliver(TaintUnanswered(self._at(dt), error="UNAVAILABLE"))

    # the Docker engine and the jobs

    @precondition(lambda self: self.rounds and self.rounds[0][2] is None)
    @rule(dt=DELAYS)
    def round_listed(self, dt: float) -> None:
        now = self._at(dt)
        signal, skip, _ = self.rounds[0]
        found = tuple(RoundTarget(c, f"job-{c}") for c in sorted(self.running - skip))
        commands = self.story(RoundListed(now, signal, found))
        [answer] = [c for c in commands if isinstance(c, DeliverSignals)]
        assert answer.signal == signal and set(answer.containers) <= self.running
        self.rounds[0][2] = set(answer.containers)
        self._carry_out(commands)

    def _received(self, c: str, signal: str, obeys: bool) -> None:
        if signal == SIGTERM:
            self.sigterms[c] = self.sigterms.get(c, 0) + 1
        if (signal == SIGKILL or obeys) and c in self.running:
            self.running.discard(c)
            self.exited.add(c)

    @precondition(lambda self: self.rounds and self.rounds[0][2])
    @rule(
        dt=DELAYS,
        pick=st.integers(0, 10),
        fails=st.sampled_from([False, False, False, True]),
        obeys=st.sampled_from([True, True, False]),  # most jobs checkpoint and exit
    )
    def signal_delivered(self, dt: float, pick: int, fails: bool, obeys: bool) -> None:
        now = self._at(dt)
        if not (self.rounds and self.rounds[0][2]):
            return  # the timer that fired first was the end of the drain
        signal, _, targets = self.rounds[0]
        c = sorted(targets)[pick % len(targets)]
        targets.discard(c)
        error = "engine timeout; pid route: ESRCH" if fails else ""
        self._deliver(ContainerSignalled(now, c, f"job-{c}", signal, via="api", error=error))
        if not fails:
            self._received(c, signal, obeys)

    @precondition(lambda self: self.rounds and self.rounds[0][2] == set())
    @rule(dt=DELAYS)
    def signal_round_done(self, dt: float) -> None:
        signal, _, _ = self.rounds.pop(0)
        self._deliver(SignalRoundDone(self._at(dt), signal))

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 10))
    def job_exits_on_its_own(self, pick: int) -> None:
        c = sorted(self.running)[pick % len(self.running)]
        self.running.discard(c)
        self.exited.add(c)

    @precondition(lambda self: self.exited & self.watched)
    @rule(dt=DELAYS, code=st.sampled_from([0, 1, 137]))
    def exit_reported(self, dt: float, code: int) -> None:
        c = sorted(self.exited & self.watched)[0]
        self.exited.discard(c)
        self._deliver(ContainerExited(self._at(dt), c, f"job-{c}", code))

    @precondition(lambda self: self.strays_started < 2)
    @rule()
    def someone_starts_a_stray(self) -> None:
        self.strays_started += 1
        self.running.add(next(self.strays))

    @precondition(lambda self: self.zombies)
    @rule()
    def zombie_gpu_process_ends(self) -> None:
        self.zombies.pop()

    @property
    def gpu(self) -> set[int]:
        """What NVML lists: one process per running job, plus the zombies."""
        return {4000 + sum(map(ord, c)) for c in self.running} | self.zombies

    # NVML and the Docker listing

    @precondition(lambda self: self.observes > 0)
    @rule(dt=DELAYS, error=st.sampled_from(["", "", "", "", "", "GPU_IS_LOST", "docker: 500"]))
    def observation_returns(self, dt: float, error: str) -> None:
        self.observes -= 1
        now = self._at(dt)
        if error:
            event = Observed(now, error=error)
        else:
            event = Observed(now, tuple(sorted(self.running)), tuple(sorted(self.gpu)))
        commands = self.story(event)
        if emit("verified_empty") in commands:
            # Invariant 5: only a look that answered, at a node really empty.
            assert not error and not self.running and not self.gpu, (event, commands)
        self._carry_out(commands)

    # time, the provider, the agent process

    @rule(dt=DELAYS)
    def tick(self, dt: float) -> None:
        self._deliver(Tick(self._at(dt)))

    @rule(dt=DELAYS, rarely=st.integers(0, 3))
    def cancelled(self, dt: float, rarely: int) -> None:
        if rarely == 0:
            self._deliver(Cancelled(self._at(dt)))

    @rule(dt=SHORT_DELAYS, d_offset=st.sampled_from([-5.0, 0.0, 3.0, 12.0, 30.0, 300.0]))
    def notice_heard_again(self, dt: float, d_offset: float) -> None:
        """The provider rewrites or re-stamps its notice: any D, before or after the one held."""
        now = self._at(dt)
        self.heard.append(now + d_offset)
        self._deliver(NoticeHeard(now, "terminate", now + d_offset))

    @invariant()
    def d_is_the_earliest_heard_while_the_drain_runs(self) -> None:
        rec = self.story.rec
        if rec.phase != "done" and not rec.lifted:
            assert rec.terminate_at == min([self.story.deadlines[1], *self.heard])

    @rule(dt=DELAYS, got_out=st.integers(0, 7), obeys=st.booleans())
    def agent_restarts(self, dt: float, got_out: int, obeys: bool) -> None:
        """The agent is SIGKILLed. Of the round it was delivering, the signals picked by
        `got_out` had reached the engine already; the results died with the process."""
        if self.rounds and self.rounds[0][2]:
            signal, _, targets = self.rounds[0]
            for i, c in enumerate(sorted(targets)):
                if got_out >> i & 1:
                    self._received(c, signal, obeys)
        self.now += dt
        self.rounds.clear()  # whatever the old process had in flight died with it
        self.observes = 0
        self._carry_out(self.story.restart(self.now))

    # after every step

    @invariant()
    def the_story_keeps_the_invariants(self) -> None:
        self.story.check()

    @invariant()
    def no_container_ever_hears_sigterm_twice(self) -> None:
        assert all(n <= 1 for n in self.sigterms.values()), self.sigterms

    @invariant()
    def the_shell_is_woken_by_every_pending_deadline(self) -> None:
        rec, wake = self.story.rec, self.story.rec.next_wakeup()
        if not rec.outcome:
            assert wake is not None and wake <= rec.overrun_at
        if rec.phase == "draining" and not rec.sigkill_round:
            assert wake is not None and wake <= rec.grace_deadline

    def teardown(self) -> None:
        # Shown by --hypothesis-show-statistics: every outcome must be well explored.
        event(f"outcome: {self.story.rec.outcome or self.story.rec.phase}")

    @invariant()
    def drained_only_after_an_empty_look(self) -> None:
        names = self.story.kinds
        if "drained" in names:
            assert names[names.index("drained") - 1] == "verified_empty"


ReclamationWorld.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None
)
test_any_order_of_events_keeps_the_invariants = ReclamationWorld.TestCase


def test_a_cancel_after_a_sigkill_announced_before_a_restart_lifts_nothing() -> None:
    """Found by the property test above. G already past at the notice: a stray's SIGTERM fails,
    the SIGKILL round announces it, the agent dies before the result, and the restart withdraws
    the SIGKILL (it may have been delivered: reported `by previous run`). A provider's cancel
    then must not lift: something may have been stopped under this notice."""
    world = ReclamationWorld()
    world.begin(d_offset=5.0, coordinator="answers", running=set(), zombies=set())
    world.someone_starts_a_stray()
    world.round_listed(dt=0.0)
    world.someone_starts_a_stray()
    world.signal_delivered(dt=0.0, fails=True, obeys=True, pick=0)
    world.job_exits_on_its_own(pick=0)
    world.signal_round_done(dt=0.0)
    world.round_listed(dt=0.0)
    world.agent_restarts(dt=0.0, got_out=0, obeys=False)
    assert "sigkill_sent" in world.story.kinds
    world.cancelled(dt=0.0, rarely=0)
    assert world.story.kinds[-1] == "notice_cancelled"
    assert not any(isinstance(c, LiftTaints) for _, c in world.story.log)
    world.the_story_keeps_the_invariants()


def test_a_look_during_the_sigterm_round_never_signals_a_job_twice(story: Story) -> None:
    """The round is still reaching c2 when c1 exits and a look sees c2 running. c2 is not a
    stray: a second SIGTERM would make many jobs skip their checkpoint and quit at once."""
    story.begin()
    story(TaintAnswered(T0 + 0.05))
    story(signalled("c1", T0 + 0.06))
    assert story(exited("c1", T0 + 0.07)) == [emit("container_exited"), Observe()]
    assert story(Observed(T0 + 0.08, running=("c2",))) == []
    story(signalled("c2", T0 + 0.09))
    assert story(SignalRoundDone(T0 + 0.1, SIGTERM)) == [Observe()]
    assert story(Observed(T0 + 0.2, running=("c2",))) == []


def test_a_bundle_from_an_older_agent_still_loads() -> None:
    """An agent upgraded mid-reclamation reads the bundle its predecessor wrote: fields added
    since then take their defaults, the deadlines are untouched."""
    rec, _ = Reclamation.begin(notice(), "node-a", T0, MARGINS)
    doc = rec.to_json()
    for newer in (
        "taint_answer_s",
        "rounds_in_flight",
        "observe_again",
        "announced",
        "sigterm_by_previous_run",
    ):
        doc.pop(newer)
    again = Reclamation.from_json(doc)
    assert (again.terminate_at, again.grace_deadline, again.overrun_at) == (D, G, O)


# --- inference workers and the owner's pause -------------------------------------------------


def test_inference_workers_drain_at_their_gates_and_are_never_sigtermed(story: Story) -> None:
    """Two inference workers are on the node when the notice lands. They are drained at their
    slot gates (the routers stop sending, the gates refuse new requests), not signalled: the
    SIGTERM round skips them, and a look that sees them running does not treat them as strays.
    At G their open streams are cut before the SIGKILL round."""
    tainted_with(story, "batch")
    commands = story(WorkersDraining(T0 + 0.06, ("w1", "w2"), ("worker-1", "worker-2")))
    assert commands == [
        emit("worker_draining", container="w1", name="worker-1"),
        emit("worker_draining", container="w2", name="worker-2"),
        WatchExits(("w1", "w2")),
    ]
    assert story(Observed(T0 + 0.2, running=("batch", "w1", "w2"))) == []
    assert story(exited("batch", T0 + 1)) == [emit("container_exited")]  # workers still serve
    assert story(exited("w1", T0 + 2)) == [emit("container_exited")]
    assert story(Tick(G)) == [match(CutWorkers), SignalContainers(SIGKILL), Observe()]
    assert story(exited("w2", G + 0.1, code=137)) == [emit("container_exited")]
    assert story(Observed(G + 0.2)) == [emit("verified_empty"), emit("drained")]


def test_the_sigterm_round_of_a_notice_skips_inference_workers_and_rentals() -> None:
    assert SignalContainers(SIGTERM).skip_kinds == frozenset({"inference", "rental"})
    assert SignalContainers(SIGKILL).skip_kinds == frozenset()


def test_a_rental_runs_until_the_grace_deadline_and_is_killed_there(story: Story) -> None:
    """A batch job and a rental are on the node when the notice lands. The SIGTERM round after
    the taint passes the rental by: its renter has the machine until reclaim_at = G, which the
    deadline file names. Looks that see it running do not take it for a stray. At G the SIGKILL
    round, which skips no kind, takes it; its exit lets the node verify empty."""
    tainted_with(story, "batch")
    [sigterm] = [c for _, c in story.log if isinstance(c, SignalContainers)]
    assert "rental" in sigterm.skip_kinds
    assert story(Observed(T0 + 0.1, running=("batch", "rental"), rentals=("rental",))) == []
    assert story(exited("batch", T0 + 1)) == [emit("container_exited"), Observe()]
    assert story(Observed(T0 + 1.1, running=("rental",), rentals=("rental",))) == []
    assert story(Tick(T0 + 1.6)) == [Observe()]
    assert story(Observed(T0 + 1.7, running=("rental",), rentals=("rental",))) == []
    commands = story(Tick(G))
    assert commands == [match(CutWorkers), SignalContainers(SIGKILL), Observe()]
    assert commands[1].skip_kinds == frozenset()
    assert story(signalled("rental", G + 0.01, SIGKILL)) == [
        emit("sigkill_sent", container="rental"),
        WatchExits(("rental",)),
    ]
    story(SignalRoundDone(G + 0.02, SIGKILL))
    assert story(exited("rental", G + 0.1, code=137)) == [
        emit("container_exited", container="rental", exit_code=137)
    ]
    story(Observed(G + 0.2))
    assert story.kinds[-2:] == ["verified_empty", "drained"]


def test_a_rental_the_sigterm_round_did_not_see_is_still_no_stray_before_g(story: Story) -> None:
    """Without the rentals marked, a running rental would be a stray owed a SIGTERM."""
    tainted_with(story)
    assert story(Observed(T0 + 0.1, running=("rental",), rentals=("rental",))) == []
    assert story(Tick(T0 + 0.6)) == [Observe()]
    assert story(Observed(T0 + 0.7, running=("rental", "by-hand"), rentals=("rental",))) == [
        SignalContainers(SIGTERM, skip=frozenset({"rental"}))
    ]


def test_an_owner_resume_before_g_leaves_the_rental_running() -> None:
    """The owner pauses while a rental runs, then resumes before G: the pause ends, and the
    SIGKILL round that would have ended the rental at G never comes."""
    story = Story()
    story.begin(notice(terminate_at=T0 + 120), reason="pause")
    story(TaintAnswered(T0 + 0.05))
    story(SignalRoundDone(T0 + 0.07, SIGTERM))
    story(Observed(T0 + 0.1, running=("rental",), rentals=("rental",)))
    assert story(Resumed(T0 + 30)) == [emit("pause_resumed"), LiftTaints(story.rec.reclaim_id)]
    assert story.rec.next_wakeup() is None
    assert story(Tick(T0 + 110)) == []  # G of the pause
    assert not any(isinstance(c, SignalContainers) and c.signal == SIGKILL for _, c in story.log)
    story.check()


def test_a_resume_mid_drain_ends_the_pause_and_lifts_its_taints() -> None:
    """The owner pauses, then changes their mind while the node drains: the pause ends, its
    taints are lifted, and nothing more is signalled or verified."""
    story = Story()
    story.begin(notice(terminate_at=T0 + 120), reason="pause")
    story(TaintAnswered(T0 + 0.05))
    story(signalled("c1", T0 + 0.06))
    story(SignalRoundDone(T0 + 0.07, SIGTERM))
    commands = story(Resumed(T0 + 5))
    assert commands == [emit("pause_resumed"), LiftTaints(story.rec.reclaim_id)]
    assert story.rec.outcome == "resumed" and not story.rec.finished
    assert story(TaintsLifted(T0 + 6)) == [] and story.rec.finished
    assert story(Tick(T0 + 110)) == [] and story(Observed(T0 + 111, running=("c1",))) == []


def test_resumed_means_nothing_to_a_provider_notice(story: Story) -> None:
    tainted_with(story, "c1")
    assert story(Resumed(T0 + 1)) == []


# --- SIGTERM at most once, across agent restarts (write before act) -----------------------------


def job(c: str, kind: str = "batch") -> RoundTarget:
    return RoundTarget(c, f"job-{c}", kind, f"registry.local/{c}:1")


def listed(now: float, *containers: str, signal: str = SIGTERM) -> RoundListed:
    return RoundListed(now, signal, tuple(job(c) for c in containers))


def test_a_round_announces_its_targets_in_the_bundle_before_anything_is_sent() -> None:
    """The SIGTERM round has listed two jobs. The machine records them as announced and only
    then answers with exactly those two to deliver: the shell saves the bundle in between, so
    the announcement is on disk before the first SIGTERM leaves."""
    story = Story(strict=True)
    story.begin()
    assert story(TaintAnswered(T0 + 0.05))[-1] == SignalContainers(SIGTERM)
    assert story(listed(T0 + 0.06, "c1", "c2")) == [DeliverSignals(SIGTERM, ("c1", "c2"))]
    bundle = json.loads(json.dumps(story.rec.to_json()))
    assert {c: e["signal"] for c, e in bundle["announced"].items()} == {
        "c1": SIGTERM,
        "c2": SIGTERM,
    }
    assert ledger(story.rec, "c1") == TERM_ANNOUNCED
    assert story(signalled("c1", T0 + 0.07)) == [
        emit("sigterm_sent", container="c1", via="api"),
        WatchExits(("c1",)),
    ]
    assert ledger(story.rec, "c1") == TERM_SENT and "c1" not in story.rec.announced
    story.check()


def test_a_listing_made_during_the_taint_is_announced_in_the_taints_own_step() -> None:
    """The shell listed the node while the Taint call was in flight and hands that listing in
    with the answer: the first SIGTERM round is announced in the answer's step (the bundle it
    saves holds the announcement before anything is sent) and names exactly what it may
    signal. Inference workers (they drain at their gates) and rentals (kept until G) are
    listed but never announced for SIGTERM."""
    story = Story(strict=True)
    story.begin()
    answer = TaintAnswered(
        T0 + 0.05, listed=(job("c1"), job("w1", "inference"), job("r1", "rental"), job("c2"))
    )
    commands = story(answer)
    assert commands[-1] == SignalContainers(SIGTERM, announced=("c1", "c2"))
    bundle = json.loads(json.dumps(story.rec.to_json()))
    assert sorted(bundle["announced"]) == ["c1", "c2"]
    assert ledger(story.rec, "w1") is None and ledger(story.rec, "r1") is None
    assert story(signalled("c1", T0 + 0.06))[0] == emit("sigterm_sent", container="c1")
    # Killed now: the restarted agent counts c2 as signalled by the previous run, once.
    assert story.restart(T0 + 1)[0] == emit("sigterm_sent", container="c2", by=BY_PREVIOUS_RUN)
    story.check()


def test_a_local_taint_announces_the_listing_made_ahead_too() -> None:
    """The coordinator never answered: the local fallback's step announces the listing the
    shell made meanwhile, like an answer's would."""
    story = Story(strict=True)
    story.begin()
    commands = story(TaintUnanswered(T0 + 0.8, "deadline", listed=(job("c1"),)))
    assert commands[-1] == SignalContainers(SIGTERM, announced=("c1",))
    assert story.kinds.index("ApplyLocalTaint") < story.kinds.index("SignalContainers(SIGTERM)")
    assert ledger(story.rec, "c1") == TERM_ANNOUNCED
    story.check()


def test_the_tick_past_the_taint_deadline_announces_the_listing_made_ahead() -> None:
    """The coordinator is frozen: the tick at the 800 ms deadline falls back to the local
    taint and announces the listing the shell made meanwhile, in that same step."""
    story = Story(strict=True)
    story.begin()
    commands = story(Tick(T0 + 0.8, listed=(job("c1"), job("w1", "inference"))))
    assert commands[-1] == SignalContainers(SIGTERM, announced=("c1",))
    assert story.rec.taint_mode == "local" and ledger(story.rec, "c1") == TERM_ANNOUNCED
    story.check()


def test_a_restart_sends_the_announced_sigterms_the_engine_never_received() -> None:
    """The agent is SIGKILLed between the step that announced its first SIGTERMs and the kill
    calls. Restarted, it asks the engine which of them it was asked to send: c1 was, c2 never.
    c1 counts as signalled by the previous run and is never signalled again; c2 is withdrawn
    and, still running, gets its one SIGTERM at the first look, as a job that never had one
    (killed at G without it, a job that would have honoured it overruns)."""
    story = Story(strict=True)
    story.begin()
    story(TaintAnswered(T0 + 0.05, listed=(job("c1"), job("c2"))))
    assert ledger(story.rec, "c2") == TERM_ANNOUNCED

    resumed = story.restart(T0 + 1, delivered={"c1"})
    assert [c.details["container"] for c in resumed if isinstance(c, Emit)] == ["c1"]
    assert ledger(story.rec, "c1") == TERM_BY_PREVIOUS_RUN
    assert ledger(story.rec, "c2") is None
    assert story(Observed(T0 + 1.1, running=("c1", "c2"))) == [
        SignalContainers(SIGTERM, frozenset({"c1"}))
    ]
    assert story(listed(T0 + 1.2, "c2")) == [DeliverSignals(SIGTERM, ("c2",))]
    story.check()


def test_a_round_that_ends_without_sending_withdraws_its_announcement() -> None:
    """A cancel reaches the shell between the step that announced the first SIGTERM round and
    the round itself, which then sends nothing: its end withdraws the announcement, so the
    ledger does not claim a SIGTERM that never left (a later notice for the same machine may
    send it)."""
    story = Story(strict=True)
    story.begin()
    story(TaintAnswered(T0 + 0.05, listed=(job("c1"), job("c2"))))
    assert ledger(story.rec, "c1") == TERM_ANNOUNCED
    story(Cancelled(T0 + 0.06))
    story(SignalRoundDone(T0 + 0.07, SIGTERM))
    assert ledger(story.rec, "c1") is None and ledger(story.rec, "c2") is None
    assert story.rec.announced == {}
    story.check()


def test_a_listing_handed_in_with_a_late_answer_announces_nothing() -> None:
    """The background retry's answer lands after the local fallback drained the node: the
    round is long done, and a listing handed in with it announces nothing."""
    story = Story(strict=True)
    story.begin()
    story(TaintUnanswered(T0 + 0.8, "deadline"))
    assert story(TaintAnswered(T0 + 3, listed=(job("c9"),))) == [
        emit("tainted", mode="remote", after_local=True)
    ]
    assert ledger(story.rec, "c9") is None
    story.check()


def test_an_agent_killed_right_after_its_first_sigterms_never_sends_a_second() -> None:
    """The agent sends SIGTERM to two jobs and is SIGKILLed before the engine's answers come
    back: the bundle says only that both were announced. The restarted agent counts both as
    signalled by the previous run, reports them so (with the image and kind the round listed),
    watches their exits, and a look that still sees them running sends nothing: many runtimes
    take a second SIGTERM as "exit now, skip the cleanup". SIGKILL at G still comes."""
    story = Story(strict=True)
    story.begin()
    story(TaintAnswered(T0 + 0.05))
    story(listed(T0 + 0.06, "c1", "c2"))

    assert story.restart(T0 + 2) == [
        emit(
            "sigterm_sent",
            container="c1",
            name="job-c1",
            by=BY_PREVIOUS_RUN,
            announced_at=T0 + 0.06,
            image="registry.local/c1:1",
        ),
        emit("sigterm_sent", container="c2", by=BY_PREVIOUS_RUN),
        match(WriteDeadlineFile, terminate_at=D, grace_deadline=G),
        match(DrainWorkers, grace_deadline=G),
        WatchExits(("c1", "c2")),
        Observe(),
    ]
    first = story.log[-6][1]
    # the contract of its image counts it (coordinator/core/timeline.py)
    assert first.details["kind"] == "batch"
    assert "via" not in first.details  # nobody knows which route it took
    assert ledger(story.rec, "c1") == TERM_BY_PREVIOUS_RUN
    assert story(Observed(T0 + 2.1, running=("c1", "c2"))) == []  # no stray: both had theirs
    assert story(listed(T0 + 2.2, "c1", "c2")) == [DeliverSignals(SIGTERM, ())]
    assert story(exited("c1", T0 + 3)) == [emit("container_exited", exit_code=0)]
    assert story(Tick(G)) == [match(CutWorkers), SignalContainers(SIGKILL), Observe()]
    assert story(listed(G + 0.01, "c2", signal=SIGKILL)) == [DeliverSignals(SIGKILL, ("c2",))]
    assert story(signalled("c2", G + 0.02, SIGKILL)) == [emit("sigkill_sent", container="c2")]
    assert ledger(story.rec, "c2") == KILL_SENT
    assert story.kinds.count("sigterm_sent") == 2
    story.check()


def test_a_restart_twice_over_reports_the_previous_runs_sigterms_once() -> None:
    """The agent crash-loops: the second restart finds the SIGTERMs already counted and says
    nothing more about them."""
    story = Story(strict=True)
    story.begin()
    story(TaintAnswered(T0 + 0.05))
    story(listed(T0 + 0.06, "c1"))
    story.restart(T0 + 2)
    assert story.restart(T0 + 4) == [
        match(WriteDeadlineFile),
        match(DrainWorkers),
        WatchExits(("c1",)),
        Observe(),
    ]
    assert story.kinds.count("sigterm_sent") == 1


def test_a_sigkill_announced_when_the_agent_died_is_sent_again() -> None:
    """The agent dies in the SIGKILL round at G. A second SIGKILL is harmless, and the job may
    not have had the first: the restarted agent kills what still runs. The first may have been
    delivered, too (the job exits 137): it is reported as the previous run's."""
    story = Story(strict=True)
    story.begin()
    story(TaintAnswered(T0 + 0.05))
    story(listed(T0 + 0.06, "c1"))
    story(signalled("c1", T0 + 0.07))
    story(SignalRoundDone(T0 + 0.08, SIGTERM))
    story(Tick(G))
    assert story(listed(G + 0.01, "c1", signal=SIGKILL)) == [DeliverSignals(SIGKILL, ("c1",))]
    assert ledger(story.rec, "c1") == KILL_ANNOUNCED
    commands = story.restart(G + 1)
    assert [c.details for c in commands if isinstance(c, Emit) and c.kind == "sigkill_sent"] == [
        {"container": "c1", "name": "job-c1", "by": "previous run", "announced_at": G + 0.01}
    ]
    assert ledger(story.rec, "c1") == TERM_SENT  # withdrawn: it may be sent again
    assert story(Observed(G + 1.1, running=("c1",))) == [
        SignalContainers(SIGKILL, skip=frozenset())
    ]
    assert story(listed(G + 1.2, "c1", signal=SIGKILL)) == [DeliverSignals(SIGKILL, ("c1",))]


def test_a_later_round_leaves_out_every_container_that_had_its_sigterm() -> None:
    """A stray round lists a job already signalled, one the previous run announced, and one
    started by hand: only the new one is announced and delivered."""
    story = Story(strict=True)
    story.begin()
    story(TaintAnswered(T0 + 0.05))
    story(listed(T0 + 0.06, "c1", "c2"))
    story(signalled("c1", T0 + 0.07))
    story.restart(T0 + 1)  # c2: announced, never answered
    assert story(Observed(T0 + 1.1, running=("c1", "c2", "c9"))) == [
        SignalContainers(SIGTERM, skip=frozenset({"c1", "c2"}))
    ]
    assert story(listed(T0 + 1.2, "c1", "c2", "c9")) == [DeliverSignals(SIGTERM, ("c9",))]


def test_a_round_listed_after_the_owner_resumed_delivers_nothing() -> None:
    """The owner resumes while the SIGTERM round is still listing: the machine is theirs again,
    and the round sends nothing."""
    story = Story(strict=True)
    story.begin(notice(terminate_at=T0 + 120), reason="pause")
    story(TaintAnswered(T0 + 0.05))
    story(Resumed(T0 + 0.06))
    assert story(listed(T0 + 0.07, "c1")) == [DeliverSignals(SIGTERM, ())]
    assert story.rec.announced == {}


def test_a_delivery_nobody_announced_is_refused() -> None:
    """The shell may only signal what the machine announced: anything else is a bug, and says
    which container and which move."""
    story = Story(strict=True)
    story.begin()
    story(TaintAnswered(T0 + 0.05))
    with pytest.raises(InvalidTransition, match="c1: None -> SIGTERM"):
        story.rec.handle(signalled("c1", T0 + 0.06))


@pytest.mark.parametrize(
    "start", [None, TERM_ANNOUNCED, TERM_SENT, TERM_BY_PREVIOUS_RUN, KILL_ANNOUNCED, KILL_SENT]
)
@pytest.mark.parametrize(
    "finish", [None, TERM_ANNOUNCED, TERM_SENT, TERM_BY_PREVIOUS_RUN, KILL_ANNOUNCED, KILL_SENT]
)
def test_the_signal_ledger_moves_only_along_its_table(start, finish) -> None:
    """Every move of a container's ledger entry is in LEDGER_TRANSITIONS or refused; a SIGTERM
    never follows a SIGTERM, announced or sent, by this process or the one before."""
    rec, _ = Reclamation.begin(notice(), NODE, T0, MARGINS)
    rec.phase, rec.sigterm_round, rec.rounds_in_flight = "draining", True, 1
    path = {
        None: [],
        TERM_ANNOUNCED: [TERM_ANNOUNCED],
        TERM_SENT: [TERM_ANNOUNCED, TERM_SENT],
        TERM_BY_PREVIOUS_RUN: [TERM_ANNOUNCED, TERM_BY_PREVIOUS_RUN],
        KILL_ANNOUNCED: [KILL_ANNOUNCED],
        KILL_SENT: [KILL_ANNOUNCED, KILL_SENT],
    }[start]
    for step in path:
        ledger_move(rec, "c1", step, job("c1"), T0 + 1)
    assert ledger(rec, "c1") == start
    if (start, finish) in LEDGER_TRANSITIONS:
        ledger_move(rec, "c1", finish, job("c1"), T0 + 2)
        assert ledger(rec, "c1") == finish
    else:
        with pytest.raises(InvalidTransition):
            ledger_move(rec, "c1", finish, job("c1"), T0 + 2)
    assert (TERM_SENT, TERM_ANNOUNCED) not in LEDGER_TRANSITIONS
    assert (TERM_BY_PREVIOUS_RUN, TERM_ANNOUNCED) not in LEDGER_TRANSITIONS


def test_validate_names_what_a_broken_bundle_breaks() -> None:
    """validate() is the machine's own check of its invariants; a state no transition makes
    (an announcement without a round, a SIGTERM before the taint) is named."""
    rec, _ = Reclamation.begin(notice(), NODE, T0, MARGINS)
    rec.validate()
    rec.announced["c1"] = {
        "signal": SIGTERM,
        "name": "job-c1",
        "kind": "",
        "image": "",
        "at": T0,
        "before": None,
    }
    with pytest.raises(InvalidState, match="invariant 1") as e:
        rec.validate()
    assert "announced without a round in flight" in str(e.value)
