"""The shell around the node's core (agent/core/node.py): feeds it events and the time, saves
each reclamation it moves, and carries out the commands through the adapters.

One loop, one queue: adapters run as tasks and report back as events on the queue, so the core
is only ever touched from here, one event at a time. Every step of a reclamation is followed by
a save of its bundle before any of its commands runs (write before act, docs/design.md step 2).
One timer: the loop sleeps until the earliest `next_wakeup()` of all live reclamations.

The bundles are read once, when the runner is made: from then on the pause, the live drains
and the finished reclamations are in memory, so a workload start never reads the disk.

A disk that refuses a write (the bundle, the local taint, the deadline file, the outbox) stops
nothing: the state is in memory, the notice is answered on time, the failure is one
`state_write_failed` per path, and the loop retries every `retry_writes_s` until the disk takes
the writes again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from spotdrain.agent.config import AgentConfig
from spotdrain.agent.core import reclamation as r
from spotdrain.agent.core.node import Node, Retention
from spotdrain.agent.core.notice import Notice, NoticeInvalid
from spotdrain.agent.core.reclamation_commands import SIGTERM, NodeCommand, Stepped
from spotdrain.agent.core.reclamation_events import (
    DeadlinesDue,
    Event,
    ForReclamation,
    NodeEvent,
    NoticeArrived,
    PauseAsked,
    ReportInvalid,
    ReportLanded,
    Restarted,
    ResumeAsked,
    RoundListed,
    TaintAnswered,
    TaintUnanswered,
    Tick,
)
from spotdrain.agent.drain.deadline_file import DeadlineFile
from spotdrain.agent.drain.executor import Executor
from spotdrain.agent.drain.link import CoordinatorLink
from spotdrain.agent.drain.outbox import Outbox
from spotdrain.agent.drain.signal_rounds import Answer, SignalRounds
from spotdrain.agent.drain.state import BundleStore, LocalTaints, WriteHealth
from spotdrain.agent.drain.taint_calls import TaintCalls
from spotdrain.agent.host.gpu import Nvml
from spotdrain.agent.workloads.docker_engine import DockerEngine
from spotdrain.agent.workloads.inference import WorkerManager
from spotdrain.agent.workloads.managers import DockerWork, Hold, WorkManagers
from spotdrain.agent.workloads.status_dirs import StatusDirs
from spotdrain.protocol.events import EventRecord
from spotdrain.runtime.background import Background
from spotdrain.runtime.metrics import ReclamationMetrics
from spotdrain.workload import Report

log = logging.getLogger("spotdrain.agent.drain")
RETRY_WRITES_S = 1.0  # how often state the disk refused is written again (by default)


class DrainRunner:
    def __init__(
        self,
        cfg: AgentConfig,
        outbox: Outbox,
        link: CoordinatorLink,
        work: WorkManagers | DockerEngine,
        nvml: Nvml,
        workers: WorkerManager,
        clock: Callable[[], float] = time.time,
        metrics: ReclamationMetrics | None = None,
        health: WriteHealth | None = None,
        bundles: BundleStore | None = None,
        local_taints: LocalTaints | None = None,
        deadline_file: DeadlineFile | None = None,
        retry_writes_s: float = RETRY_WRITES_S,
        retention: Retention | None = None,
    ) -> None:
        self.metrics = metrics
        self.cfg = cfg
        self.workers = workers
        self.outbox = outbox
        self.link = link
        # The node's work managers; a bare engine is the Docker-only host's (and the tests').
        self.work = work if isinstance(work, WorkManagers) else WorkManagers([DockerWork(work)])
        self.clock = clock
        self.retry_writes_s = retry_writes_s
        # Which state files the disk refuses; its reports are events like any other (attached
        # below, once the executor that records them is made).
        self.health = health or WriteHealth()
        self.bundles = bundles or BundleStore(cfg.state_dir, self.health)
        self.local_taints = local_taints or LocalTaints(cfg.state_dir, self.health)
        self.deadline_file = deadline_file or DeadlineFile(cfg.deadline_file, self.health)
        # Workloads' checkpoint reports: read as they land, recorded in the reclamation that
        # signalled the container (information only: never a deadline, never verification).
        self.status = StatusDirs(cfg.status_dir, self._on_report, self._on_report_invalid)
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        # An adapter bug must not silently stop a drain: a failed task fails the supervisor.
        self._tasks = Background(lambda e: self._queue.put_nowait(("crash", e)))
        self.rounds = SignalRounds(
            cfg.node_id,
            self.work,
            nvml,
            link,
            self.status,
            self.feed,
            lambda rid, listed, answer: self._queue.put_nowait(("listed", (rid, listed, answer))),
            self._spawn,
            clock,
        )
        self.taints = TaintCalls(link, self.feed, self._spawn, clock, self.rounds.lock)
        # Read once: the pause and the drains are in memory from now on (docs/design.md).
        self.node = Node(
            cfg.node_id,
            cfg.margins,
            cfg.pause_notice_s,
            retention or Retention(),
            self.bundles.load_all(with_events=True),
        )
        self.executor = Executor(
            cfg.node_id,
            self.node,
            outbox,
            link,
            workers,
            self.bundles,
            self.local_taints,
            self.deadline_file,
            self.rounds,
            self.taints,
            self.feed,
            self._spawn,
            clock,
            retry_writes_s,
            metrics,
        )
        self.health.attach(self.record)

    # --- inputs ------------------------------------------------------------------------------

    def notice(self, parsed: Notice | NoticeInvalid) -> None:
        self._queue.put_nowait(("notice", parsed))

    def feed(self, reclaim_id: str, event: Event) -> None:
        self._queue.put_nowait((reclaim_id, event))

    def record(self, kind: str, details: dict[str, Any]) -> None:
        """An event of the node's own that belongs to no reclamation (a source down, an
        advisory), stored in the outbox and sent like every other."""
        self.executor.emit(kind, "", None, self.clock(), details)

    @property
    def live(self) -> dict[str, r.Reclamation]:
        return self.node.live

    @property
    def recent(self) -> dict[str, r.Reclamation]:
        """The finished reclamations still remembered (agent/core/node.py Retention)."""
        return self.node.finished

    async def settled(self, key: str) -> str:
        """Wait until the reclamation of notice `key` has an outcome: verified empty
        ("drained"), past O ("overrun"), cancelled or resumed. Returns the outcome."""
        rid = r.reclaim_id_for(self.cfg.node_id, key)
        rec = self.node.get(rid)
        if rec is not None and rec.outcome:
            return rec.outcome
        waiter = asyncio.get_running_loop().create_future()
        self.executor.settling.setdefault(rid, []).append(waiter)
        try:
            return await waiter
        finally:
            waiters = self.executor.settling.get(rid, [])
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters:
                self.executor.settling.pop(rid, None)

    # --- the owner's switch, and what may start ----------------------------------------------

    def pause(self) -> r.Reclamation:
        """The owner's pause: a reclamation with D = now + the pause notice. Pausing a paused
        node returns the pause in force; its deadlines never move (invariant 2)."""
        self._handle(PauseAsked())
        rec = self.node.current_pause()
        if rec is None:  # a bug in the core (python -O strips an assert)
            raise RuntimeError(f"node {self.cfg.node_id}: the node core made no pause")
        self._wake()
        return rec

    def resume(self) -> list[str]:
        """The owner's resume: every pause ends, its taints are lifted, workload goes back on."""
        commands = self._handle(ResumeAsked())
        return [cmd.reclaim_id for cmd in commands if isinstance(cmd, Stepped)]

    def current_pause(self) -> r.Reclamation | None:
        return self.node.current_pause()

    def refuse_start(self) -> str | None:
        """Why no workload may start on this node now (invariant 4), or None. From memory."""
        return self.local_taints.refuse_start() or self.node.refuse_start()

    def past_grace(self, now: float) -> r.Reclamation | None:
        return self.node.past_grace(now)

    def _wake(self) -> None:
        self._queue.put_nowait(("wake", None))

    # --- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        await self._rebuild()
        self._spawn(self.status.watch())
        while True:
            self.executor.retry_writes_when_due()
            timeout = self._until_next_deadline()
            if timeout is not None and timeout <= 0:
                # Deadlines first, even while reports keep arriving (SIGKILL at G, O).
                self._handle(DeadlinesDue(self.rounds.listings(self.node.live)))
                timeout = self._until_next_deadline()
            try:
                key, item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                try:
                    # A small floor: a get with no time to run would never receive.
                    wait = None if timeout is None else max(timeout, 0.001)
                    # asyncio.timeout, not wait_for: Python 3.11's wait_for can turn a
                    # cancel that meets its timeout into a TimeoutError, and this loop would
                    # then carry on instead of stopping.
                    async with asyncio.timeout(wait):
                        key, item = await self._queue.get()
                except TimeoutError:
                    continue
            if key == "crash":
                raise RuntimeError(f"node {self.cfg.node_id}: drain task failed") from item
            if key == "wake":
                continue
            if key == "notice":
                self._on_notice(item)
            elif key == "listed":
                self._on_listed(*item)
            elif key == "report":
                self._handle(item)
            else:
                self._handle(ForReclamation(key, self._with_listing(key, item)))

    def _until_next_deadline(self) -> float | None:
        wakeups = [w for rec in self.node.live.values() if (w := rec.next_wakeup()) is not None]
        if self.executor.next_write_retry is not None:
            wakeups.append(self.executor.next_write_retry)
        return min(wakeups) - self.clock() if wakeups else None

    async def _rebuild(self) -> None:
        """Agent restart: carry on with every unfinished bundle, under its own deadlines."""
        now = self.clock()
        # The last step of each bundle may have died before its events reached the outbox.
        with self.outbox.hold():
            for rid in list(self.bundles.step_events):
                for fields in self.bundles.step_events.pop(rid):
                    self.outbox.put(EventRecord(**fields))
        self.link.wake()
        # One question to the engine for every bundle (a hung engine costs one call's timeout).
        delivered = await self._delivered(list(self.node.live.values()), now)
        for rec in self.node.live.values():
            log.info(
                "node %s reclamation %s: resuming (D in %.1f s)",
                rec.node_id,
                rec.reclaim_id,
                rec.terminate_at - now,
            )
        self._handle(Restarted(None if delivered is None else frozenset(delivered)))
        # Each manager's own cordon (Slurm's DRAIN) is asked again: one the old process was
        # still retrying (the controller away) lived only in its memory. Asking again for one
        # that landed sets the same reason.
        for rec in self.node.live.values():
            if not rec.lifted:
                self.work.cordon(Hold(rec.reclaim_id, rec.grace_deadline, rec.terminate_at))

    async def _delivered(self, recs: list[r.Reclamation], now: float) -> set[str] | None:
        """Of the SIGTERMs the old process announced, those the engine was asked to send."""
        announced = {
            unit: e["at"]
            for rec in recs
            for unit, e in rec.announced.items()
            if e["signal"] == SIGTERM
        }
        if not announced:
            return None
        return await self.work.delivered(min(announced.values()), now, set(announced))

    def _on_notice(self, parsed: Notice | NoticeInvalid) -> None:
        if isinstance(parsed, NoticeInvalid):
            log.warning("node %s: invalid notice: %s", self.cfg.node_id, parsed.reason)
            self._handle(NoticeArrived(parsed))
            return
        rid = r.reclaim_id_for(self.cfg.node_id, parsed.key)
        known = self.node.get(rid) is not None
        self._handle(NoticeArrived(parsed))
        rec = self.node.get(rid)
        if not known and rec is not None:
            log.info(
                "node %s reclamation %s: notice %s, D in %.1f s",
                rec.node_id,
                rid,
                parsed.notice_id,
                rec.terminate_at - rec.t0,
            )

    def _with_listing(self, rid: str, event: Event) -> Event:
        """The taint's answer (or its failure) with the listing made while the call was in
        flight, when it is back: the node lets the first SIGTERM round announce it in the same
        step, and the round sends at once. Otherwise the round lists and announces itself."""
        if not isinstance(event, TaintAnswered | TaintUnanswered | Tick):
            return event
        listed = None if event.listed is not None else self.rounds.listing(rid)
        return event if listed is None else dataclasses.replace(event, listed=listed)

    def _on_listed(self, rid: str, event: RoundListed, answer: Answer) -> None:
        """A round's targets: the node announces what it may signal, the bundle is saved, and
        the answer (DeliverSignals) releases the round."""
        self.rounds.answer = answer
        try:
            self._handle(ForReclamation(rid, event))
        finally:
            self.rounds.answer = None
            if not answer.done():
                answer.set_result(())  # a reclamation already finished: nothing to send

    def _on_report(self, name: str, report: Report) -> None:
        landed = ReportLanded(name, report.kind, report.generation, report.nbytes, report.at)
        self._queue.put_nowait(("report", landed))

    def _on_report_invalid(self, name: str, entry: str, why: str) -> None:
        self._queue.put_nowait(("report", ReportInvalid(name, entry, why)))

    def _handle(self, event: NodeEvent) -> list[NodeCommand]:
        commands = self.node.handle(event, self.clock())
        self.executor.carry_out(commands)
        return commands

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        return self._tasks.spawn(coro)

    async def close(self) -> None:
        self.rounds.close()
        await self._tasks.close()
        self.executor.close()
