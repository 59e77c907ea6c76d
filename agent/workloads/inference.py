"""Inference workers on this node: their containers and the slot gate in front of each.

The coordinator asks for a worker (StartWorker); the agent starts the container only while the
node is neither tainted nor paused locally (docs/design.md invariant 4: the agent refuses a start
whatever the coordinator says), puts a slot gate in front of it, and reports it started. A drain
makes the gate refuse new requests; the release of the last slot stops the container (the gate
calls back, no polling); at the grace deadline the gate cuts what is still open and the
container is stopped anyway.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from spotdrain.agent.workloads.docker_engine import DockerEngine, DockerUnavailable
from spotdrain.agent.workloads.slot_gate import Interrupted, SlotGate
from spotdrain.runtime.background import Background
from spotdrain.runtime.metrics import ReclamationMetrics
from spotdrain.workload import KIND_LABEL, NODE_LABEL

log = logging.getLogger("spotdrain.agent.workloads.inference")

WORKER_LABEL = "spotdrain.worker"
MODEL_LABEL = "spotdrain.model"
PORT_LABEL = "spotdrain.port"
GATE_PORT_LABEL = "spotdrain.gate_port"
CAPACITY_LABEL = "spotdrain.capacity"
HEALTH_TIMEOUT_S = 60.0


@dataclass
class LocalWorker:
    worker_id: str
    model: str
    container_id: str
    name: str
    port: int
    capacity: int
    gate: SlotGate
    draining: bool = False
    stop_issued_at: float | None = None
    cut_timer: asyncio.TimerHandle | None = None
    reclaim_id: str = ""
    draining_since: float | None = None
    grace_deadline: float = float("inf")
    exited: asyncio.Event = field(default_factory=asyncio.Event)


class WorkerManager:
    def __init__(
        self,
        node_id: str,
        docker: DockerEngine,
        gate_host: str,
        advertise_host: str,
        refuse_start: Callable[[], str | None],
        report: Callable[[str, dict[str, Any]], None],
        on_slots: Callable[[str, int, int, str], None],
        on_interrupted: Callable[[Interrupted, str], None],
        clock: Callable[[], float] = time.time,
        metrics: ReclamationMetrics | None = None,
    ) -> None:
        self.node_id = node_id
        self.docker = docker
        self.gate_host = gate_host
        self.advertise_host = advertise_host
        self.refuse_start = refuse_start
        self.report = report  # (worker_id, {"state": ..., ...}) to the coordinator
        self.on_slots = on_slots  # (worker_id, in_use, capacity, claimed_state)
        self.on_interrupted = on_interrupted  # (what, reclaim_id)
        self.clock = clock
        self.metrics = metrics
        self.workers: dict[str, LocalWorker] = {}
        self._tasks = Background()
        self.adopted = False  # adopt_running() has listed the engine once

    # --- starting ----------------------------------------------------------------------------

    async def start(
        self, worker_id: str, model: str, image: str, port: int, capacity: int, gate_port: int
    ) -> None:
        if worker_id in self.workers:
            self._report_started(self.workers[worker_id])  # a repeated command: same answer
            return
        why = self.refuse_start()
        if why:
            log.warning("node %s: refused to start worker %s: %s", self.node_id, worker_id, why)
            self.report(worker_id, {"state": "refused", "reason": why})
            return
        labels = {
            NODE_LABEL: self.node_id,
            KIND_LABEL: "inference",
            WORKER_LABEL: worker_id,
            MODEL_LABEL: model,
            PORT_LABEL: str(port),
            GATE_PORT_LABEL: str(gate_port),
            CAPACITY_LABEL: str(capacity),
        }
        env = {"PORT": str(port), "WORKER_ID": worker_id, "MODEL": model}
        try:
            container_id, name = await self.docker.run_container(
                image, name=f"spotdrain-{worker_id}", labels=labels, env=env
            )
        except DockerUnavailable as e:
            log.warning("node %s: worker %s did not start: %s", self.node_id, worker_id, e)
            self.report(worker_id, {"state": "stopped", "exit_code": -1, "reason": str(e)})
            return
        try:
            await self._wait_healthy(port)
            # The node may have been tainted while the container started: it serves nothing.
            worker = await self._attach(
                worker_id, model, container_id, name, port, capacity, gate_port
            )
        except (TimeoutError, OSError, ValueError) as e:
            # No gate in front of it (port taken, never healthy): it must not keep running
            # unseen, holding its port and a GPU.
            log.warning("node %s: worker %s failed to start: %s", self.node_id, worker_id, e)
            await self.docker.kill(container_id, name, "SIGKILL")
            self.report(worker_id, {"state": "stopped", "exit_code": -1, "reason": str(e)})
            return
        if self.refuse_start():
            self.drain(worker_id, grace_deadline=self.clock(), reclaim_id="")
        self._report_started(worker)

    async def adopt_running(self) -> None:
        """Agent restart: put gates back in front of this node's running workers. May be
        called again (the engine was away the first time); a worker already fronted is kept."""
        for info in await self.docker.running(with_labels=True):
            labels = info.labels
            if labels.get(KIND_LABEL) != "inference" or WORKER_LABEL not in labels:
                continue
            if labels[WORKER_LABEL] in self.workers:
                continue
            worker = await self._attach(
                labels[WORKER_LABEL],
                labels.get(MODEL_LABEL, ""),
                info.id,
                info.name,
                int(labels.get(PORT_LABEL, "0")),
                int(labels.get(CAPACITY_LABEL, "1")),
                int(labels.get(GATE_PORT_LABEL, "0")),
            )
            log.info("node %s: adopted worker %s", self.node_id, worker.worker_id)
            self._report_started(worker)
        self.adopted = True

    async def _attach(
        self,
        worker_id: str,
        model: str,
        container_id: str,
        name: str,
        port: int,
        capacity: int,
        gate_port: int,
    ) -> LocalWorker:
        gate = SlotGate(
            worker_id,
            f"http://127.0.0.1:{port}",
            host=self.gate_host,
            port=gate_port,
            capacity=capacity,
            on_slots=self._slots_changed,
            on_idle=self._idle,
            on_interrupted=self._interrupted,
            on_refused=self._refused,
        )
        try:
            await gate.start()
        except BaseException:
            await gate.close()
            raise
        worker = LocalWorker(worker_id, model, container_id, name, port, capacity, gate)
        self.workers[worker_id] = worker
        self._spawn(self._watch_exit(worker))
        return worker

    async def _wait_healthy(self, port: int) -> None:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                try:
                    async with session.get(
                        f"http://127.0.0.1:{port}/health", timeout=aiohttp.ClientTimeout(total=1)
                    ) as resp:
                        if resp.status == 200:
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.1)
        raise TimeoutError(f"worker on port {port} not healthy in {HEALTH_TIMEOUT_S} s")

    def _report_started(self, worker: LocalWorker) -> None:
        port = worker.gate.address.rsplit(":", 1)[1]
        self.report(
            worker.worker_id,
            {
                "state": "started",
                "gate_address": f"{self.advertise_host}:{port}",
                "capacity": worker.capacity,
            },
        )

    # --- draining ----------------------------------------------------------------------------

    def drain(self, worker_id: str | None, grace_deadline: float, reclaim_id: str) -> list[str]:
        """Drain one worker (or every worker, None). Returns the containers now draining."""
        targets = (
            list(self.workers.values())
            if worker_id is None
            else [w for w in (self.workers.get(worker_id),) if w is not None]
        )
        draining = []
        for worker in targets:
            draining.append(worker.container_id)
            if reclaim_id and not worker.reclaim_id:
                worker.reclaim_id = reclaim_id  # the coordinator's command may come first
            if worker.stop_issued_at is not None:
                continue
            if worker.draining and grace_deadline < worker.grace_deadline:
                # An earlier deadline (a notice during a pause) shortens the cut; never later.
                if worker.cut_timer is not None:
                    worker.cut_timer.cancel()
                worker.grace_deadline = grace_deadline
                delay = max(0.0, grace_deadline - self.clock())
                worker.cut_timer = asyncio.get_running_loop().call_later(
                    delay, self._at_grace, worker.worker_id
                )
            if not worker.draining:
                worker.draining = True
                worker.grace_deadline = grace_deadline
                worker.draining_since = self.clock()
                worker.reclaim_id = reclaim_id
                # The grace deadline: cut what is still open and stop it anyway.
                loop = asyncio.get_running_loop()
                delay = max(0.0, grace_deadline - self.clock())
                worker.cut_timer = loop.call_later(delay, self._at_grace, worker.worker_id)
                worker.gate.drain()  # may call _idle at once when nothing is in flight
        return draining

    def cut_all(self) -> None:
        for worker_id in list(self.workers):
            self._at_grace(worker_id)

    def _at_grace(self, worker_id: str) -> None:
        worker = self.workers.get(worker_id)
        if worker is None or worker.exited.is_set():
            return
        self._spawn(self._cut_and_stop(worker))

    async def _cut_and_stop(self, worker: LocalWorker) -> None:
        await worker.gate.cut()
        self._stop(worker, "SIGKILL")

    def _idle(self, worker_id: str) -> None:
        # Event-driven: the gate calls this as the last slot is released (docs/design.md target:
        # last slot released to stop issued, p99 <= 50 ms).
        worker = self.workers.get(worker_id)
        if worker is not None and worker.draining:
            self._stop(worker, "SIGTERM")

    def _stop(self, worker: LocalWorker, signal: str) -> None:
        if worker.stop_issued_at is None:
            worker.stop_issued_at = self.clock()
            if self.metrics is not None and worker.draining_since is not None:
                self.metrics.slot_wait.observe(worker.stop_issued_at - worker.draining_since)
            log.info("node %s: stopping worker %s (%s)", self.node_id, worker.worker_id, signal)
        self._spawn(self.docker.kill(worker.container_id, worker.name, signal))

    async def _watch_exit(self, worker: LocalWorker) -> None:
        exited = await self.docker.wait_exit(worker.container_id, worker.name)
        worker.exited.set()
        if worker.cut_timer is not None:
            worker.cut_timer.cancel()
        await worker.gate.cut()  # anything still open when the worker died is interrupted
        await worker.gate.close()
        self.workers.pop(worker.worker_id, None)
        self.report(worker.worker_id, {"state": "stopped", "exit_code": exited.exit_code})

    # --- gate callbacks ----------------------------------------------------------------------

    def _slots_changed(self, worker_id: str, in_use: int) -> None:
        worker = self.workers.get(worker_id)
        if worker is not None:
            state = "draining" if worker.draining else "ready"
            self.on_slots(worker_id, in_use, worker.capacity, state)

    def _refused(self, why: str) -> None:
        if self.metrics is not None:
            self.metrics.refused.labels(why).inc()

    def _interrupted(self, what: Interrupted) -> None:
        worker = self.workers.get(what.worker_id)
        self.on_interrupted(what, worker.reclaim_id if worker else "")

    # --- housekeeping ------------------------------------------------------------------------

    def slots(self) -> list[tuple[str, int, int, str]]:
        return [
            (w.worker_id, w.gate.in_flight, w.capacity, "draining" if w.draining else "ready")
            for w in self.workers.values()
        ]

    def _spawn(self, coro: Any) -> None:
        self._tasks.spawn(coro)

    async def close(self) -> None:
        await self._tasks.close()
        for worker in list(self.workers.values()):
            await worker.gate.close()
