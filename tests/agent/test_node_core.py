"""The node's rules over all its reclamations (agent/core/node.py), told as stories on a fake
clock: events and the time in, commands out, and the node's invariants checked after every step.

Short margins as in tests/test_reclamation.py: a notice at T0 = 1000 with D = T0 + 30 has its
grace deadline G = D - 10 and its overrun check O = D - 2. The last two stories run the drain
runner over in-memory adapters (tests/test_full_disk.py's) to show what the core changes there:
a start reads no disk, and finished bundles are deleted.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from test_full_disk import NODE as RUNNER_NODE
from test_full_disk import Gpus, Link, Workers
from test_one_machine_two_notices import one_machine

from fakes.waiting import eventually
from spotdrain.agent.core.node import Node, Retention
from spotdrain.agent.core.notice import Notice, NoticeInvalid
from spotdrain.agent.core.reclamation import Margins, Reclamation, reclaim_id_for
from spotdrain.agent.core.reclamation_commands import (
    SIGTERM,
    DeliverSignals,
    Emit,
    ForgetBundles,
    LiftTaints,
    NodeCommand,
    Record,
    ReleaseEvents,
    RemoveDeadlineFile,
    ResumeCoordinator,
    Settled,
    SignalContainers,
    Stepped,
    StopResumingCoordinator,
    WriteDeadlineFile,
)
from spotdrain.agent.core.reclamation_events import (
    ContainerExited,
    ContainerSignalled,
    DeadlinesDue,
    ForReclamation,
    NodeEvent,
    NoticeArrived,
    Observed,
    PauseAsked,
    ReportInvalid,
    ReportLanded,
    Restarted,
    ResumeAsked,
    RoundListed,
    RoundTarget,
    SignalRoundDone,
    TaintAnswered,
    TaintsLifted,
)
from spotdrain.agent.drain.runner import DrainRunner
from spotdrain.agent.drain.state import BundleStore
from spotdrain.protocol.machine import InvalidState

NODE = "node-1"
T0 = 1000.0
MARGINS = Margins(
    default_notice_s=30, grace_s=10, overrun_s=2, taint_answer_s=0.8, observe_every_s=0.5
)
JOB = RoundTarget("c-job", "job-1", "job", "trainer:1")
DAY = 24 * 3600.0


def notice(key: str, terminate_at: float | None, action: str = "terminate") -> Notice:
    return Notice(key=key, notice_id=key, action=action, terminate_at=terminate_at, source="gcp")


def rid(key: str) -> str:
    return reclaim_id_for(NODE, key)


class Story:
    """A node, and every command it gave, step by step; its invariants hold after each one."""

    def __init__(
        self,
        retention: Retention | None = None,
        pause_notice_s: float = 60,
        bundles: tuple[Reclamation, ...] = (),
        node_id: str = NODE,
    ) -> None:
        self.node = Node(node_id, MARGINS, pause_notice_s, retention or Retention(), bundles)

    def __call__(self, event: NodeEvent, now: float) -> list[NodeCommand]:
        commands = self.node.handle(event, now)
        self.node.validate()
        return commands

    def rid(self, key: str) -> str:
        return reclaim_id_for(self.node.node_id, key)

    def to(self, key: str, event: Any) -> list[NodeCommand]:
        return self(ForReclamation(self.rid(key), event), event.now)

    def drained(self, key: str, now: float, terminate_at: float | None = None) -> list[NodeCommand]:
        """A notice that finds the node empty: tainted, nothing to signal, verified empty. The
        commands of its last step."""
        self(NoticeArrived(notice(key, terminate_at)), now)
        self.to(key, TaintAnswered(now + 0.1, listed=()))
        self.to(key, SignalRoundDone(now + 0.2, SIGTERM))
        last = self.to(key, Observed(now + 0.3))
        assert self.node.finished[self.rid(key)].verified_at == now + 0.3
        return last


def file_of(rec: Reclamation) -> WriteDeadlineFile:
    return WriteDeadlineFile(rec.reclaim_id, rec.terminate_at, rec.grace_deadline, rec.reason)


def stepped(commands: list[NodeCommand], key: str) -> tuple[Any, ...]:
    return next(c.commands for c in commands if isinstance(c, Stepped) and c.reclaim_id == rid(key))


def test_two_notices_for_one_machine_show_the_earliest_deadline_and_sigterm_the_job_once() -> None:
    """GCP's `preempted` (D = T0 + 30) and the host's shutdown (D = T0 + 40, heard a second
    later) are one machine going away. The job gets one SIGTERM, from the first; the deadline
    file keeps the first's G when the second asks for its later one; a third notice with an
    earlier D takes the file; and once that one is withdrawn the file names the first again."""
    story = Story()
    first = story(NoticeArrived(notice("gcp", T0 + 30)), T0)
    assert [type(c) for c in first] == [Stepped]
    answered = story.to("gcp", TaintAnswered(T0 + 0.1, listed=(JOB,)))
    gcp = story.node.live[rid("gcp")]
    assert answered[0] == file_of(gcp)
    assert SignalContainers(SIGTERM, announced=("c-job",)) in stepped(answered, "gcp")
    story.to("gcp", ContainerSignalled(T0 + 0.2, "c-job", "job-1", SIGTERM, "api"))

    story(NoticeArrived(notice("shutdown", T0 + 40)), T0 + 1)
    second = story.to("shutdown", TaintAnswered(T0 + 1.1, listed=(JOB,)))
    assert second[0] == file_of(gcp)  # a later G never moves the file
    assert SignalContainers(SIGTERM, announced=()) in stepped(second, "shutdown")
    # A stray round of the second lists the job again: nothing to send.
    stray = story.to("shutdown", RoundListed(T0 + 1.2, SIGTERM, (JOB,)))
    assert stepped(stray, "shutdown") == (DeliverSignals(SIGTERM, ()),)
    assert story.node.sigtermed_elsewhere(rid("shutdown")) == {"c-job"}

    story(NoticeArrived(notice("azure", T0 + 20)), T0 + 2)
    earlier = story.to("azure", TaintAnswered(T0 + 2.1, listed=(JOB,)))
    azure = story.node.live[rid("azure")]
    assert earlier[0] == file_of(azure)
    story.to("azure", SignalRoundDone(T0 + 2.2, SIGTERM))
    withdrawn = story(NoticeArrived(notice("azure", None, "cancel")), T0 + 3)
    assert withdrawn == [
        file_of(gcp),  # the earliest still in force
        Stepped(
            rid("azure"),
            (
                Emit("notice_cancelled", {"lifted": True}, at=T0 + 3),
                LiftTaints(rid("azure")),
            ),
        ),
        ReleaseEvents(rid("azure")),
        Settled(rid("azure"), "cancelled"),
    ]


def test_the_last_drain_lifted_removes_the_deadline_file() -> None:
    story = Story()
    story(NoticeArrived(notice("gcp", T0 + 30)), T0)
    story.to("gcp", TaintAnswered(T0 + 0.1, listed=()))
    story.to("gcp", SignalRoundDone(T0 + 0.2, SIGTERM))
    lifted = story(NoticeArrived(notice("gcp", None, "cancel")), T0 + 1)
    assert lifted[0] == RemoveDeadlineFile()


def test_a_notice_heard_again_is_the_same_reclamation_even_once_finished() -> None:
    """AWS's mock re-stamps its document on every read: the same notice is one reclamation, and
    after it has finished it opens no second one."""
    story = Story()
    story.drained("aws", T0, T0 + 30)
    again = story(NoticeArrived(notice("aws", T0 + 30)), T0 + 5)
    # The machine heard it (the same document: no change), and its outcome stands.
    assert again == [
        Stepped(rid("aws")),
        ReleaseEvents(rid("aws")),
        Settled(rid("aws"), "drained"),
    ]
    assert list(story.node.live) == [] and list(story.node.finished) == [rid("aws")]


def test_a_cancel_of_a_notice_never_had_is_recorded_and_changes_nothing() -> None:
    story = Story()
    assert story(NoticeArrived(notice("never", None, "cancel")), T0) == [
        Record("notice_cancelled", details={"notice_id": "never", "lifted": False, "known": False})
    ]
    assert story.node.live == {} and story.node.refuse_start() is None
    invalid = NoticeInvalid(reason="no time", content_hash="abc")
    assert story(NoticeArrived(invalid), T0) == [
        Record("notice_invalid", details={"reason": "no time", "content_hash": "abc"})
    ]


def test_a_report_goes_to_the_reclamation_that_signalled_its_container() -> None:
    """Two drains in force: the job's checkpoint report belongs to the one that SIGTERMed it,
    although the other began later; a report from a container neither knows goes to the newest
    one still draining; an invalid report is recorded under its owner."""
    story = Story()
    story(NoticeArrived(notice("gcp", T0 + 30)), T0)
    story.to("gcp", TaintAnswered(T0 + 0.1, listed=(JOB,)))
    story.to("gcp", ContainerSignalled(T0 + 0.2, "c-job", "job-1", SIGTERM, "api"))
    story(NoticeArrived(notice("shutdown", T0 + 40)), T0 + 1)
    report = ReportLanded("job-1", "checkpoint_committed", 3, 1024, T0 + 1.5)
    routed = story(report, T0 + 2)
    assert [c.reclaim_id for c in routed if isinstance(c, Stepped)] == [rid("gcp")]
    assert stepped(routed, "gcp")[0].kind == "checkpoint_committed"
    stranger = story(ReportLanded("other", "checkpoint_started", 1, None, T0 + 2), T0 + 2)
    assert [c.reclaim_id for c in stranger if isinstance(c, Stepped)] == [rid("shutdown")]
    assert story(ReportInvalid("job-1", "x.json", "not JSON"), T0 + 3) == [
        Record(
            "workload_report_invalid",
            rid("gcp"),
            3.0,
            {"name": "job-1", "file": "x.json", "reason": "not JSON"},
        )
    ]


def test_no_report_outside_a_reclamation_and_late_exits_reach_a_finished_one() -> None:
    story = Story()
    assert story(ReportLanded("job-1", "checkpoint_started", 1, None, T0), T0) == []
    story.drained("gcp", T0, T0 + 30)
    late = story.to("gcp", ContainerExited(T0 + 1, "c-rental", "rental-1", 137))
    assert stepped(late, "gcp")[0].kind == "container_exited"
    # Any other event for a finished reclamation goes nowhere.
    assert story.to("gcp", SignalRoundDone(T0 + 2, SIGTERM)) == []


def test_a_pause_refuses_starts_until_resumed_and_a_second_pause_changes_nothing() -> None:
    """The owner pauses: the node refuses starts while it drains and once drained (the pause
    stays in force, finished or not); pausing again keeps the same deadlines; resume lifts it."""
    story = Story(pause_notice_s=60)
    assert story(PauseAsked(), T0)[0] == StopResumingCoordinator()
    pause = story.node.current_pause()
    assert pause is not None and pause.terminate_at == T0 + 60
    assert story.node.refuse_start() == "node is draining"
    assert story(PauseAsked(), T0 + 5) == []
    assert story.node.current_pause() is pause
    key = pause.notice_key
    story(ForReclamation(rid(key), TaintAnswered(T0 + 0.1, listed=())), T0 + 0.1)
    story(ForReclamation(rid(key), SignalRoundDone(T0 + 0.2, SIGTERM)), T0 + 0.2)
    story(ForReclamation(rid(key), Observed(T0 + 0.3)), T0 + 0.3)
    assert pause.reclaim_id in story.node.finished
    assert story.node.refuse_start() == "node is paused by its owner"
    resumed = story(ResumeAsked(), T0 + 10)
    assert LiftTaints(pause.reclaim_id) in stepped(resumed, key)
    assert story.node.current_pause() is None and story.node.refuse_start() is None
    story(ForReclamation(rid(key), TaintsLifted(T0 + 10.1)), T0 + 10.1)
    assert story(ResumeAsked(), T0 + 11) == [ResumeCoordinator()]


def test_a_taint_deadline_passing_with_the_listing_back_sigterms_the_job_once() -> None:
    """Two notices for one machine, the coordinator silent for both: at the taint deadline the
    node ticks each live reclamation with the listing made during its call. The first
    announces the job; the second, tainted locally too, leaves it alone."""
    story = Story()
    story(NoticeArrived(notice("gcp", T0 + 30)), T0)
    story(NoticeArrived(notice("shutdown", T0 + 40)), T0)
    listed = {rid("gcp"): (JOB,), rid("shutdown"): (JOB,)}
    due = story(DeadlinesDue(listed), T0 + 0.8)
    assert SignalContainers(SIGTERM, announced=("c-job",)) in stepped(due, "gcp")
    assert SignalContainers(SIGTERM, announced=()) in stepped(due, "shutdown")
    assert story.node.live[rid("shutdown")].taint_mode == "local"


def test_finished_bundles_are_forgotten_past_the_newest_kept_and_their_age() -> None:
    """Four reclamations finish, each a day apart. With the two newest kept and a day's age,
    each finish forgets what fell out of both; the owner's pause in force is never forgotten."""
    story = Story(Retention(kept=2, kept_s=DAY))
    story(PauseAsked(), T0)
    pause = story.node.current_pause()
    assert pause is not None
    story(ForReclamation(pause.reclaim_id, TaintAnswered(T0 + 0.1, listed=())), T0 + 0.1)
    story(ForReclamation(pause.reclaim_id, SignalRoundDone(T0 + 0.2, SIGTERM)), T0 + 0.2)
    story(ForReclamation(pause.reclaim_id, Observed(T0 + 0.3)), T0 + 0.3)
    forgotten = []
    for day in (1, 2, 3, 4):
        last = story.drained(f"n{day}", T0 + day * DAY, T0 + day * DAY + 30)
        forgotten.append([c for c in last if isinstance(c, ForgetBundles)])
    assert forgotten == [[], [], [ForgetBundles((rid("n1"),))], [ForgetBundles((rid("n2"),))]]
    assert set(story.node.finished) == {pause.reclaim_id, rid("n3"), rid("n4")}
    assert story.node.current_pause() is pause


def test_a_node_made_from_its_bundles_forgets_the_old_finished_ones_as_it_restarts() -> None:
    """The agent starts with two bundles: one finished two days ago, one still tainting. The
    node holds both at once (a start asked before the restart is refused); the restart forgets
    the finished one and carries on with the other (its Taint asked again)."""
    old = Story()
    old.drained("done", T0, T0 + 30)
    old(NoticeArrived(notice("open", T0 + 3 * DAY)), T0 + 100)
    bundles = (*old.node.finished.values(), *old.node.live.values())
    story = Story(Retention(kept=0, kept_s=DAY), bundles=bundles)
    assert story.node.refuse_start() == "node is draining"
    restarted = story(Restarted(), T0 + 2 * DAY)
    assert restarted[0] == ForgetBundles((rid("done"),))
    assert [type(c) for c in stepped(restarted, "open")][0].__name__ == "RequestTaint"
    assert list(story.node.live) == [rid("open")] and story.node.finished == {}


def test_validate_names_a_container_sigtermed_by_two_reclamations() -> None:
    story = Story()
    for key in ("a", "b"):
        story(NoticeArrived(notice(key, T0 + 30)), T0)
        story.to(key, TaintAnswered(T0 + 0.1))
    for key in ("a", "b"):  # the node's own routing would never allow this: force it
        story.node.live[rid(key)].handle(RoundListed(T0 + 0.2, SIGTERM, (JOB,)))
    with pytest.raises(InvalidState, match="SIGTERMed by two reclamations"):
        story.node.validate()


# --- the drain runner over the core ---------------------------------------------------------


class CountingBundles(BundleStore):
    """A real bundle store that counts its reads of the disk."""

    reads = 0

    def load_all(self, with_events: bool = False) -> list[Reclamation]:
        self.reads += 1
        return super().load_all(with_events)

    def load(self, reclaim_id: str) -> Reclamation | None:
        self.reads += 1
        return super().load(reclaim_id)

    def exists(self, reclaim_id: str) -> bool:
        self.reads += 1
        return super().exists(reclaim_id)


async def test_a_paused_node_refuses_starts_without_reading_its_bundles(tmp_path: Path) -> None:
    """The bundles are read once, when the runner is made; the owner's pause, every start asked
    while it is in force and `spotctl status` answer from memory, even with the bundle directory
    gone."""
    cfg, outbox, engine, _ = one_machine(tmp_path)
    bundles = CountingBundles(cfg.state_dir)
    drains = DrainRunner(cfg, outbox, Link(), engine, Gpus(), Workers(), bundles=bundles)  # type: ignore[arg-type]
    read_at_start = bundles.reads
    assert read_at_start <= 1
    try:
        pause = drains.pause()
        bundles.dir = tmp_path / "gone"  # a read now would find nothing
        for _ in range(100):
            assert drains.refuse_start() == "node is draining"
            assert drains.current_pause() is pause
        assert drains.pause() is pause
        assert bundles.reads == read_at_start
    finally:
        await drains.close()
        outbox.close()


async def test_finished_bundles_beyond_the_retention_are_deleted_at_start(tmp_path: Path) -> None:
    """Three finished reclamations' bundles on disk, a week old, and a pause still in force: a
    restarted agent keeping one finished bundle deletes the two older ones and keeps the pause;
    the notice of the one kept, read again, opens nothing new."""
    week_ago = time.time() - 7 * DAY
    old = Story(node_id=RUNNER_NODE)
    for day in (0, 1, 2):
        old.drained(f"n{day}", week_ago + day * 60, week_ago + day * 60 + 30)
    old(PauseAsked(), week_ago + 300)
    pause = old.node.current_pause()
    assert pause is not None
    pause_id = pause.reclaim_id
    old(ForReclamation(pause_id, TaintAnswered(week_ago + 300.1, listed=())), week_ago + 300.1)
    old(ForReclamation(pause_id, SignalRoundDone(week_ago + 300.2, SIGTERM)), week_ago + 300.2)
    old(ForReclamation(pause_id, Observed(week_ago + 300.3)), week_ago + 300.3)
    cfg, outbox, engine, _ = one_machine(tmp_path)
    store = BundleStore(cfg.state_dir)
    for rec in old.node.finished.values():
        store.save(rec)
    drains = DrainRunner(
        cfg,
        outbox,
        Link(),  # type: ignore[arg-type]
        engine,
        Gpus(),  # type: ignore[arg-type]
        Workers(),  # type: ignore[arg-type]
        bundles=BundleStore(cfg.state_dir),
        retention=Retention(kept=1, kept_s=DAY),
    )
    loop = asyncio.create_task(drains.run())
    try:
        await eventually(lambda: len(drains.recent) == 2, "the restart's forgetting")
        left = sorted(p.stem for p in store.dir.glob("rcl-*.json"))
        assert left == sorted([reclaim_id_for(RUNNER_NODE, "n2"), pause_id])
        assert drains.refuse_start() == "node is paused by its owner"
        drains.notice(notice("n2", week_ago + 120 + 30))
        await eventually(lambda: drains._queue.empty(), "the notice handled")
        assert (
            sorted(drains.recent) == sorted([reclaim_id_for(RUNNER_NODE, "n2"), pause_id])
            and not drains.live
        )
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await drains.close()
        outbox.close()


def test_a_stop_past_g_is_attributed_to_a_drain_of_this_run_only() -> None:
    """A rental stopped after G was stopped by that drain, live or finished while this agent
    ran; a reclamation loaded finished from an earlier run says nothing of a stop today."""
    story = Story()
    story.drained("gcp", T0, T0 + 30)
    gcp = story.node.finished[rid("gcp")]
    assert story.node.past_grace(T0 + 19) is None
    assert story.node.past_grace(T0 + 21) is gcp
    restarted = Story(bundles=(gcp,))
    assert restarted.node.past_grace(T0 + 21) is None


def test_a_notice_finished_past_its_retention_is_kept_until_its_step_is_carried_out() -> None:
    """A stale notice (D a week past) is answered at once and finishes; with nothing kept, its own
    step does not forget it (its commands are still to run); the next finish does."""
    story = Story(Retention(kept=0, kept_s=0))
    now = T0 + 7 * DAY
    last = story.drained("stale", now, T0 + 30)
    assert not [c for c in last if isinstance(c, ForgetBundles)]
    later = story.drained("next", now + 60, now + 90)
    assert ForgetBundles((rid("stale"),)) in later
