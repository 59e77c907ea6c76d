"""The agent daemon: its parts assembled, and one supervisor over the notice watcher, the
drain loop, the coordinator link and the container inventory (agent/main.py starts it).

A failure of any task stops the agent with a non-zero exit so systemd's Restart=on-failure
brings it back, and the restarted agent resumes from its bundles. SIGTERM to the agent stops
the agent only: workloads keep running (a restart must never drain a node).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

from spotdrain.agent.config import AgentConfig
from spotdrain.agent.drain.link import CoordinatorLink
from spotdrain.agent.drain.outbox import Outbox
from spotdrain.agent.drain.runner import DrainRunner
from spotdrain.agent.drain.state import WriteHealth
from spotdrain.agent.gauges import register_gauges
from spotdrain.agent.host.control_socket import ControlSocket
from spotdrain.agent.host.gpu import GpuError, Nvml
from spotdrain.agent.node_status import NodeStatus
from spotdrain.agent.notices.hub import SourceHub
from spotdrain.agent.workloads.docker_engine import DockerEngine, DockerUnavailable
from spotdrain.agent.workloads.inference import WorkerManager
from spotdrain.agent.workloads.jobs import PlainWorkloads
from spotdrain.agent.workloads.managers import DockerWork, WorkManager, WorkManagers
from spotdrain.agent.workloads.slot_gate import Interrupted
from spotdrain.agent.workloads.slurm import SlurmWork
from spotdrain.protocol import kinds
from spotdrain.runtime import systemd
from spotdrain.runtime.background import Background
from spotdrain.runtime.metrics import CollectorRegistry, ReclamationMetrics
from spotdrain.runtime.metrics import serve as metrics_serve
from spotdrain.runtime.supervisor import Supervisor
from spotdrain.v1 import spotdrain_pb2 as pb

VERSION = "0.2.0"
log = logging.getLogger("spotdrain.agent")
# The watchdog ping is withheld when a live reclamation's next deadline is this far overdue:
# the drain loop has stopped keeping its timers (see Agent.healthy).
DRAIN_LOOP_STUCK_S = 2.0


class Agent:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        # A disk that refuses writes never stops the agent (agent/drain/state.py): what it could not
        # write is held in memory and recorded as state_write_failed once the drains record.
        self.state_health = WriteHealth()
        try:
            cfg.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self.state_health.failed(cfg.state_dir, e)
        self.outbox = Outbox(cfg.state_dir / "outbox.sqlite", self.state_health)
        self.nvml = Nvml(cfg.nvml_timeout_s)
        self.docker = DockerEngine(cfg.docker_host, cfg.node_id, cfg.docker_call_timeout_s)
        self.link = CoordinatorLink(cfg, self.outbox, self.registration)
        self.registry = CollectorRegistry()
        self.metrics = ReclamationMetrics(self.registry)
        self.workers = WorkerManager(
            cfg.node_id,
            self.docker,
            gate_host=cfg.gate_host,
            advertise_host=cfg.advertise_host,
            refuse_start=lambda: self.drains.refuse_start(),
            report=self.link.report_worker,
            on_slots=self.link.report_slots,
            on_interrupted=self.stream_interrupted,
            metrics=self.metrics,
        )
        # Rentals and batch/render jobs: plain containers, no gate (agent/workloads/jobs.py).
        self.plain = PlainWorkloads(
            cfg.node_id,
            self.docker,
            cfg.deadline_file,
            refuse_start=lambda: self.drains.refuse_start(),
            report_rental=self._report_rental,
            report_worker=self.link.report_worker,
            status_root=cfg.status_dir,
        )
        # The work managers drained: Docker, Slurm, or both ([workloads]).
        managers: list[WorkManager] = [DockerWork(self.docker)] if cfg.workloads.docker else []
        self.slurm: SlurmWork | None = None
        if cfg.workloads.slurm is not None:
            self.slurm = SlurmWork(cfg.workloads.slurm, lambda rid, ev: self.drains.feed(rid, ev))
            managers.append(self.slurm)
        self.work = WorkManagers(managers)
        self.drains = DrainRunner(
            cfg,
            self.outbox,
            self.link,
            self.work,
            self.nvml,
            self.workers,
            metrics=self.metrics,
            health=self.state_health,
        )
        self.link.on_command = self.command
        self.link.heartbeat_slots = lambda: self.workers.slots() + self.plain.job_slots()
        self.control = ControlSocket(cfg.socket, cfg.socket_group, self.control_request)
        self.sources = SourceHub(
            cfg.node_id,
            self.drains,
            cfg.advisory,
            cfg.state_dir,
            undelivered=lambda: len(self.outbox),
        )
        self.sources.build(cfg.source_configs)
        file_source = self.sources.sources.get("file")
        # READY waits for the notice file's watch (a notice written after READY is never
        # missed); the other sources report their health instead.
        self.watching = getattr(file_source, "watching", None) or asyncio.Event()
        if file_source is None:
            self.watching.set()
        register_gauges(self.registry, self.workers, self.link, self.sources)
        self.node_status = NodeStatus(
            cfg.node_id, self.drains, self.link, self.sources, self.workers, self.plain
        )
        self._tasks = Background()
        # The cloud identity the latest registration built carried (None: none known then).
        self._registered_cloud: pb.CloudIdentity | None = None
        self.supervisor = Supervisor(f"node {cfg.node_id}")

    async def registration(self) -> pb.Register:
        try:
            gpus = [
                pb.Gpu(index=g.index, uuid=g.uuid, name=g.name, memory_bytes=g.memory_bytes)
                for g in await self.nvml.inventory()
            ]
        except GpuError as e:
            log.warning("node %s: GPU inventory unavailable: %s", self.cfg.node_id, e)
            gpus = []
        running = [
            pb.WorkerReport(
                worker_id=w.worker_id,
                state="started",
                capacity=w.capacity,
                gate_address=f"{self.cfg.advertise_host}:{w.gate.address.rsplit(':', 1)[1]}",
            )
            for w in self.workers.workers.values()
        ]
        running += [
            pb.WorkerReport(worker_id=j.key, state="started", capacity=0)
            for j in self.plain.jobs.values()
        ]
        rentals = [
            pb.RentalReport(rental_id=r.key, state="started", container=r.container_id)
            for r in self.plain.rentals.values()
        ]
        cloud = self.sources.cloud.to_pb() if self.sources.cloud is not None else None
        self._registered_cloud = cloud
        return pb.Register(
            node_id=self.cfg.node_id,
            gpus=gpus,
            spot=self.cfg.spot,
            node_group=self.cfg.node_group,
            agent_version=VERSION,
            workers=running,
            provider=self.cfg.provider,
            rentals=rentals,
            inventory_incomplete=not self.inventory_complete,
            managers=self._managers(),
            cloud=cloud,
        )

    async def report_identity(self) -> None:
        """Register again once the node's cloud identity is read after the stream registered
        without it. A stream that registers meanwhile carries it already; one not connected
        will when it is."""
        while True:
            await self.sources.identified.wait()
            self.sources.identified.clear()
            await self.link.connected.wait()
            known = self.sources.cloud
            if known is not None and self._registered_cloud != known.to_pb():
                self.link.register_again(await self.registration())

    def _managers(self) -> list[pb.WorkManager]:
        """The work managers drained here, Slurm's with the node and cluster it knows."""
        managers = [pb.WorkManager(name="docker")] if self.cfg.workloads.docker else []
        if self.slurm is not None:
            managers.append(
                pb.WorkManager(name="slurm", node_name=self.slurm.node, cluster=self.slurm.cluster)
            )
        return managers

    # --- commands: workers, jobs, rentals ------------------------------------------------------

    def command(self, msg: pb.CoordinatorMessage) -> None:
        """A command from the coordinator. Starts go through the agent's own refusal check."""
        which = msg.WhichOneof("body")
        if which == "start_worker":
            c = msg.start_worker
            if c.kind in kinds.JOBS:
                self._spawn(self.plain.start_job(c.worker_id, c.kind, c.image, c.model, c.port))
            elif c.kind in ("", "inference"):
                gate_port = c.port + int(self.cfg.gate_port_offset)
                self._spawn(
                    self.workers.start(c.worker_id, c.model, c.image, c.port, c.capacity, gate_port)
                )
            else:
                self.link.report_worker(
                    c.worker_id, {"state": "refused", "reason": f"unknown worker kind {c.kind!r}"}
                )
        elif which == "drain_worker":
            c = msg.drain_worker
            if self.plain.drain_job(c.worker_id):
                return  # a batch or render job: the reclamation's signal rounds stop it
            self.workers.drain(c.worker_id, c.grace_deadline or time.time(), c.reclaim_id)
        elif which == "start_rental":
            c = msg.start_rental
            self._spawn(self.plain.start_rental(c.rental_id, c.image, c.gpus, c.renter))
        elif which == "stop_rental":
            c = msg.stop_rental
            self._spawn(self.plain.stop_rental(c.rental_id, c.reason))

    def stream_interrupted(self, what: Interrupted, reclaim_id: str) -> None:
        now = time.time()
        rec = self.drains.live.get(reclaim_id)
        event = self.outbox.event(
            "stream_interrupted",
            self.cfg.node_id,
            reclaim_id,
            now,
            None if rec is None else now - rec.t0,
            {
                "worker_id": what.worker_id,
                "request_id": what.request_id,
                "streamed": what.streamed,
                "reason": what.reason,
            },
        )
        self.outbox.put(event)
        self.link.wake()
        self.metrics.observe_event("stream_interrupted", reclaim_id, None, {})

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._tasks.spawn(coro)

    # --- the owner's switch ------------------------------------------------------------------

    async def control_request(self, command: str) -> dict[str, Any]:
        if command == "pause":
            rec = self.drains.pause()
            return {**self.node_status.status(), "reclaim_id": rec.reclaim_id}
        if command == "resume":
            resumed = self.drains.resume()
            return {**self.node_status.status(), "resumed": resumed}
        return self.node_status.status()

    async def keep_inventory(self) -> None:
        while True:
            try:
                await self.docker.refresh_inventory()
            except DockerUnavailable as e:
                log.warning("node %s: container inventory: %s", self.cfg.node_id, e)
            else:
                if not self.inventory_complete:
                    await self._adopt()  # the engine was away when the agent started
            await asyncio.sleep(self.cfg.inventory_every_s)

    @property
    def inventory_complete(self) -> bool:
        return self.workers.adopted and self.plain.adopted

    async def _adopt(self) -> None:
        """Take over the containers a previous agent started: gates in front of inference
        workers, exit watches on rentals and jobs. Until it has worked once, registrations say
        the inventory is incomplete, so the coordinator takes nothing missing as gone."""
        try:
            if not self.workers.adopted:
                await self.workers.adopt_running()
            if not self.plain.adopted:
                await self.plain.adopt_running()
        except DockerUnavailable as e:
            log.warning("node %s: cannot adopt running containers yet: %s", self.cfg.node_id, e)
            return
        if self.link.connected.is_set():
            self.link.register_again(await self.registration())  # the whole inventory now

    def _report_rental(self, rental_id: str, report: dict[str, Any]) -> None:
        """A rental's report; a stop past a reclamation's G names that reclamation, so the
        coordinator attributes the end right even if it never got the Taint."""
        if report.get("state") == "stopped":
            rec = self.drains.past_grace(time.time())
            if rec is not None:
                report = {
                    **report,
                    "reclaim_id": rec.reclaim_id,
                    "reclaim_reason": rec.reason,
                    "reclaim_at": rec.grace_deadline,
                }
        self.link.report_rental(rental_id, report)

    async def run(self) -> int:
        """Runs the supervised tasks: 0 after the stop signal, 1 once one of them failed."""
        await self.control.start()
        if self.cfg.metrics_listen:
            port = metrics_serve(self.registry, self.cfg.metrics_listen)
            log.info(
                "node %s: metrics on %s:%d/metrics",
                self.cfg.node_id,
                self.cfg.metrics_listen.rpartition(":")[0],
                port,
            )
        await self._adopt()
        if self.slurm is not None:
            await self.slurm.check_node()  # a node slurmctld does not know: exit 2
            if not self._reclamation_open(time.time()):
                await self.slurm.resume_stale()  # back from a reclamation: work may come again
        sup = self.supervisor
        sup.add("drains", self.drains.run())
        for name, src in self.sources.sources.items():
            sup.add(f"source {name}", src.run())
        sup.add("advisories", self.sources.keep_advisories())
        sup.add("cloud identity", self.report_identity())
        sup.add("link", self.link.run())
        sup.add("inventory", self.keep_inventory())
        sup.add("watchdog", systemd.keep_watchdog(self.healthy))
        sup.add("systemd", self.tell_systemd())
        try:
            return await sup.run()
        finally:
            await self.shutdown()

    def _reclamation_open(self, now: float) -> bool:
        """A drain under way, or one that emptied the node for a D still to come (the host is
        about to go: the DRAIN must stay). A new boot after D, or after a resume or a cancel,
        has none."""
        if self.drains.live:
            return True
        return any(rec.terminate_at > now and not rec.lifted for rec in self.drains.recent.values())

    # --- systemd (Type=notify) ----------------------------------------------------------------

    async def tell_systemd(self) -> None:
        """READY=1 once the notice watcher is in place and Docker and
        NVML have each answered once, retried every second with STATUS= naming what is
        missing; then STATUS= lines on every change. Drains run meanwhile: READY is a report,
        never a gate on answering a notice."""
        await self.watching.wait()
        sources = ", ".join(self.sources.sources)
        log.info("node %s: agent up, notice sources %s", self.cfg.node_id, sources)
        said = ""
        while missing := await self._not_yet_up():
            text = f"starting: waiting for {missing}"
            if text != said:
                systemd.status(text)
                said = text
            await asyncio.sleep(1.0)
        log.info("node %s: Docker and NVML answered; ready", self.cfg.node_id)
        said = self.node_status.describe()
        systemd.ready(said)
        await systemd.keep_status(self.node_status.describe, last=said)

    async def _not_yet_up(self) -> str:
        missing = []
        try:
            if self.cfg.workloads.docker:
                await self.docker.running()
        except DockerUnavailable as e:
            missing.append(f"Docker ({e})")
        try:
            await self.nvml.inventory()
        except GpuError as e:
            missing.append(f"NVML ({e})")
        return " and ".join(missing)

    def healthy(self) -> bool:
        """Whether the supervisor may send the watchdog ping: every supervised task still
        runs, and no live reclamation's next deadline is overdue by DRAIN_LOOP_STUCK_S (the
        drain loop sleeps until the earliest one, so an overdue one means its timer is not
        being kept, e.g. after a wall-clock jump or a wedged loop; a restart resumes from the
        bundle with the same deadlines). A blocked event loop sends no ping at all."""
        if not self.supervisor.all_running():
            return False
        now = time.time()
        for rec in self.drains.live.values():
            due = rec.next_wakeup()
            if due is not None and now - due > DRAIN_LOOP_STUCK_S:
                return False
        return True

    async def shutdown(self) -> None:
        await self.supervisor.shutdown()
        await self.control.close()
        await self._tasks.close()
        await self.drains.close()
        self.work.close()
        await self.workers.close()
        await self.plain.close()
        await self.link.close()
        self.docker.close()
        self.nvml.close()
        self.outbox.close()
