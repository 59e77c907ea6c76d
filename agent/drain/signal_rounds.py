"""Signal rounds, exit watches and observations: the node's work units (containers, Slurm
jobs: agent/workloads/managers.py) and GPUs, each answer reported back as an event for its
reclamation.

A signal round lists its targets, hands them to the node (RoundListed, through the runner's
queue) and waits for its answer (DeliverSignals), which comes after the bundle holding the
announcement is saved: a restarted agent then knows which containers may have had their SIGTERM
(at most once; the node core leaves out what another reclamation SIGTERMed). The first SIGTERM
round skips that exchange when the listing made while the Taint call was in flight is back by
the answer: the answer's own step announces it (one save, not two, between the taint and the
SIGTERMs). Rounds run one after another, in the order asked, so a SIGKILL round never overtakes
the SIGTERM round before it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from spotdrain.agent.core.reclamation import Reclamation
from spotdrain.agent.core.reclamation_commands import SIGTERM, SignalContainers
from spotdrain.agent.core.reclamation_events import (
    Event,
    Observed,
    RoundListed,
    RoundTarget,
    SignalRoundDone,
)
from spotdrain.agent.drain.link import CoordinatorLink
from spotdrain.agent.drain.taint_calls import Spawn
from spotdrain.agent.host.gpu import GpuError, Nvml
from spotdrain.agent.workloads.managers import Hold, WorkManagers
from spotdrain.agent.workloads.status_dirs import StatusDirs

log = logging.getLogger("spotdrain.agent.drain")

T = TypeVar("T")
Answer = asyncio.Future[tuple[str, ...]]


class SignalRounds:
    def __init__(
        self,
        node_id: str,
        work: WorkManagers,
        nvml: Nvml,
        link: CoordinatorLink,
        status: StatusDirs,
        feed: Callable[[str, Event], None],
        ask: Callable[[str, RoundListed, Answer], None],
        spawn: Spawn,
        clock: Callable[[], float],
    ) -> None:
        self.node_id = node_id
        self.work = work
        self.nvml = nvml
        self.link = link
        self.status = status
        self._feed = feed
        self._ask = ask  # the round's listing to the node, answered by deliver()
        self._spawn = spawn
        self._clock = clock
        self.lock = asyncio.Lock()
        # The round waiting for the node's DeliverSignals (at most one: rounds hold the lock).
        self.answer: Answer | None = None
        # The node's units, listed while the Taint call is in flight (after each manager's own
        # cordon, Slurm's DRAIN, landed or the taint's 800 ms passed): the first SIGTERM round
        # signals these at once when the taint lands instead of listing then. One started in
        # between is not lost: the observation right after the round sees it and the stray
        # round signals it (invariant 1 holds either way: nothing is signalled before a taint).
        self.listed_ahead: dict[str, asyncio.Task[list[Any]]] = {}

    # --- the listing made during the Taint call ----------------------------------------------

    def list_ahead(self, rec: Reclamation, answer_by: float) -> None:
        if rec.reclaim_id not in self.listed_ahead:
            cordons = self.work.cordon(Hold(rec.reclaim_id, rec.grace_deadline, rec.terminate_at))
            self.listed_ahead[rec.reclaim_id] = asyncio.ensure_future(
                self.work.listed_after(cordons, answer_by, self._clock)
            )

    def drop_listing(self, rid: str) -> None:
        ahead = self.listed_ahead.pop(rid, None)
        if ahead is not None:
            ahead.cancel()

    def listing(self, rid: str) -> tuple[RoundTarget, ...] | None:
        """The listing made ahead, if it is back (the node decides whether it counts)."""
        ahead = self.listed_ahead.get(rid)
        if ahead is None or not ahead.done() or ahead.cancelled() or ahead.exception():
            return None
        return tuple(RoundTarget(t.id, t.name, t.kind, t.image) for t in ahead.result())

    def listings(self, rids: Iterable[str]) -> dict[str, tuple[RoundTarget, ...]]:
        return {rid: found for rid in rids if (found := self.listing(rid)) is not None}

    # --- rounds ------------------------------------------------------------------------------

    def start(self, rid: str, cmd: SignalContainers) -> None:
        self._spawn(self._round(rid, cmd))

    def deliver(self, containers: tuple[str, ...]) -> None:
        """The node's answer to the round waiting (after the bundle was saved)."""
        if self.answer is not None and not self.answer.done():
            self.answer.set_result(containers)

    async def _round(self, rid: str, cmd: SignalContainers) -> None:
        signal, skip, skip_kinds = cmd.signal, cmd.skip, cmd.skip_kinds
        async with self.lock:
            ahead = self.listed_ahead.pop(rid, None)
            if cmd.announced is not None:
                # Listed ahead and announced in the step that asked for the round (saved). No
                # listing left: the lift that dropped it also ended the round.
                chosen = set(cmd.announced)
                found = await ahead if ahead is not None else []
                await self._send(rid, signal, [t for t in found if t.id in chosen])
                return
            if ahead is not None and signal != SIGTERM:
                ahead.cancel()  # no SIGTERM round came first (a notice past G): list afresh
                ahead = None
            if ahead is not None:
                found = [t for t in await ahead if t.id not in skip and t.kind not in skip_kinds]
            else:
                found = await self.work.targets(skip, skip_kinds)
            listed = RoundListed(
                self._clock(),
                signal,
                tuple(RoundTarget(t.id, t.name, t.kind, t.image) for t in found),
            )
            answer: Answer = asyncio.get_running_loop().create_future()
            self._ask(rid, listed, answer)
            approved = set(await answer)  # announced, and the bundle saved
            await self._send(rid, signal, [t for t in found if t.id in approved])

    async def _send(self, rid: str, signal: str, targets: list[Any]) -> None:
        async for result in self.work.signal_each(targets, signal):
            self._feed(rid, result)
        self.link.release_events(rid)  # the notice path is done: its events may go
        self._feed(rid, SignalRoundDone(self._clock(), signal))

    # --- exits and observations --------------------------------------------------------------

    def watch_exit(self, rid: str, container_id: str, name: str) -> None:
        self._spawn(self._watch_exit(rid, container_id, name))

    async def _watch_exit(self, rid: str, container_id: str, name: str) -> None:
        exited = await self.work.wait_exit(container_id, name)
        # What it reported before it exited is recorded before its exit (docs/design.md
        # "Workload status directory"): every report it wrote is complete by now.
        self.status.collect(name)
        self._feed(rid, exited)

    def observe(self, rid: str) -> None:
        self._spawn(self._observe(rid))

    async def _observe(self, rid: str) -> None:
        """Verification by observation: every work manager and NVML must answer, and all be
        empty."""
        errors: list[str] = []
        look, gpu_result = await asyncio.gather(
            self.work.look(), self.nvml.processes(), return_exceptions=True
        )
        if isinstance(look, BaseException):
            raise look  # a manager answers its own failures in its Look: this is a bug
        if look.error:
            errors.append(look.error)
        gpu_processes = _observed(gpu_result, GpuError, "nvml", errors) or []
        pids = tuple(p.pid for p in gpu_processes)
        log.debug(
            "node %s reclamation %s: observed units %s, GPU pids %s, errors %s",
            self.node_id,
            rid,
            look.running,
            pids,
            errors,
        )
        self._feed(
            rid, Observed(self._clock(), look.running, pids, "; ".join(errors), look.rentals)
        )

    def close(self) -> None:
        for ahead in self.listed_ahead.values():
            ahead.cancel()


def _observed(
    result: T | BaseException, expected: type[Exception], what: str, errors: list[str]
) -> T | None:
    """One adapter's answer from gather(): its expected failure is noted in `errors` (None: the
    observation is incomplete, never empty); anything else is a bug and raised."""
    if isinstance(result, expected):
        errors.append(f"{what}: {result}")
        return None
    if isinstance(result, BaseException):
        raise result
    return result
