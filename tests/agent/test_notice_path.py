"""The notice path's work after the taint, kept short without weakening its order: the node's
containers are listed while the Taint call is in flight (and a container started after that
listing is still signalled, by the stray round right after), and the events of one drain step
go to the outbox in one transaction. The drain runner with in-memory adapters, as
tests/agent/test_full_disk.py has them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from test_full_disk import NODE, Engine, Gpus, Link, Workers

from fakes.waiting import eventually
from spotdrain.agent.config import AgentConfig
from spotdrain.agent.core.notice import Notice
from spotdrain.agent.core.reclamation import Margins, reclaim_id_for
from spotdrain.agent.drain.outbox import Outbox
from spotdrain.agent.drain.runner import DrainRunner
from spotdrain.agent.drain.state import STEP_EVENTS, BundleStore
from spotdrain.agent.workloads.docker_engine import ContainerInfo


class HeldLink(Link):
    """A coordinator that answers Taint only when the test says so."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = asyncio.Event()
        self.asked = asyncio.Event()

    async def taint(self, reclaim_id: str, reason: str, timeout: float, **_: Any) -> None:
        self.taints.append(reclaim_id)
        self.asked.set()
        await self.answer.wait()


class CountingEngine(Engine):
    """Two jobs; every listing counted. Each signalled job goes; the node is empty when both
    have."""

    def __init__(self) -> None:
        super().__init__()
        self.listings: list[tuple[str, ...]] = []
        self.late = ContainerInfo("d2" * 32, "job-late", "batch", 0, image="trainer:1")

    async def targets(self, skip: frozenset[str], skip_kinds: frozenset[str]) -> list:
        found = await super().targets(skip, skip_kinds)
        self.listings.append(tuple(t.id for t in found))
        return found

    async def signal_each(self, targets: list, signal: str):  # type: ignore[override]
        for t in targets:
            self.signals.append((t.id, signal))
            self.running_now = [c for c in self.running_now if c.id != t.id]
            yield self._signalled(t, signal)
        if not self.running_now:
            self.gone.set()

    def _signalled(self, t: ContainerInfo, signal: str) -> Any:
        from spotdrain.agent.workloads.docker_engine import ContainerSignalled

        return ContainerSignalled(
            time.time(), t.id, t.name, signal, "api", image=t.image, kind=t.kind
        )


def config(tmp_path: Path) -> AgentConfig:
    cfg = AgentConfig(
        coordinator="127.0.0.1:1",
        node_id=NODE,
        notice_file=tmp_path / "n.json",
        state_dir=tmp_path / "state",
        insecure=True,
        deadline_file=tmp_path / "workload" / "deadline.json",
        status_dir=tmp_path / "status",
        socket=tmp_path / "agent.sock",
        margins=Margins(grace_s=3, overrun_s=1, observe_every_s=0.05),
    )
    cfg.state_dir.mkdir()
    return cfg


@contextlib.asynccontextmanager
async def running(drains: DrainRunner, outbox: Outbox) -> AsyncIterator[asyncio.Task[None]]:
    """The drain loop for the length of a scenario; stopped, closed and the outbox shut after."""
    loop = asyncio.create_task(drains.run())
    try:
        yield loop
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await drains.close()
        outbox.close()


async def test_containers_are_listed_while_the_taint_is_in_flight(tmp_path: Path) -> None:
    """The listing happens before the coordinator answers, nothing is signalled before the
    answer (invariant 1), and the job that started after that listing gets its one SIGTERM
    too, from the stray round that follows the first."""
    cfg = config(tmp_path)
    outbox = Outbox(cfg.state_dir / "outbox.sqlite")
    engine, link = CountingEngine(), HeldLink()
    drains = DrainRunner(cfg, outbox, link, engine, Gpus(), Workers())  # type: ignore[arg-type]
    async with running(drains, outbox):
        drains.notice(
            Notice(
                key="n-1",
                notice_id="n-1",
                action="terminate",
                terminate_at=time.time() + 20,
                source="file",
            )
        )
        await asyncio.wait_for(link.asked.wait(), 5)
        await eventually(lambda: engine.listings, "a listing while the Taint is unanswered")
        assert engine.listings == [(engine.job.id,)]
        assert engine.signals == []  # listed, not signalled: the taint is not in force yet

        engine.running_now.append(engine.late)  # started after the listing
        link.answer.set()
        outcome = await asyncio.wait_for(drains.settled("n-1"), 10)
        assert outcome == "drained"
        assert engine.signals[0] == (engine.job.id, "SIGTERM")  # the listed one, first
        assert sorted(engine.signals) == sorted(
            [(engine.job.id, "SIGTERM"), (engine.late.id, "SIGTERM")]
        )  # each once
        kinds = [e.kind for e in outbox.pending()]
        assert kinds.index("tainted") < kinds.index("sigterm_sent")


async def test_a_cancel_before_the_answer_signals_nothing(tmp_path: Path) -> None:
    """The listing made ahead is dropped with the reclamation: a cancel while the Taint is in
    flight sends no signal, even once the answer comes."""
    cfg = config(tmp_path)
    outbox = Outbox(cfg.state_dir / "outbox.sqlite")
    engine, link = CountingEngine(), HeldLink()
    drains = DrainRunner(cfg, outbox, link, engine, Gpus(), Workers())  # type: ignore[arg-type]
    async with running(drains, outbox):
        drains.notice(
            Notice(
                key="n-2",
                notice_id="n-2",
                action="terminate",
                terminate_at=time.time() + 20,
                source="file",
            )
        )
        await asyncio.wait_for(link.asked.wait(), 5)
        drains.notice(
            Notice(key="n-2", notice_id="n-2", action="cancel", terminate_at=None, source="file")
        )
        outcome = await asyncio.wait_for(drains.settled("n-2"), 5)
        assert outcome == "cancelled"
        link.answer.set()
        await eventually(
            lambda: "notice_cancelled" in [e.kind for e in outbox.pending()], "the cancel recorded"
        )
        await eventually(lambda: not drains.rounds.listed_ahead, "the listing made ahead dropped")
        assert engine.signals == []


async def test_one_step_puts_its_events_in_one_transaction(tmp_path: Path) -> None:
    """The taint's answer makes several events (tainted, deadline_file_written): they are
    stored together, one commit (one fsync), once the calls the step started are under way
    (its bundle holds them meanwhile)."""
    cfg = config(tmp_path)
    outbox = Outbox(cfg.state_dir / "outbox.sqlite")
    commits: list[str] = []
    assert outbox.db is not None
    outbox.db.set_trace_callback(
        lambda sql: commits.append(sql) if sql in ("COMMIT",) or sql.startswith("INSERT") else None
    )
    engine, link = CountingEngine(), HeldLink()
    drains = DrainRunner(cfg, outbox, link, engine, Gpus(), Workers())  # type: ignore[arg-type]
    async with running(drains, outbox):
        drains.notice(
            Notice(
                key="n-3",
                notice_id="n-3",
                action="terminate",
                terminate_at=time.time() + 20,
                source="file",
            )
        )
        await asyncio.wait_for(link.asked.wait(), 5)
        await eventually(lambda: not outbox.held_in_memory, "the notice's own events stored")
        before = len(commits)
        link.answer.set()
        await eventually(lambda: engine.signals, "the SIGTERM")
        await eventually(lambda: not outbox.held_in_memory, "the step's events stored")
        step = commits[before:]
        tainted = next(i for i, sql in enumerate(step) if '"kind": "tainted"' in sql)
        written = next(i for i, sql in enumerate(step) if '"kind": "deadline_file_written"' in sql)
        # The answer's step: both events in one transaction (no COMMIT between), then one COMMIT.
        assert "COMMIT" not in step[min(tainted, written) : max(tainted, written)], step
        assert "COMMIT" in step[max(tainted, written) :], step
        stored = [
            row[0]
            for row in sqlite3.connect(cfg.state_dir / "outbox.sqlite").execute(
                "SELECT body FROM outbox ORDER BY seq"
            )
        ]
        assert any('"kind": "tainted"' in b for b in stored)
        assert any('"kind": "deadline_file_written"' in b for b in stored)


class SlowOutbox(Outbox):
    """A disk that has not yet taken a drain step's events when the agent dies: they stay in
    memory (sent all the same) until the test lets them through."""

    stores = False

    def store_held(self) -> None:
        if self.stores:
            super().store_held()


async def test_every_event_the_outbox_has_not_stored_rides_in_the_bundle(tmp_path: Path) -> None:
    """The outbox stores a step's events a moment after the step's calls have started. Until
    it has, the bundle carries them, each later step's bundle too: the agent killed after its
    drain, with none of the notice's, the taint's, the signal's or the outcome's events in
    SQLite, loses none, and the restarted agent stores each once and sends no second SIGTERM."""
    cfg = config(tmp_path)
    outbox = SlowOutbox(cfg.state_dir / "outbox.sqlite")
    engine, link = CountingEngine(), Link()
    bundles = BundleStore(cfg.state_dir)
    engine.running_now = [engine.job]
    drains = DrainRunner(cfg, outbox, link, engine, Gpus(), Workers(), bundles=bundles)  # type: ignore[arg-type]
    loop = asyncio.create_task(drains.run())
    try:
        drains.notice(
            Notice(
                key="n-5",
                notice_id="n-5",
                action="terminate",
                terminate_at=time.time() + 20,
                source="file",
            )
        )
        await asyncio.wait_for(drains.settled("n-5"), 5)
    finally:
        loop.cancel()  # killed: no close(), nothing more reaches the disk
        await asyncio.gather(loop, return_exceptions=True)
    rid = reclaim_id_for(NODE, "n-5")
    carried = [e["kind"] for e in json.loads(bundles.path(rid).read_text())[STEP_EVENTS]]
    assert carried[0] == "notice_received"
    assert {"tainted", "sigterm_sent", "drained"} <= set(carried)
    stored = (
        sqlite3.connect(cfg.state_dir / "outbox.sqlite")
        .execute("SELECT count(*) FROM outbox")
        .fetchone()[0]
    )
    assert stored == 0
    outbox.close()

    again = Outbox(cfg.state_dir / "outbox.sqlite")
    drains = DrainRunner(cfg, again, Link(), engine, Gpus(), Workers())  # type: ignore[arg-type]
    async with running(drains, again):
        assert await asyncio.wait_for(drains.settled("n-5"), 5) == "drained"
        kinds = [e.kind for e in again.pending()]
        for kind in carried:
            assert kinds.count(kind) == carried.count(kind), kind
        assert [s for s in engine.signals if s[1] == "SIGTERM"] == [(engine.job.id, "SIGTERM")]


async def test_the_drain_loop_stops_when_cancelled_between_two_wakeups(tmp_path: Path) -> None:
    """The loop waits for its next deadline with a timeout; a cancel that arrives as that
    timeout fires must still stop it (Python 3.11's asyncio.wait_for could turn such a cancel
    into a TimeoutError, and the loop went on waiting, so an agent never finished stopping)."""
    cfg = config(tmp_path)
    outbox = Outbox(cfg.state_dir / "outbox.sqlite")
    engine, link = CountingEngine(), HeldLink()
    drains = DrainRunner(cfg, outbox, link, engine, Gpus(), Workers())  # type: ignore[arg-type]
    loop = asyncio.create_task(drains.run())
    try:
        drains.notice(
            Notice(
                key="n-4",
                notice_id="n-4",
                action="terminate",
                terminate_at=time.time() + 20,
                source="file",
            )
        )
        await asyncio.wait_for(link.asked.wait(), 5)
        link.answer.set()
        await eventually(lambda: engine.signals, "the SIGTERM")
        # The job never exits (its exit is never reported): the loop keeps waking to observe.
        for _ in range(50):
            await asyncio.sleep(0.001)
        loop.cancel()
        done, _ = await asyncio.wait({loop}, timeout=10)
        assert loop in done and loop.cancelled()
    finally:
        loop.cancel()
        await drains.close()
        outbox.close()


async def test_the_first_sigterm_round_is_announced_in_the_answers_own_save(
    tmp_path: Path,
) -> None:
    """The listing made while the Taint was in flight is back before the answer: the answer's
    step announces the round, so exactly one bundle save lies between the answer and the
    SIGTERM, and that save already names the container as announced (write before act)."""

    class CountingBundles(BundleStore):
        saves: list[tuple[int, tuple[str, ...]]] = []

        def save(self, rec, events=()):  # noqa: ANN001, ANN201
            self.saves.append((len(engine.signals), tuple(rec.announced)))
            return super().save(rec, events)

    cfg = config(tmp_path)
    outbox = Outbox(cfg.state_dir / "outbox.sqlite")
    engine, link = CountingEngine(), HeldLink()
    bundles = CountingBundles(cfg.state_dir)
    drains = DrainRunner(cfg, outbox, link, engine, Gpus(), Workers(), bundles=bundles)  # type: ignore[arg-type]
    async with running(drains, outbox):
        drains.notice(
            Notice(
                key="n-8",
                notice_id="n-8",
                action="terminate",
                terminate_at=time.time() + 20,
                source="file",
            )
        )
        await asyncio.wait_for(link.asked.wait(), 5)
        await eventually(lambda: engine.listings, "the listing made ahead")
        before = len(bundles.saves)
        link.answer.set()
        await eventually(lambda: engine.signals, "the SIGTERM")
        between = [s for s in bundles.saves[before:] if s[0] == 0]  # saved before any signal
        assert between == [(0, (engine.job.id,))]
        assert engine.signals == [(engine.job.id, "SIGTERM")]
        assert engine.listings == [(engine.job.id,)]  # listed once, ahead


class HoldRecordingLink(HeldLink):
    """HeldLink that writes down when the drain holds and releases the stream's events."""

    def __init__(self, engine: CountingEngine) -> None:
        super().__init__()
        self.engine = engine
        self.holds: list[tuple[str, str, int]] = []  # (what, key, SIGTERMs sent so far)

    def hold_events(self, key: str) -> None:
        self.holds.append(("hold", key, len(self.engine.signals)))

    def release_events(self, key: str) -> None:
        self.holds.append(("release", key, len(self.engine.signals)))


async def test_the_notice_path_holds_the_events_from_its_taint_to_its_sigterms(
    tmp_path: Path,
) -> None:
    """The drain holds the stream's events back from the taint until its SIGTERM round has
    sent: the engine's kills do not share the cores with an event batch being stored. The
    notice's own events are not held (they reach the coordinator before its reactions to the
    taint), and a cancel during the Taint holds nothing."""
    cfg = config(tmp_path)
    outbox = Outbox(cfg.state_dir / "outbox.sqlite")
    engine = CountingEngine()
    link = HoldRecordingLink(engine)
    drains = DrainRunner(cfg, outbox, link, engine, Gpus(), Workers())  # type: ignore[arg-type]
    async with running(drains, outbox):
        drains.notice(
            Notice(
                key="n-9",
                notice_id="n-9",
                action="terminate",
                terminate_at=time.time() + 20,
                source="file",
            )
        )
        await asyncio.wait_for(link.asked.wait(), 5)
        rid = reclaim_id_for(NODE, "n-9")
        assert link.holds == []  # the notice's events go at once
        link.answer.set()
        await eventually(lambda: ("release", rid, 1) in link.holds, "the release after the SIGTERM")
        assert link.holds[:2] == [("hold", rid, 0), ("release", rid, 1)]

        link.answer.clear()
        link.asked.clear()
        drains.notice(
            Notice(
                key="n-10",
                notice_id="n-10",
                action="terminate",
                terminate_at=time.time() + 20,
                source="file",
            )
        )
        await asyncio.wait_for(link.asked.wait(), 5)
        drains.notice(
            Notice(key="n-10", notice_id="n-10", action="cancel", terminate_at=None, source="file")
        )
        other = reclaim_id_for(NODE, "n-10")
        await asyncio.wait_for(drains.settled("n-10"), 5)
        link.answer.set()
        await eventually(lambda: not drains.live, "the cancelled reclamation finished")
        assert not any(h[1] == other and h[0] == "hold" for h in link.holds)
