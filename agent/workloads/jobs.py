"""Plain containers the coordinator asked for: rentals and batch or render jobs.

Neither has a slot gate or a route. A rental (StartRental) runs the renter's image until the
renter, the platform or a reclaim ends it; a job (StartWorker of kind batch or render) runs until
it exits. Both get the directory of the deadline file bind-mounted read-only (the directory, not
the file: the file is replaced by rename, and a file mount would keep the old inode), with
SPOTDRAIN_DEADLINE_FILE naming the file inside the container, and a status directory of their own
bind-mounted read-write at SPOTDRAIN_STATUS_DIR, for their checkpoint reports
(agent/workloads/status_dirs.py).

A drain needs nothing from here: the reclamation's signal rounds find these containers by their
labels (docs/design.md "Four drain paths"): jobs get SIGTERM after the taint and SIGKILL at G;
rentals are left alone until G (reclaim_at) and killed there. This manager starts them (only
while the agent accepts starts, invariant 4), watches each exit and reports it with its code,
stops a rental the coordinator ends, and adopts the running ones after an agent restart.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotdrain.agent.core.reclamation_commands import SIGKILL, SIGTERM
from spotdrain.agent.workloads.docker_engine import RENTAL_KIND, DockerEngine, DockerUnavailable
from spotdrain.agent.workloads.inference import MODEL_LABEL, WORKER_LABEL
from spotdrain.agent.workloads.status_dirs import CONTAINER_STATUS_DIR, make_status_dir
from spotdrain.protocol import kinds
from spotdrain.runtime.background import Background
from spotdrain.workload import DEADLINE_FILE_ENV, KIND_LABEL, NODE_LABEL, STATUS_DIR_ENV

log = logging.getLogger("spotdrain.agent.workloads.jobs")

RENTAL_LABEL = "spotdrain.rental"
RENTER_LABEL = "spotdrain.renter"
GPUS_LABEL = "spotdrain.gpus"
# Where the deadline file's directory appears inside every plain container.
CONTAINER_DEADLINE_DIR = "/run/spotdrain/workload"
# A StopRental: SIGTERM, then SIGKILL if the container is still there after this long.
STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class Launch:
    """What a start asks the engine for: the container's name, labels and environment."""

    kind: str  # a job kind, or RENTAL_KIND
    key: str  # the worker or rental id
    image: str
    name: str
    labels: dict[str, str]
    env: dict[str, str]


@dataclass
class PlainContainer:
    """One rental or job container on this node."""

    kind: str  # "rental", "batch" or "render"
    key: str  # the rental id, or the worker id of a job
    container_id: str
    name: str
    draining: bool = False  # a job the coordinator drained (heartbeats claim "draining")
    stop_reason: str | None = None  # why the coordinator stopped it (StopRental), once asked
    refused: bool = False  # started as the node closed: answered "refused", killed, no report
    exited: asyncio.Event = field(default_factory=asyncio.Event)


def container_name(prefix: str, key: str) -> str:
    """A Docker container name for an id the coordinator chose (Docker allows [\\w.-] only)."""
    return prefix + re.sub(r"[^a-zA-Z0-9_.-]", "-", key)


class PlainWorkloads:
    """Rentals (by rental id) and batch or render jobs (by worker id) on this node.

    Reports go to the coordinator through two callbacks, each taking the id and the report's
    fields as a dict (like WorkerManager):
    - `report_rental(rental_id, {...})` with RentalReport fields: "started" (with `container`)
      once the container runs, again for a repeated StartRental and on adoption; "stopped" (with
      `container`, `exit_code`, and `reason`: the StopRental's, else empty) when it exits for any
      reason (StopRental, the SIGKILL at G, the renter's own exit), exit_code -1 when it never
      started (Docker failed) or is unknown here; "refused" (with `reason`) while the agent
      refuses starts.
    - `report_worker(worker_id, {...})` with WorkerReport fields, the same states for jobs;
      "started" has no gate_address and capacity 0.
    """

    def __init__(
        self,
        node_id: str,
        docker: DockerEngine,
        deadline_file: Path,
        refuse_start: Callable[[], str | None],
        report_rental: Callable[[str, dict[str, Any]], None],
        report_worker: Callable[[str, dict[str, Any]], None],
        stop_grace_s: float = STOP_GRACE_S,
        status_root: Path | None = None,
    ) -> None:
        self.node_id = node_id
        self.docker = docker
        self.deadline_file = deadline_file
        self.refuse_start = refuse_start
        self.report_rental = report_rental
        self.report_worker = report_worker
        self.stop_grace_s = stop_grace_s
        self.status_root = status_root  # None: no status directories (reports are skipped)
        self.rentals: dict[str, PlainContainer] = {}
        self.jobs: dict[str, PlainContainer] = {}
        self.adopted = False  # adopt_running() has listed the engine once
        self._starting: set[tuple[str, str]] = set()  # (table, key) while its start runs
        self._stop_asked: dict[str, str] = {}  # StopRental for a rental still starting
        self._tasks = Background()

    # --- rentals -----------------------------------------------------------------------------

    async def start_rental(
        self, rental_id: str, image: str, gpus: int = 0, renter: str = ""
    ) -> None:
        """StartRental. Answered "started", "refused", or "stopped" with exit_code -1 when the
        container could not be started. A repeat while the first start runs is answered by it."""
        labels = {
            NODE_LABEL: self.node_id,
            KIND_LABEL: RENTAL_KIND,
            RENTAL_LABEL: rental_id,
            RENTER_LABEL: renter,
            GPUS_LABEL: str(gpus),
        }
        env = {"RENTAL_ID": rental_id}
        name = container_name("spotdrain-rental-", rental_id)
        await self._start(Launch(RENTAL_KIND, rental_id, image, name, labels, env))

    async def stop_rental(self, rental_id: str, reason: str = "") -> None:
        """StopRental: SIGTERM, then SIGKILL after the stop grace, each through the Docker API
        with its own timeout. The exit watcher reports "stopped" with the exit code."""
        why = reason or "stopped by the coordinator"
        rental = self.rentals.get(rental_id)
        if rental is None:
            if (RENTAL_KIND, rental_id) in self._starting:
                self._stop_asked[rental_id] = why  # stopped as soon as it runs
                return
            self.report_rental(
                rental_id,
                {"state": "stopped", "exit_code": -1, "reason": "not running on this node"},
            )
            return
        if rental.stop_reason is not None:
            return  # already stopping: its exit is reported once
        rental.stop_reason = why
        await self._stop(rental)

    # --- batch and render jobs ---------------------------------------------------------------

    async def start_job(
        self, worker_id: str, kind: str, image: str, model: str = "", port: int = 0
    ) -> None:
        """StartWorker of kind batch or render: a plain container, no gate, never routed."""
        if kind not in kinds.JOBS:
            raise ValueError(f"not a plain job kind: {kind!r}")
        labels = {
            NODE_LABEL: self.node_id,
            KIND_LABEL: kind,
            WORKER_LABEL: worker_id,
            MODEL_LABEL: model,
        }
        env = {"WORKER_ID": worker_id, "MODEL": model}
        if port:
            env["PORT"] = str(port)
        name = container_name("spotdrain-", worker_id)
        await self._start(Launch(kind, worker_id, image, name, labels, env))

    def drain_job(self, worker_id: str) -> bool:
        """DrainWorker for a job: nothing to do here (the reclamation's signal rounds SIGTERM it
        and SIGKILL it at G); remembered so heartbeats claim "draining". False: not a job."""
        job = self.jobs.get(worker_id)
        if job is None:
            return False
        job.draining = True
        return True

    def job_slots(self) -> list[tuple[str, int, int, str]]:
        """Jobs in the heartbeat's shape (worker, slots in use, capacity, claimed state)."""
        return [(j.key, 0, 0, "draining" if j.draining else "ready") for j in self.jobs.values()]

    # --- both --------------------------------------------------------------------------------

    def _table(self, kind: str) -> dict[str, PlainContainer]:
        return self.rentals if kind == RENTAL_KIND else self.jobs

    def _report(self, kind: str, key: str, report: dict[str, Any]) -> None:
        if kind == RENTAL_KIND:
            self.report_rental(key, report)
        else:
            self.report_worker(key, report)

    def _report_started(self, c: PlainContainer) -> None:
        if c.kind == RENTAL_KIND:
            self.report_rental(c.key, {"state": "started", "container": c.container_id})
        else:
            self.report_worker(c.key, {"state": "started", "gate_address": "", "capacity": 0})

    async def _start(self, launch: Launch) -> None:
        kind, key, name = launch.kind, launch.key, launch.name
        table = self._table(kind)
        running = table.get(key)
        if running is not None:
            if running.stop_reason is not None:
                self._report(kind, key, {"state": "refused", "reason": "it is being stopped"})
            else:
                self._report_started(running)  # a repeated command: the same answer
            return
        slot = (RENTAL_KIND if kind == RENTAL_KIND else "job", key)
        if slot in self._starting:
            return  # the start under way answers
        why = self.refuse_start()
        if why:
            log.warning("node %s: refused to start %s %s: %s", self.node_id, kind, key, why)
            self._report(kind, key, {"state": "refused", "reason": why})
            return
        self._starting.add(slot)
        try:
            container_id = await self._run(launch)
        finally:
            self._starting.discard(slot)
        if container_id is None:
            return
        c = PlainContainer(kind, key, container_id, name)
        table[key] = c
        self._spawn(self._watch_exit(c))
        stop = self._stop_asked.pop(key, None) if kind == RENTAL_KIND else None
        why = self.refuse_start()
        if why:
            # The node was tainted or paused while the container started (invariant 4): it
            # must not run on. Nothing in it has run long enough to lose.
            log.warning(
                "node %s: %s %s started as the node closed: %s", self.node_id, kind, key, why
            )
            c.refused = True
            c.stop_reason = why
            self._report(kind, key, {"state": "refused", "reason": why})
            await self.docker.kill(c.container_id, c.name, SIGKILL)
            return
        log.info("node %s: %s %s started (%s)", self.node_id, kind, key, name)
        self._report_started(c)
        if stop is not None:
            c.stop_reason = stop
            await self._stop(c)

    async def _run(self, launch: Launch) -> str | None:
        kind, key, image, name = launch.kind, launch.key, launch.image, launch.name
        host_dir = self.deadline_file.parent
        env = {
            **launch.env,
            DEADLINE_FILE_ENV: f"{CONTAINER_DEADLINE_DIR}/{self.deadline_file.name}",
        }
        binds = {str(host_dir): {"bind": CONTAINER_DEADLINE_DIR, "mode": "ro"}}
        try:
            host_dir.mkdir(parents=True, exist_ok=True)
            if self.status_root is not None:
                status = make_status_dir(self.status_root, name)
                binds[str(status)] = {"bind": CONTAINER_STATUS_DIR, "mode": "rw"}
                env[STATUS_DIR_ENV] = CONTAINER_STATUS_DIR
            container_id, _ = await self.docker.run_container(
                image, name=name, labels=dict(launch.labels), env=env, binds=binds
            )
        except (DockerUnavailable, OSError, ValueError) as e:
            log.warning("node %s: %s %s did not start: %s", self.node_id, kind, key, e)
            self._report(kind, key, {"state": "stopped", "exit_code": -1, "reason": str(e)})
            self._stop_asked.pop(key, None)
            return None
        return container_id

    async def _stop(self, c: PlainContainer) -> None:
        log.info("node %s: stopping %s %s: %s", self.node_id, c.kind, c.key, c.stop_reason)
        sent = await self.docker.kill(c.container_id, c.name, SIGTERM)
        if sent.error:
            log.warning("node %s: SIGTERM to %s: %s", self.node_id, c.name, sent.error)
        try:
            async with asyncio.timeout(self.stop_grace_s):  # (wait_for can swallow a cancel)
                await c.exited.wait()
            return
        except TimeoutError:
            pass
        sent = await self.docker.kill(c.container_id, c.name, SIGKILL)
        if sent.error:
            log.warning("node %s: SIGKILL to %s: %s", self.node_id, c.name, sent.error)

    async def _watch_exit(self, c: PlainContainer) -> None:
        exited = await self.docker.wait_exit(c.container_id, c.name)
        c.exited.set()
        table = self._table(c.kind)
        if table.get(c.key) is c:
            del table[c.key]
        log.info("node %s: %s %s exited with %d", self.node_id, c.kind, c.key, exited.exit_code)
        if c.refused:
            return  # answered "refused" already
        report: dict[str, Any] = {"state": "stopped", "exit_code": exited.exit_code}
        if c.kind == RENTAL_KIND:
            report["container"] = c.container_id
        if c.stop_reason:
            report["reason"] = c.stop_reason
        self._report(c.kind, c.key, report)

    async def adopt_running(self) -> None:
        """Agent restart: watch the running rentals and jobs again (found by their labels) and
        say they are started. Safe to call again: the ones already known are skipped."""
        for info in await self.docker.running(with_labels=True):
            labels = info.labels
            kind = labels.get(KIND_LABEL, "")
            if kind == RENTAL_KIND and labels.get(RENTAL_LABEL):
                key = labels[RENTAL_LABEL]
            elif kind in kinds.JOBS and labels.get(WORKER_LABEL):
                key = labels[WORKER_LABEL]
            else:
                continue  # inference workers (WorkerManager), or started by hand
            table = self._table(kind)
            if key in table:
                continue
            c = PlainContainer(kind, key, info.id, info.name)
            table[key] = c
            self._spawn(self._watch_exit(c))
            log.info("node %s: adopted %s %s", self.node_id, kind, key)
            self._report_started(c)
        self.adopted = True

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._tasks.spawn(coro)

    async def close(self) -> None:
        """The agent stops: stop watching. The containers run on (a restart adopts them)."""
        await self._tasks.close()
