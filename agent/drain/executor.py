"""Carrying out what the node's core (agent/core/node.py) asks: each reclamation's step saved
before any of its commands runs (write before act, docs/design.md step 2), the deadline file,
the taint calls, the signal rounds, the events to the outbox; and what the disk refused,
written again every `retry_writes_s`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from spotdrain.agent.core import reclamation as r
from spotdrain.agent.core.node import Node
from spotdrain.agent.core.reclamation_commands import (
    SIGTERM,
    ApplyLocalTaint,
    Command,
    CutWorkers,
    DeliverSignals,
    DrainWorkers,
    Emit,
    ForgetBundles,
    LiftTaints,
    NodeCommand,
    Observe,
    Record,
    ReleaseEvents,
    RemoveDeadlineFile,
    RequestTaint,
    ResumeCoordinator,
    RetryRemoteTaint,
    Settled,
    SignalContainers,
    Stepped,
    StopResumingCoordinator,
    WatchExits,
    WriteDeadlineFile,
)
from spotdrain.agent.core.reclamation_events import Event, WorkersDraining
from spotdrain.agent.drain.deadline_file import DeadlineFile
from spotdrain.agent.drain.link import CoordinatorLink
from spotdrain.agent.drain.outbox import Outbox
from spotdrain.agent.drain.signal_rounds import SignalRounds
from spotdrain.agent.drain.state import BundleStore, LocalTaints
from spotdrain.agent.drain.taint_calls import TaintCalls
from spotdrain.agent.workloads.inference import WorkerManager
from spotdrain.protocol.events import EventRecord
from spotdrain.runtime.metrics import ReclamationMetrics

log = logging.getLogger("spotdrain.agent.drain")
# A drain step's events reach the outbox this long after the step: its bundle holds them
# already, and the outbox's fsync then overlaps the calls the step started (the Taint, the
# kills) instead of going before them.
STORE_EVENTS_AFTER_S = 0.002


class Executor:
    def __init__(
        self,
        node_id: str,
        node: Node,
        outbox: Outbox,
        link: CoordinatorLink,
        workers: WorkerManager,
        bundles: BundleStore,
        local_taints: LocalTaints,
        deadline_file: DeadlineFile,
        rounds: SignalRounds,
        taints: TaintCalls,
        feed: Callable[[str, Event], None],
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
        clock: Callable[[], float],
        retry_writes_s: float,
        metrics: ReclamationMetrics | None = None,
    ) -> None:
        self.node_id = node_id
        self.node = node
        self.outbox = outbox
        self.link = link
        self.workers = workers
        self.bundles = bundles
        self.local_taints = local_taints
        self.deadline_file = deadline_file
        self.rounds = rounds
        self.taints = taints
        self.feed = feed
        self._spawn = spawn
        self.clock = clock
        self.retry_writes_s = retry_writes_s
        self.metrics = metrics
        self.next_write_retry: float | None = None
        self._blind_resume: asyncio.Task[None] | None = None
        self._store_events: asyncio.TimerHandle | None = None
        # Sources waiting for a reclamation to settle (a logind lock, an Azure acknowledgement).
        self.settling: dict[str, list[asyncio.Future[str]]] = {}

    def carry_out(self, commands: list[NodeCommand]) -> None:
        for cmd in commands:
            match cmd:
                case WriteDeadlineFile():
                    # Before the bundle (harmless: a restarted agent writes it again, or
                    # removes it); whether it was written is in its event (see _event).
                    if not self.deadline_file.show(cmd):
                        self._retry_writes_soon(again=True)
                case RemoveDeadlineFile():
                    self.deadline_file.remove()
                case Stepped(rid, steps):
                    rec = self.node.get(rid)
                    if rec is None:  # a bug in the core: never carry out a step blind
                        raise RuntimeError(f"node {self.node_id}: {rid} stepped and let go")
                    self._apply(rec, list(steps))
                case Record(kind, rid, t_offset_s, details):
                    self.emit(kind, rid, t_offset_s, self.clock(), details)
                case ResumeCoordinator():
                    self._blind_resume = self._spawn(self.link.resume_until_answered(""))
                case StopResumingCoordinator():
                    if self._blind_resume is not None:
                        self._blind_resume.cancel()  # an old resume must not end a new pause
                case ReleaseEvents(rid):
                    self.link.release_events(rid)
                case Settled(rid, outcome):
                    for waiter in self.settling.get(rid, ()):
                        if not waiter.done():
                            waiter.set_result(outcome)
                case ForgetBundles(rids):
                    for rid in rids:
                        self.bundles.forget(rid)
                case _:
                    raise TypeError(cmd)

    def _apply(self, rec: r.Reclamation, commands: list[Command]) -> None:
        """Carry out one step: the bundle is written before any command runs (write before
        act), and it holds every event of the reclamation the outbox has not stored yet (this
        step's, and an earlier step's still waiting for STORE_EVENTS_AFTER_S), so a SIGKILL
        or a power cut before the outbox's write loses none: a restarted agent puts them into
        the outbox again (by uid, so once)."""
        events = [self._event(rec, c) for c in commands if isinstance(c, Emit)]
        self._save(rec, events)
        # The step's events wait in memory (and go out to the coordinator) while the calls it
        # started get under way; its bundle holds them meanwhile.
        with self.outbox.hold(store=False):
            self._execute(rec, commands, iter(events))
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

    def _event(self, rec: r.Reclamation, emit: Emit) -> EventRecord:
        now = self.clock() if emit.at is None else emit.at
        details = emit.details
        if emit.kind == "deadline_file_written" and self.deadline_file.unwritten is not None:
            details = {**details, "written": False}  # see state_write_failed
        return self.outbox.event(
            emit.kind, self.node_id, rec.reclaim_id, now, now - rec.t0, details
        )

    def _save(self, rec: r.Reclamation, events: list[EventRecord] | None = None) -> None:
        """The bundle before any command runs, with the step's new events and every earlier one
        of the reclamation the outbox has not stored; on a refusal, the drain goes on from
        memory."""
        unstored = [*self.outbox.unstored(rec.reclaim_id), *(events or [])]
        if not self.bundles.save(rec, unstored):
            self._retry_writes_soon()

    def _store_held(self) -> None:
        self._store_events = None
        self.outbox.store_held()

    def _execute(
        self, rec: r.Reclamation, commands: list[Command], events: Iterator[EventRecord]
    ) -> None:
        rid = rec.reclaim_id
        for cmd in commands:
            match cmd:
                case Emit():
                    self._put(next(events))
                case RequestTaint(_, answer_by):
                    self.taints.request(rec, answer_by)
                    self.rounds.list_ahead(rec, answer_by)
                case ApplyLocalTaint():
                    self.local_taints.apply(rid)  # held in memory if the disk refuses it
                    if self.local_taints.dirty:
                        self._retry_writes_soon(again=True)
                case RetryRemoteTaint():
                    self.taints.retry(rec)
                case LiftTaints():
                    self.rounds.drop_listing(rid)
                    self.local_taints.lift(rid)  # held in memory if the disk refuses it
                    if self.local_taints.dirty or self.deadline_file.unwritten:
                        self._retry_writes_soon()
                    self.taints.lift(rec)
                    self.rounds.work.uncordon(rid)
                case SignalContainers(signal):
                    if signal == SIGTERM and not rec.sigterm_round_done:
                        # The first round only (a stray one may be asked at every look while a
                        # rental runs on: holding for each would starve the stream). This
                        # step's events (tainted, ...) and later ones wait on the stream
                        # until the round has sent: stored by the coordinator meanwhile, they
                        # would share the cores with the engine's kills. The notice's own
                        # events went before the Taint call, so the coordinator stores the
                        # notice before its reactions to the taint.
                        self.link.hold_events(rid)
                    self.rounds.start(rid, cmd)
                case DeliverSignals(_, containers):
                    # After the save above: the announcement is on disk before any signal.
                    self.rounds.deliver(containers)
                case DrainWorkers(_, grace_deadline):
                    gated = self.workers.drain(None, grace_deadline, rid)
                    names = tuple(
                        w.name for w in self.workers.workers.values() if w.container_id in gated
                    )
                    if gated:
                        self.feed(rid, WorkersDraining(self.clock(), tuple(gated), names))
                case CutWorkers():
                    self.workers.cut_all()
                case WatchExits(containers):
                    for cid in containers:
                        self.rounds.watch_exit(rid, cid, rec.names.get(cid, cid[:12]))
                case Observe():
                    self.rounds.observe(rid)
                case _:  # WriteDeadlineFile is the node's (_carry_out), never a step's
                    raise TypeError(cmd)

    # --- state the disk refused --------------------------------------------------------------

    def _retry_writes_soon(self, again: bool = False) -> None:
        if again or self.next_write_retry is None:
            self.next_write_retry = self.clock() + self.retry_writes_s

    def retry_writes_when_due(self) -> None:
        if self.next_write_retry is not None and self.clock() >= self.next_write_retry:
            self._retry_writes()

    def _retry_writes(self) -> None:
        """Write again what the disk refused; keep trying every retry_writes_s until it all
        went (the promise does not wait for it: the state it stands for is in memory)."""
        done = self.bundles.retry()
        done = self.local_taints.retry() and done
        done = self.deadline_file.retry() and done
        done = self.outbox.retry() and done
        self.next_write_retry = None if done else self.clock() + self.retry_writes_s

    # --- events outside a step ---------------------------------------------------------------

    def emit(
        self, kind: str, reclaim_id: str, t_offset_s: float | None, now: float, details: dict
    ) -> None:
        """An event outside a drain step (a disk's refusal, an invalid notice): no bundle."""
        self._put(self.outbox.event(kind, self.node_id, reclaim_id, now, t_offset_s, details))

    def _put(self, event: EventRecord) -> None:
        self.outbox.put(event)
        self.link.wake()
        if self.metrics is not None:
            self.metrics.observe_event(
                event.kind, event.reclaim_id, event.t_offset_s, event.details
            )
        log.info(
            "node %s reclamation %s: %s %s",
            self.node_id,
            event.reclaim_id or "-",
            event.kind,
            event.details or "",
        )

    def close(self) -> None:
        if self._store_events is not None:
            self._store_events.cancel()
            self._store_held()
