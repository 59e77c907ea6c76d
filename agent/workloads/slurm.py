"""Slurm as a work manager: this node's jobs drained with Slurm's own controls.

- Cordon: `State=DRAIN` with a reason of our own prefix, before the listing the first SIGTERM
  round uses (a job that started meanwhile is not missed; none starts after it). It shares the
  taint's 800 ms: a controller that has not answered by then is retried in the background,
  and the round signals what the node's own slurmstepd lists (`scontrol listpids`).
- SIGTERM: a requeueable batch job is requeued (it restarts elsewhere, from its checkpoint);
  any other job is cancelled. Slurm sends SIGCONT and SIGTERM to every process of every step
  (srun's tasks get TERM from their own slurmstepd; srun itself, signalled directly, would turn
  TERM into KILL). Without the controller, the agent signals the steps' processes itself, srun
  left out, and requeues the job once the controller answers.
- SIGKILL (at G): to the processes `listpids` finds, never `scancel --signal=KILL` (after a
  requeue it kills nothing and turns the job CANCELLED, so it never restarts).
- Look: empty only when the node is `drained` (not `draining`), the controller lists no job on
  it, and `listpids` finds no step. A controller that does not answer is an error, never empty.
- Uncordon: `State=RESUME`, only while the reason is still ours: an administrator's drain is
  never undone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

from spotdrain.agent.core.reclamation_commands import SIGTERM
from spotdrain.agent.core.reclamation_events import (
    ContainerExited,
    ContainerSignalled,
    ManagerNoted,
)
from spotdrain.agent.workloads.managers import Hold, Look, Note
from spotdrain.agent.workloads.settings import SlurmSettings
from spotdrain.agent.workloads.slurm_cli import SlurmCli, SlurmError
from spotdrain.agent.workloads.slurm_units import (
    KIND,
    UNIT_PREFIX,
    SlurmUnit,
    exit_code_of,
    job_of,
    signal_process,
    unit_id,
    unit_of,
)
from spotdrain.runtime.cli import UsageError

log = logging.getLogger("spotdrain.agent.slurm")

REASON_PREFIX = "spotdrain:"
RETRY_S = 1.0  # a controller call that failed is tried again this often
EXIT_POLL_S = 0.5  # how often a signalled job's exit is looked for


def reason_for(hold: Hold) -> str:
    until = datetime.fromtimestamp(hold.terminate_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"{REASON_PREFIX} {hold.reclaim_id} until {until}"


class SlurmWork:
    name = "slurm"

    def __init__(
        self,
        settings: SlurmSettings,
        note: Note,
        clock: Callable[[], float] = time.time,
        cli: SlurmCli | None = None,
    ) -> None:
        self.settings = settings
        self.node = settings.node_name
        self.cli = cli or SlurmCli(settings.bin_dir, settings.conf, settings.call_timeout_s)
        self._note = note
        self._clock = clock
        self.holds: dict[str, Hold] = {}  # the reclamations the DRAIN is for
        self._last_hold = ""  # the reclamation a late requeue is recorded in
        self._landed: asyncio.Future[None] | None = None
        self._cordoning: asyncio.Task[None] | None = None
        self._resuming: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # ClusterName as slurmctld said at start ("" when it did not answer then): sent at
        # registration, never waited for.
        self.cluster = ""
        self.kill_wait_s: int | None = None  # read at start; KillWait rarely changes

    def owns(self, unit: str) -> bool:
        return unit.startswith(UNIT_PREFIX)

    # --- cordon and lift ---------------------------------------------------------------------

    def cordon(self, hold: Hold) -> asyncio.Future[None]:
        self.holds[hold.reclaim_id] = hold
        self._last_hold = hold.reclaim_id
        if self._resuming is not None:
            self._resuming.cancel()  # a lift still trying must not undo this new drain
            self._resuming = None
        if self._landed is None:
            self._landed = asyncio.get_running_loop().create_future()
            self._cordoning = asyncio.create_task(self._drain(hold, self._landed))
        return self._landed

    async def _drain(self, hold: Hold, landed: asyncio.Future[None]) -> None:
        failed = False
        while True:
            started = self._clock()
            try:
                reason = await self._drain_once(hold)
                break
            except SlurmError as e:
                if not failed:
                    self._say(hold.reclaim_id, "manager_cordon_failed", error=str(e))
                failed = True
            await asyncio.sleep(RETRY_S)
        ms = round((self._clock() - started) * 1000, 1)
        landed.set_result(None)
        self._say(hold.reclaim_id, "manager_cordoned", node_name=self.node, reason=reason, ms=ms)
        await self._check_kill_wait(hold, self._clock())

    async def _drain_once(self, hold: Hold) -> str:
        """DRAIN with our reason, unless an administrator's drain already holds the node: their
        reason is never replaced (nor lifted by our resume later). The reason in force."""
        info = await self.cli.node(self.node)
        if "DRAIN" in info.flags and not info.reason.startswith(REASON_PREFIX):
            return info.reason
        reason = reason_for(hold)
        await self.cli.drain(self.node, reason)
        return reason

    async def _check_kill_wait(self, hold: Hold, sigterm_at: float) -> None:
        """slurmd SIGKILLs a job KillWait after its SIGTERM: before G the job loses the grace
        it was promised; after D the provider takes the host first."""
        kill_wait = self.kill_wait_s
        if kill_wait is None:  # not read at start (slurmctld away then): read it now
            try:
                kill_wait = self.kill_wait_s = await self.cli.kill_wait_s()
            except SlurmError as e:
                log.warning("node %s: cannot read KillWait: %s", self.node, e)
                return
        kill_at = sigterm_at + kill_wait
        why = ""
        if kill_at < hold.grace_deadline:
            why = f"slurmd's SIGKILL comes {hold.grace_deadline - kill_at:.0f} s before G"
        elif kill_at > hold.terminate_at:
            why = f"slurmd's SIGKILL comes {kill_at - hold.terminate_at:.0f} s after D"
        if why:
            self._say(hold.reclaim_id, "kill_wait_warning", kill_wait_s=kill_wait, why=why)

    def uncordon(self, reclaim_id: str) -> None:
        self.holds.pop(reclaim_id, None)
        if self.holds:
            return  # another reclamation still needs the node drained
        # Also with no hold in memory (an agent restarted mid-drain): the DRAIN is lifted
        # only while its reason is still ours.
        if self._cordoning is not None:
            self._cordoning.cancel()
        self._landed = self._cordoning = None
        self._resuming = asyncio.create_task(self._resume(reclaim_id))

    async def _resume(self, reclaim_id: str) -> None:
        while True:
            try:
                info = await self.cli.node(self.node)
                if not info.reason.startswith(REASON_PREFIX):
                    return  # an administrator's drain (or none): never ours to undo
                await self.cli.resume(self.node)
                break
            except SlurmError as e:
                log.warning("node %s: resume not answered (%s); trying again", self.node, e)
            await asyncio.sleep(RETRY_S)
        self._say(reclaim_id, "manager_uncordoned", node_name=self.node)

    async def check_node(self) -> None:
        """At start: a node name slurmctld does not know is a configuration error (exit 2); a
        controller that does not answer is not (the drain works without it). Reads the
        cluster's name while it answers."""
        try:
            await self.cli.node(self.node)
        except SlurmError as e:
            if "not found" in str(e).lower():
                raise UsageError(
                    f"workloads.slurm.node_name {self.node!r}: slurmctld knows no such node"
                ) from None
            log.warning("node %s: slurmctld did not answer at start: %s", self.node, e)
            return
        try:
            self.cluster = await self.cli.cluster_name()
            # Read now, not beside a drain's first calls, where it would compete with them.
            self.kill_wait_s = await self.cli.kill_wait_s()
        except SlurmError as e:
            log.warning("node %s: cluster name or KillWait not read: %s", self.node, e)

    async def resume_stale(self) -> bool:
        """A host back from a reclamation (a new boot) with our DRAIN still set and no
        reclamation open: resume it once. True when it did."""
        if self.holds:
            return False
        try:
            info = await self.cli.node(self.node)
            if not info.reason.startswith(REASON_PREFIX):
                return False
            await self.cli.resume(self.node)
        except SlurmError as e:
            log.warning("node %s: cannot lift an old drain: %s", self.node, e)
            return False
        log.info("node %s: lifted the drain left from before (%s)", self.node, info.reason)
        return True

    # --- listing and signals -----------------------------------------------------------------

    async def targets(self, skip: frozenset[str], skip_kinds: frozenset[str]) -> list[Any]:
        """The controller's jobs on this node, and every job the node's own slurmstepd still
        runs steps of: a cancelled job is COMPLETING (squeue leaves it out) until its last
        process is gone, and without the controller the steps are all there is to list."""
        if KIND in skip_kinds:
            return []
        units: dict[int, SlurmUnit] = {}
        local = asyncio.ensure_future(self._local_jobs())  # beside squeue: on the notice path
        if not self._controller_away():
            try:
                units = {j.job_id: unit_of(j) for j in await self.cli.jobs_on(self.node)}
            except SlurmError as e:
                log.warning("node %s: squeue failed (%s); listing steps locally", self.node, e)
        for job in await local:
            units.setdefault(job, SlurmUnit(unit_id(job), f"job {job}", job))
        return [u for u in units.values() if u.id not in skip]

    def _controller_away(self) -> bool:
        """A DRAIN asked for and not landed: slurmctld did not answer within the taint's
        800 ms, so nothing on the notice path waits for it (nor for call_timeout_s)."""
        return self._landed is not None and not self._landed.done()

    async def _local_jobs(self) -> list[int]:
        try:
            return sorted(await self.cli.listpids(self.node))
        except SlurmError as e:
            log.warning("node %s: listpids failed: %s", self.node, e)
            return []

    async def signal_each(
        self, targets: list[Any], signal: str
    ) -> AsyncIterator[ContainerSignalled]:
        tasks = [asyncio.create_task(self._signal_one(u, signal)) for u in targets]
        for done in asyncio.as_completed(tasks):
            yield await done

    async def _signal_one(self, unit: SlurmUnit, signal: str) -> ContainerSignalled:
        job = unit.job_id
        controller_error = ""
        if signal == SIGTERM:
            requeue = self.settings.requeue and unit.requeue
            if not self._controller_away():
                try:
                    if requeue:
                        await self.cli.requeue(job)
                    else:
                        await self.cli.cancel(job)
                    return self._signalled(unit, signal, "requeue" if requeue else "scancel")
                except SlurmError as e:
                    controller_error = str(e)
            else:
                # The DRAIN has not landed within the taint's 800 ms: the controller is away,
                # and the provider's deadline does not wait for it (nor for call_timeout_s).
                controller_error = "slurmctld has not answered the DRAIN"
            # Signal the steps ourselves; requeue once it answers, so the job still restarts
            # elsewhere from its checkpoint.
            if self.settings.requeue:
                self._spawn(self._requeue_later(unit))
        try:
            pids = (await self.cli.listpids(self.node, job)).get(job, [])
        except SlurmError as e:
            return self._signalled(unit, signal, "pid", f"{controller_error}; listpids: {e}")
        errors = [err for pid in pids if (err := signal_process(pid, signal))]
        if errors:
            return self._signalled(unit, signal, "pid", "; ".join(errors))
        return self._signalled(unit, signal, "pid")

    async def _requeue_later(self, unit: SlurmUnit) -> None:
        """Once the controller answers: requeue the job if it may be (a unit listed by
        listpids alone did not say). Never `scancel`: its processes had their SIGTERM."""
        rid = self._last_hold
        while True:
            try:
                info = await self.cli.job(unit.job_id)
                if info is None or not (info.requeue and info.batch):
                    return
                await self.cli.requeue(unit.job_id)
                break
            except SlurmError as e:
                log.info("node %s: requeue of %s not answered yet: %s", self.node, unit.id, e)
            await asyncio.sleep(RETRY_S)
        if rid:
            self._say(rid, "requeued", unit=unit.id, name=info.name, late=True)

    def _signalled(
        self, unit: SlurmUnit, signal: str, via: str, error: str = ""
    ) -> ContainerSignalled:
        return ContainerSignalled(
            self._clock(), unit.id, unit.name, signal, via, error=error, kind=KIND
        )

    async def wait_exit(self, unit: str, name: str) -> ContainerExited:
        """The job has left this node: no step of it here any more, and (when the controller
        answers) not listed on this node. Its state and exit code as the controller says."""
        job = job_of(unit)
        while True:
            if await self._left(job):
                try:
                    info = await self.cli.job(job)
                except SlurmError:
                    info = None  # the controller is away: the steps' end is the exit
                if info is not None and info.state == "COMPLETING":
                    await asyncio.sleep(EXIT_POLL_S)  # its end state is a moment away
                    continue
                state = info.state if info is not None else ""
                return ContainerExited(self._clock(), unit, name, exit_code_of(info), state)
            await asyncio.sleep(EXIT_POLL_S)

    async def _left(self, job: int) -> bool:
        try:
            if (await self.cli.listpids(self.node, job)).get(job):
                return False
        except SlurmError:
            return False  # cannot tell: look again
        try:
            return job not in {j.job_id for j in await self.cli.jobs_on(self.node)}
        except SlurmError:
            return True

    # --- verification ------------------------------------------------------------------------

    async def look(self) -> Look:
        errors: list[str] = []
        running: list[str] = []
        try:
            steps = await self.cli.listpids(self.node)
            running += [unit_id(j) for j in sorted(steps)]
        except SlurmError as e:
            errors.append(f"slurm listpids: {e}")
        try:
            info = await self.cli.node(self.node)
            jobs = await self.cli.jobs_on(self.node)
        except SlurmError as e:
            errors.append(f"slurm controller: {e}")
        else:
            running += [u for j in jobs if (u := unit_id(j.job_id)) not in running]
            if not running and not info.drained:
                errors.append(f"slurm: node {self.node} is {info.state}, not drained")
        return Look(tuple(running), (), "; ".join(errors))

    async def delivered(self, since: float, until: float, units: set[str]) -> set[str] | None:
        return None  # Slurm keeps no record of who was signalled: each counts as sent

    # --- housekeeping ------------------------------------------------------------------------

    def _say(self, rid: str, kind: str, **details: Any) -> None:
        self._note(rid, ManagerNoted(self._clock(), kind, {"manager": self.name, **details}))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        for task in (self._cordoning, self._resuming, *self._tasks):
            if task is not None:
                task.cancel()
