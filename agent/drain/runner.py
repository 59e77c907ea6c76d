"""The shell around the reclamation machines: feeds them events and the time, persists them,
and carries out their commands through the adapters.

One loop, one queue: adapters run as tasks and report back as events on the queue, so the
machines are only ever touched from here, one event at a time. Every handled event is followed
by a save of the bundle before any command runs (write before act, docs/design.md step 2).
One timer: the loop sleeps until the earliest `next_wakeup()` of all live reclamations.

A signal round lists its targets, hands them to the machine (RoundListed) and waits for its
answer (DeliverSignals), which comes after the bundle holding the announcement is saved: a
restarted agent then knows which containers may have had their SIGTERM (at most once). The
first SIGTERM round skips that exchange when the listing made while the Taint call was in
flight is back by the answer: the answer's own step announces it (one save, not two, between
the taint and the SIGTERMs).

A disk that refuses a write (the bundle, the local taint, the deadline file, the outbox) stops
nothing: the machine's state is in memory, the notice is answered on time, the failure is one
`state_write_failed` per path, and the loop retries every RETRY_WRITES_S until the disk takes
the writes again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from spotdrain.agent.config import AgentConfig
from spotdrain.agent.core import reclamation as r
from spotdrain.agent.core.notice import Notice, NoticeInvalid
from spotdrain.agent.core.reclamation_commands import (
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
from spotdrain.agent.core.signal_ledger import (
    TERM_ANNOUNCED,
    TERM_BY_PREVIOUS_RUN,
    TERM_SENT,
    ledger,
)
from spotdrain.agent.drain.link import CoordinatorLink, TaintError
from spotdrain.agent.drain.outbox import Outbox, OutgoingEvent
from spotdrain.agent.drain.state import BundleStore, LocalTaints, WriteHealth, write_deadline_file
from spotdrain.agent.host.gpu import GpuError, Nvml
from spotdrain.agent.workloads.docker_engine import (
    RENTAL_KIND,
    ContainerInfo,
    DockerEngine,
    DockerUnavailable,
)
from spotdrain.agent.workloads.inference import WorkerManager
from spotdrain.agent.workloads.status_dirs import StatusDirs
from spotdrain.runtime.background import Background
from spotdrain.runtime.metrics import ReclamationMetrics
from spotdrain.workload import Report

log = logging.getLogger("spotdrain.agent.drain")
RECENT_KEPT = 8  # finished reclamations kept in memory (see DrainRunner.recent)
RETRY_WRITES_S = 1.0  # how often state the disk refused is written again
# A drain step's events reach the outbox this long after the step: its bundle holds them
# already, and the outbox's fsync then overlaps the calls the step started (the Taint, the
# kills) instead of going before them.
STORE_EVENTS_AFTER_S = 0.002


class DrainRunner:
    def __init__(
        self,
        cfg: AgentConfig,
        outbox: Outbox,
        link: CoordinatorLink,
        docker: DockerEngine,
        nvml: Nvml,
        workers: WorkerManager,
        clock: Callable[[], float] = time.time,
        metrics: ReclamationMetrics | None = None,
        health: WriteHealth | None = None,
        bundles: BundleStore | None = None,
        local_taints: LocalTaints | None = None,
    ) -> None:
        self.metrics = metrics
        self.cfg = cfg
        self.workers = workers
        self.outbox = outbox
        self.link = link
        self.docker = docker
        self.nvml = nvml
        self.clock = clock
        # Which state files the disk refuses; its reports are events like any other.
        self.health = health or WriteHealth()
        self.health.attach(self.record)
        self.bundles = bundles or BundleStore(cfg.state_dir, self.health)
        self.local_taints = local_taints or LocalTaints(cfg.state_dir, self.health)
        # The deadline file as last asked for, while the disk refuses it (None: written).
        self._deadline_unwritten: tuple[str, float, float, str] | None = None
        self._next_write_retry: float | None = None
        # Workloads' checkpoint reports: read as they land, recorded in the reclamation that
        # signalled the container (information only: never a deadline, never verification).
        self.status = StatusDirs(cfg.status_dir, self._on_report, self._on_report_invalid)
        self.live: dict[str, r.Reclamation] = {}
        # The last few finished ones: a rental's exit at G may be reported just after its
        # reclamation has verified the node empty and finished.
        self.recent: dict[str, r.Reclamation] = {}
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        # An adapter bug must not silently stop a drain: a failed task fails the supervisor.
        self._tasks = Background(lambda e: self._queue.put_nowait(("crash", e)))
        # Signal rounds run one after another, in the order the machines asked for them, so a
        # SIGKILL round never overtakes the SIGTERM round before it.
        self._signal_lock = asyncio.Lock()
        # The round waiting for the machine's DeliverSignals (at most one: rounds hold the lock).
        self._round_answer: asyncio.Future[tuple[str, ...]] | None = None
        self._taint_calls: dict[str, asyncio.Task[None]] = {}
        self._taint_retries: dict[str, asyncio.Task[None]] = {}
        # The node's containers, listed while the Taint call is in flight: the first SIGTERM
        # round signals these at once when the taint lands instead of listing then. One started
        # in between is not lost: the observation right after the round sees it and the stray
        # round signals it (invariant 1 holds either way: nothing is signalled before a taint).
        self._listed_ahead: dict[str, asyncio.Task[list[ContainerInfo]]] = {}
        self._blind_resume: asyncio.Task[None] | None = None
        self._store_events: asyncio.TimerHandle | None = None
        # Sources waiting for a reclamation to settle (a logind lock, an Azure acknowledgement).
        self._settling: dict[str, list[asyncio.Future[str]]] = {}

    # --- inputs ------------------------------------------------------------------------------

    def notice(self, parsed: Notice | NoticeInvalid) -> None:
        self._queue.put_nowait(("notice", parsed))

    def feed(self, reclaim_id: str, event: Event) -> None:
        self._queue.put_nowait((reclaim_id, event))

    def record(self, kind: str, details: dict[str, Any]) -> None:
        """An event of the node's own that belongs to no reclamation (a source down, an
        advisory), stored in the outbox and sent like every other."""
        self._emit(kind, "", None, self.clock(), details)

    async def settled(self, key: str) -> str:
        """Wait until the reclamation of notice `key` has an outcome: verified empty
        ("drained"), past O ("overrun"), cancelled or resumed. Returns the outcome."""
        rid = r.reclaim_id_for(self.cfg.node_id, key)
        rec = self.live.get(rid) or self.recent.get(rid)
        if rec is None and self.bundles.exists(rid):  # settled before this agent started
            rec = next((b for b in self.bundles.load_all() if b.reclaim_id == rid), None)
        if rec is not None and rec.outcome:
            return rec.outcome
        waiter = asyncio.get_running_loop().create_future()
        self._settling.setdefault(rid, []).append(waiter)
        try:
            return await waiter
        finally:
            waiters = self._settling.get(rid, [])
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters:
                self._settling.pop(rid, None)

    # --- the owner's switch ------------------------------------------------------------------

    def pause(self) -> r.Reclamation:
        """The owner's pause: a reclamation with D = now + the pause notice. Pausing a paused
        node returns the pause in force; its deadlines never move (invariant 2)."""
        current = self.current_pause()
        if current is not None:
            return current
        if self._blind_resume is not None:
            self._blind_resume.cancel()  # an old resume must not end this new pause
        now = self.clock()
        notice = Notice(
            key=f"pause:{now:.6f}",
            notice_id=f"pause-{int(now)}",
            action="pause",
            terminate_at=now + self.cfg.pause_notice_s,
            source="owner",
        )
        rec, commands = r.Reclamation.begin(
            notice, self.cfg.node_id, now, self.cfg.margins, reason="pause"
        )
        log.info(
            "node %s reclamation %s: owner pause, D in %.0f s",
            rec.node_id,
            rec.reclaim_id,
            rec.terminate_at - now,
        )
        self.live[rec.reclaim_id] = rec
        self._apply(rec, commands)
        self._wake()
        return rec

    def resume(self) -> list[str]:
        """The owner's resume: every pause ends, its taints are lifted, workload goes back on."""
        resumed = []
        now = self.clock()
        for stored in self.bundles.load_all():
            if stored.reason != "pause" or stored.lifted:
                continue
            rec = self.live.setdefault(stored.reclaim_id, stored)
            self._step(rec, Resumed(now))
            resumed.append(rec.reclaim_id)
        if not resumed:
            # Nothing paused here, but the coordinator may still hold the flag off (a pause
            # made while this agent's state was lost): turn it on.
            self._blind_resume = self._spawn(self.link.resume_until_answered(""))
        return resumed

    def current_pause(self) -> r.Reclamation | None:
        for rec in self.bundles.load_all():
            if rec.reason == "pause" and not rec.lifted:
                return self.live.get(rec.reclaim_id, rec)
        return None

    def refuse_start(self) -> str | None:
        """Why no workload may start on this node now (invariant 4), or None."""
        why = self.local_taints.refuse_start()
        if why:
            return why
        if any(not rec.lifted for rec in self.live.values()):
            return "node is draining"
        if self.current_pause() is not None:
            return "node is paused by its owner"
        return None

    def _wake(self) -> None:
        self._queue.put_nowait(("wake", None))

    # --- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        await self._rebuild()
        self._spawn(self.status.watch())
        while True:
            self._retry_writes_when_due()
            timeout = self._until_next_deadline()
            if timeout is not None and timeout <= 0:
                # Deadlines first, even while reports keep arriving (SIGKILL at G, O).
                now = self.clock()
                for rec in list(self.live.values()):
                    self._step(rec, self._with_listing(rec.reclaim_id, Tick(now)))
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
            elif key in self.live:
                self._step(self.live[key], self._with_listing(key, item))
            elif key in self.recent and isinstance(item, ContainerExited):
                # Verified empty (and finished) before the engine's wait came back: the exit
                # still belongs in the timeline.
                self._step(self.recent[key], item)

    def _until_next_deadline(self) -> float | None:
        wakeups = [w for rec in self.live.values() if (w := rec.next_wakeup()) is not None]
        if self._next_write_retry is not None:
            wakeups.append(self._next_write_retry)
        return min(wakeups) - self.clock() if wakeups else None

    # --- state the disk refused --------------------------------------------------------------

    def _retry_writes_when_due(self) -> None:
        if self._next_write_retry is None or self.clock() < self._next_write_retry:
            return
        self._retry_writes()

    def _retry_writes(self) -> None:
        """Write again what the disk refused; keep trying every RETRY_WRITES_S until it all
        went (the promise does not wait for it: the state it stands for is in memory)."""
        done = self.bundles.retry()
        done = self.local_taints.retry() and done
        if self._deadline_unwritten is not None:
            done = self._write_deadline_file(*self._deadline_unwritten) and done
        done = self.outbox.retry() and done
        self._next_write_retry = None if done else self.clock() + RETRY_WRITES_S

    def _write_deadline_file(
        self, rid: str, terminate_at: float, grace_deadline: float, reason: str
    ) -> bool:
        path = self.cfg.deadline_file
        try:
            write_deadline_file(path, rid, terminate_at, grace_deadline, reason)
        except OSError as e:
            self._deadline_unwritten = (rid, terminate_at, grace_deadline, reason)
            self.health.failed(path, e)
            return False
        except ValueError as e:  # a deadline the file's format refuses: never a crash (loop)
            log.error(
                "node %s reclamation %s: deadline file not written: %s", self.cfg.node_id, rid, e
            )
            self._deadline_unwritten = None
            return True
        self._deadline_unwritten = None
        self.health.wrote(path)
        return True

    def _apply(self, rec: r.Reclamation, commands: list[Command]) -> None:
        """Carry out one step: the bundle is written before any command runs (write before
        act), and it holds every event of the reclamation the outbox has not stored yet (this
        step's, and an earlier step's still waiting for STORE_EVENTS_AFTER_S), so a SIGKILL
        or a power cut before the outbox's write loses none: a restarted agent puts them into
        the outbox again (by uid, so once)."""
        # The deadline file first (whether it could be written is in its event); writing it
        # before the bundle is harmless: a restarted agent writes it again, or removes it.
        for cmd in commands:
            if isinstance(cmd, WriteDeadlineFile):
                self._write_deadline(rec, cmd)
        rest = [c for c in commands if not isinstance(c, WriteDeadlineFile)]
        events = [self._event(rec, c) for c in rest if isinstance(c, Emit)]
        self._save(rec, events)
        self._execute(rec, rest, events)

    def _event(self, rec: r.Reclamation, emit: Emit) -> OutgoingEvent:
        now = self.clock() if emit.at is None else emit.at
        details = emit.details
        if emit.kind == "deadline_file_written" and self._deadline_unwritten is not None:
            details = {**details, "written": False}  # see state_write_failed
        return self.outbox.event(
            emit.kind, self.cfg.node_id, rec.reclaim_id, now, now - rec.t0, details
        )

    def _save(self, rec: r.Reclamation, events: list[OutgoingEvent] | None = None) -> None:
        """The bundle before any command runs, with the step's new events and every earlier one
        of the reclamation the outbox has not stored; on a refusal, the drain goes on from
        memory."""
        unstored = [*self.outbox.unstored(rec.reclaim_id), *(events or [])]
        if not self.bundles.save(rec, unstored) and self._next_write_retry is None:
            self._next_write_retry = self.clock() + RETRY_WRITES_S

    async def _rebuild(self) -> None:
        """Agent restart: reload every unfinished bundle and carry on with its deadlines."""
        now = self.clock()
        recs = self.bundles.load_all(with_events=True)
        # The last step of each bundle may have died before its events reached the outbox.
        with self.outbox.hold():
            for rec in recs:
                for fields in self.bundles.step_events.pop(rec.reclaim_id, []):
                    self.outbox.put_event(OutgoingEvent(**fields))
        self.link.wake()
        # One question to the engine for every bundle (a hung engine costs one call's timeout).
        delivered = await self._delivered([rec for rec in recs if not rec.finished], now)
        for rec in recs:
            if rec.finished:
                continue
            log.info(
                "node %s reclamation %s: resuming (D in %.1f s)",
                rec.node_id,
                rec.reclaim_id,
                rec.terminate_at - now,
            )
            self.live[rec.reclaim_id] = rec
            self._apply(rec, rec.resume(now, delivered))

    async def _delivered(self, recs: list[r.Reclamation], now: float) -> set[str] | None:
        """Of the SIGTERMs the old process announced, those the engine was asked to send."""
        announced = [
            e["at"] for rec in recs for e in rec.announced.values() if e["signal"] == SIGTERM
        ]
        if not announced:
            return None
        return await self.docker.sigterms_since(min(announced), now)

    def _on_notice(self, parsed: Notice | NoticeInvalid) -> None:
        now = self.clock()
        if isinstance(parsed, NoticeInvalid):
            log.warning("node %s: invalid notice: %s", self.cfg.node_id, parsed.reason)
            self._emit(
                "notice_invalid",
                "",
                None,
                now,
                {"reason": parsed.reason, "content_hash": parsed.content_hash},
            )
            return
        reclaim_id = r.reclaim_id_for(self.cfg.node_id, parsed.key)
        # A finished reclamation takes its cancel and its updates too: the same provider event
        # is one reclamation however often it is read (an agent restarted with a cancel still in
        # the notice file reads it again; AWS's mock re-stamps its document on every read).
        try:
            rec = (
                self.live.get(reclaim_id)
                or self.recent.get(reclaim_id)
                or self.bundles.load(reclaim_id)
            )
        except RuntimeError as e:  # a garbled bundle still stands for its notice: not a crash
            log.error("node %s: notice %s: %s", self.cfg.node_id, parsed.notice_id, e)
            return
        if parsed.action == "cancel":
            if rec is None:  # a cancel of a notice this node never had
                self._emit(
                    "notice_cancelled",
                    "",
                    None,
                    now,
                    {"notice_id": parsed.notice_id, "lifted": False, "known": False},
                )
                return
            self._step(rec, Cancelled(now))
            return
        if rec is not None:
            # Heard again: the machine decides what, if anything, it changes (D only earlier).
            self._step(rec, NoticeHeard(now, parsed.action, parsed.terminate_at))
            return
        rec, commands = r.Reclamation.begin(parsed, self.cfg.node_id, now, self.cfg.margins)
        log.info(
            "node %s reclamation %s: notice %s, D in %.1f s",
            rec.node_id,
            rec.reclaim_id,
            parsed.notice_id,
            rec.terminate_at - now,
        )
        self.live[rec.reclaim_id] = rec
        self._apply(rec, commands)  # the bundle is on disk before anything is done

    def _with_listing(self, rid: str, event: Event) -> Event:
        """The taint's answer (or its failure, or the tick past its deadline) with the listing
        made while the call was in flight, when it is back: the machine announces the first
        SIGTERM round in the same step, and the round sends at once. Otherwise the round lists
        and announces itself."""
        if not isinstance(event, TaintAnswered | TaintUnanswered | Tick):
            return event
        rec = self.live.get(rid)
        if event.listed is not None or rec is None or rec.phase != "tainting":
            return event
        ahead = self._listed_ahead.get(rid)
        if ahead is None or not ahead.done() or ahead.cancelled() or ahead.exception():
            return event
        already = self._sigtermed_elsewhere(rid)
        listed = tuple(
            RoundTarget(t.id, t.name, t.kind, t.image)
            for t in ahead.result()
            if t.id not in already
        )
        return dataclasses.replace(event, listed=listed)

    def _on_listed(
        self, rid: str, event: RoundListed, answer: asyncio.Future[tuple[str, ...]]
    ) -> None:
        """A round's targets: the machine announces what it may signal, the bundle is saved,
        and the answer (DeliverSignals, in _execute) releases the round."""
        rec = self.live.get(rid)
        self._round_answer = answer
        try:
            if rec is not None:
                self._step(rec, event)
        finally:
            self._round_answer = None
            if not answer.done():
                answer.set_result(())  # a reclamation already finished: nothing to send

    def _step(self, rec: r.Reclamation, event: Event) -> None:
        self._apply(rec, rec.handle(event))
        if rec.lifted or rec.phase == "done":
            self.link.release_events(rec.reclaim_id)  # no SIGTERM round to wait for
        if rec.outcome:
            for waiter in self._settling.get(rec.reclaim_id, ()):
                if not waiter.done():
                    waiter.set_result(rec.outcome)
        if rec.finished:
            self.live.pop(rec.reclaim_id, None)
            self.recent[rec.reclaim_id] = rec
            while len(self.recent) > RECENT_KEPT:
                del self.recent[next(iter(self.recent))]
        elif rec.reclaim_id not in self.live:
            # A finished one reopened (a cancel that lifts a drained node): live again until
            # the coordinator confirms the lift, so its TaintsLifted reaches it.
            self.recent.pop(rec.reclaim_id, None)
            self.live[rec.reclaim_id] = rec

    def past_grace(self, now: float) -> r.Reclamation | None:
        """The reclamation whose grace deadline has passed (its SIGKILL round took whatever
        still ran), if any: what a container stopping now was stopped by."""
        due = [
            rec
            for rec in (*self.live.values(), *self.recent.values())
            if not rec.lifted and rec.grace_deadline <= now
        ]
        return min(due, key=lambda rec: rec.grace_deadline, default=None)

    # --- commands ----------------------------------------------------------------------------

    def _execute(
        self, rec: r.Reclamation, commands: list[Command], events: list[OutgoingEvent]
    ) -> None:
        # The step's events wait in memory (and go out to the coordinator) while the calls it
        # started get under way; its bundle holds them meanwhile.
        with self.outbox.hold(store=False):
            self._execute_each(rec, commands, iter(events))
        if rec.finished and events:
            # Its last events go into the outbox now, and then the bundle need not carry them
            # any more (a restarted agent would only send them again), unless the disk refused
            # them. Off the notice path.
            self.outbox.store_held()
            self._save(rec)
        elif events and self._store_events is None:
            self._store_events = asyncio.get_running_loop().call_later(
                STORE_EVENTS_AFTER_S, self._store_held
            )

    def _store_held(self) -> None:
        self._store_events = None
        self.outbox.store_held()

    def _execute_each(
        self, rec: r.Reclamation, commands: list[Command], events: Iterator[OutgoingEvent]
    ) -> None:
        """Every command but WriteDeadlineFile (_apply writes the file before the bundle)."""
        rid = rec.reclaim_id
        for cmd in commands:
            match cmd:
                case Emit():
                    self._put(next(events))
                case RequestTaint(_, answer_by):
                    self._taint_calls[rid] = self._spawn(self._request_taint(rec, answer_by))
                    if rid not in self._listed_ahead:
                        self._listed_ahead[rid] = asyncio.ensure_future(
                            self.docker.targets(frozenset(), frozenset())
                        )
                case ApplyLocalTaint():
                    self.local_taints.apply(rid)  # held in memory if the disk refuses it
                    if self.local_taints.dirty:
                        self._next_write_retry = self.clock() + RETRY_WRITES_S
                case RetryRemoteTaint():
                    if rid not in self._taint_retries or self._taint_retries[rid].done():
                        self._taint_retries[rid] = self._spawn(self._retry_taint(rec))
                case LiftTaints():
                    ahead = self._listed_ahead.pop(rid, None)
                    if ahead is not None:
                        ahead.cancel()
                    self.local_taints.lift(rid)  # held in memory if the disk refuses it
                    self._lift_deadline_file(rec)
                    if (self.local_taints.dirty or self._deadline_unwritten) and (
                        self._next_write_retry is None
                    ):
                        self._next_write_retry = self.clock() + RETRY_WRITES_S
                    self._spawn(self._lift_remote_taint(rec))
                case SignalContainers(signal, skip, announced):
                    if signal == SIGTERM and not rec.sigterm_round_done:
                        # The first round only (a stray one may be asked at every look while a
                        # rental runs on: holding for each would starve the stream). This
                        # step's events (tainted, ...) and later ones wait on the stream
                        # until the round has sent (see _send): stored by the coordinator
                        # meanwhile, they would share the cores with the engine's kills. The
                        # notice's own events went before the Taint call, so the coordinator
                        # stores the notice before its reactions to the taint.
                        self.link.hold_events(rid)
                    self._spawn(self._signal_round(rid, signal, skip, cmd.skip_kinds, announced))
                case DeliverSignals(_, containers):
                    # After the save above: the announcement is on disk before any signal.
                    if self._round_answer is not None and not self._round_answer.done():
                        self._round_answer.set_result(containers)
                case DrainWorkers(_, grace_deadline):
                    containers = self.workers.drain(None, grace_deadline, rid)
                    names = tuple(
                        w.name
                        for w in self.workers.workers.values()
                        if w.container_id in containers
                    )
                    if containers:
                        self.feed(rid, WorkersDraining(self.clock(), tuple(containers), names))
                case CutWorkers():
                    self.workers.cut_all()
                case WatchExits(containers):
                    for cid in containers:
                        self._spawn(self._watch_exit(rid, cid, rec.names.get(cid, cid[:12])))
                case Observe():
                    self._spawn(self._observe(rid))
                case _:
                    raise TypeError(cmd)

    def _lift_deadline_file(self, rec: r.Reclamation) -> None:
        """The file is the node's: a lift removes it only when no other drain is in force (one
        preemption heard by two sources, one of them withdrawn); else it names that drain."""
        other = self._earliest_other(rec)
        if other is not None and other.phase == "draining":
            self._write_deadline_file(
                other.reclaim_id, other.terminate_at, other.grace_deadline, other.reason
            )
            return
        self._deadline_unwritten = None
        try:
            self.cfg.deadline_file.unlink(missing_ok=True)
        except OSError as e:
            self.health.failed(self.cfg.deadline_file, e)

    def _write_deadline(self, rec: r.Reclamation, cmd: WriteDeadlineFile) -> None:
        # The file is the node's: with two reclamations in force (one preemption heard by two
        # sources) it keeps the earlier G; a later one never moves it.
        rid, terminate_at, grace_deadline, reason = (
            rec.reclaim_id,
            cmd.terminate_at,
            cmd.grace_deadline,
            cmd.reason,
        )
        first = self._earliest_other(rec)
        if first is not None and first.grace_deadline < grace_deadline:
            rid, terminate_at, grace_deadline, reason = (
                first.reclaim_id,
                first.terminate_at,
                first.grace_deadline,
                first.reason,
            )
        if not self._write_deadline_file(rid, terminate_at, grace_deadline, reason):
            self._next_write_retry = self.clock() + RETRY_WRITES_S

    def _emit(
        self, kind: str, reclaim_id: str, t_offset_s: float | None, now: float, details: dict
    ) -> None:
        """An event outside a drain step (a disk's refusal, an invalid notice): no bundle."""
        self._put(self.outbox.event(kind, self.cfg.node_id, reclaim_id, now, t_offset_s, details))

    def _put(self, event: OutgoingEvent) -> None:
        self.outbox.put_event(event)
        self.link.wake()
        if self.metrics is not None:
            self.metrics.observe_event(
                event.kind, event.reclaim_id, event.t_offset_s, event.details
            )
        log.info(
            "node %s reclamation %s: %s %s",
            self.cfg.node_id,
            event.reclaim_id or "-",
            event.kind,
            event.details or "",
        )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        return self._tasks.spawn(coro)

    async def close(self) -> None:
        for ahead in self._listed_ahead.values():
            ahead.cancel()
        await self._tasks.close()
        if self._store_events is not None:
            self._store_events.cancel()
            self._store_held()

    # --- adapters, reporting back as events --------------------------------------------------

    async def _request_taint(self, rec: r.Reclamation, answer_by: float) -> None:
        if rec.lifted:
            return
        try:
            await self.link.taint(
                rec.reclaim_id,
                rec.reason,
                timeout=answer_by - self.clock(),
                terminate_at=rec.terminate_at,
                grace_deadline=rec.grace_deadline,
            )
        except TaintError as e:
            self.feed(rec.reclaim_id, TaintUnanswered(self.clock(), str(e)))
            return
        self.feed(rec.reclaim_id, TaintAnswered(self.clock()))

    async def _lift_remote_taint(self, rec: r.Reclamation) -> None:
        # A background retry of the taint must stop, or it could land after the lift and taint
        # (for a pause: disable) the node again; a Taint call still in flight (a frozen
        # coordinator) likewise: let it finish first, then lift.
        retry = self._taint_retries.pop(rec.reclaim_id, None)
        if retry is not None:
            retry.cancel()
        pending = self._taint_calls.pop(rec.reclaim_id, None)
        if pending is not None:
            await asyncio.gather(pending, return_exceptions=True)
        if rec.reason == "pause":
            await self.link.resume_until_answered(rec.reclaim_id)
        else:
            await self.link.taint_until_answered(rec.reclaim_id, rec.reason, remove=True)
        self.feed(rec.reclaim_id, TaintsLifted(self.clock()))

    async def _retry_taint(self, rec: r.Reclamation) -> None:
        # After the SIGTERMs the same step asked for: the coordinator has had its 800 ms, and a
        # call started beside the kill calls competes with them for the loop and the GIL.
        await asyncio.sleep(0)  # the round spawned in the same step takes the lock first
        async with self._signal_lock:
            pass
        await self.link.taint_until_answered(
            rec.reclaim_id,
            rec.reason,
            terminate_at=rec.terminate_at,
            grace_deadline=rec.grace_deadline,
        )
        self.feed(rec.reclaim_id, TaintAnswered(self.clock()))

    async def _signal_round(
        self,
        rid: str,
        signal: str,
        skip: frozenset[str],
        skip_kinds: frozenset[str],
        announced: tuple[str, ...] | None = None,
    ) -> None:
        async with self._signal_lock:
            ahead = self._listed_ahead.pop(rid, None)
            if announced is not None:
                # Listed ahead and announced in the step that asked for the round (saved). No
                # listing left: the lift that dropped it also ended the round.
                chosen = set(announced)
                found = await ahead if ahead is not None else []
                await self._send(rid, signal, [t for t in found if t.id in chosen])
                return
            if ahead is not None and signal != SIGTERM:
                ahead.cancel()  # no SIGTERM round came first (a notice past G): list afresh
                ahead = None
            if ahead is not None:
                found = [t for t in await ahead if t.id not in skip and t.kind not in skip_kinds]
            else:
                found = await self.docker.targets(skip, skip_kinds)
            if signal == SIGTERM:  # at most once per container, whichever reclamation sent it
                already = self._sigtermed_elsewhere(rid)
                found = [t for t in found if t.id not in already]
            listed = RoundListed(
                self.clock(),
                signal,
                tuple(RoundTarget(t.id, t.name, t.kind, t.image) for t in found),
            )
            answer: asyncio.Future[tuple[str, ...]] = asyncio.get_running_loop().create_future()
            self._queue.put_nowait(("listed", (rid, listed, answer)))
            approved = set(await answer)  # announced, and the bundle saved
            await self._send(rid, signal, [t for t in found if t.id in approved])

    async def _send(self, rid: str, signal: str, targets: list[ContainerInfo]) -> None:
        async for result in self.docker.signal_each(targets, signal):
            self.feed(rid, result)
        self.link.release_events(rid)  # the notice path is done: its events may go
        self.feed(rid, SignalRoundDone(self.clock(), signal))

    def _others(self, rid: str) -> list[r.Reclamation]:
        return [o for o in (*self.live.values(), *self.recent.values()) if o.reclaim_id != rid]

    def _earliest_other(self, rec: r.Reclamation) -> r.Reclamation | None:
        """The other reclamation in force with the earliest grace deadline, if any."""
        others = [o for o in self._others(rec.reclaim_id) if not o.lifted and not o.finished]
        return min(others, key=lambda o: o.grace_deadline, default=None)

    def _sigtermed_elsewhere(self, rid: str) -> set[str]:
        """Containers another reclamation has SIGTERMed (or announced): a second notice for
        the same machine (two sources, one preemption) must not signal them again."""
        terms = (TERM_ANNOUNCED, TERM_SENT, TERM_BY_PREVIOUS_RUN)
        return {
            c
            for o in self._others(rid)
            for c in (*o.announced, *o.signalled)
            if ledger(o, c) in terms
        }

    async def _watch_exit(self, rid: str, container_id: str, name: str) -> None:
        exited = await self.docker.wait_exit(container_id, name)
        # What it reported before it exited is recorded before its exit (docs/design.md
        # "Workload status directory"): every report it wrote is complete by now.
        self.status.collect(name)
        self.feed(rid, exited)

    # --- workload reports --------------------------------------------------------------------

    def _reclamation_for(self, name: str) -> r.Reclamation | None:
        """The live reclamation a container's report belongs to: the one that knows it (it
        signalled or gated it), else the newest one still draining (it may not have reached
        it yet: the machine holds the report until it does)."""
        draining = [rec for rec in self.live.values() if not rec.lifted and rec.phase != "done"]
        known = [rec for rec in draining if name in rec.names.values()]
        pool = known or draining
        return max(pool, key=lambda rec: rec.t0, default=None)

    def _on_report(self, name: str, report: Report) -> None:
        rec = self._reclamation_for(name)
        if rec is None:
            # A periodic checkpoint outside any reclamation: nothing to put it in.
            log.debug(
                "node %s: report from %s outside a reclamation: %s", self.cfg.node_id, name, report
            )
            return
        self.feed(
            rec.reclaim_id,
            WorkloadReported(
                self.clock(), name, report.kind, report.generation, report.nbytes, report.at
            ),
        )

    def _on_report_invalid(self, name: str, entry: str, why: str) -> None:
        rec = self._reclamation_for(name)
        now = self.clock()
        self._emit(
            "workload_report_invalid",
            rec.reclaim_id if rec else "",
            now - rec.t0 if rec else None,
            now,
            {"name": name, "file": entry, "reason": why},
        )

    async def _observe(self, rid: str) -> None:
        """Verification by observation: Docker and NVML must both answer, and both be empty."""
        errors = []
        running: tuple[str, ...] = ()
        rentals: tuple[str, ...] = ()
        pids: tuple[int, ...] = ()
        docker_result, gpu_result = await asyncio.gather(
            self.docker.running(), self.nvml.processes(), return_exceptions=True
        )
        if isinstance(docker_result, DockerUnavailable):
            errors.append(f"docker: {docker_result}")
        elif isinstance(docker_result, BaseException):
            raise docker_result
        else:
            running = tuple(c.id for c in docker_result)
            rentals = tuple(c.id for c in docker_result if c.kind == RENTAL_KIND)
        if isinstance(gpu_result, GpuError):
            errors.append(f"nvml: {gpu_result}")
        elif isinstance(gpu_result, BaseException):
            raise gpu_result
        else:
            pids = tuple(p.pid for p in gpu_result)
        log.debug(
            "node %s reclamation %s: observed containers %s, GPU pids %s, errors %s",
            self.cfg.node_id,
            rid,
            running,
            pids,
            errors,
        )
        self.feed(rid, Observed(self.clock(), running, pids, "; ".join(errors), rentals))
