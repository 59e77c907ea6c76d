"""The soak itself: N randomized reclamations spread over K agents on one coordinator, with the
fault injector running throughout, and the observations the counts are made of.

Each node runs one reclamation at a time, in a thread of its own, taking the next number until
N have run. Reclamation k is planned from `random.Random(f"{seed}/{k}")` alone, so a seed
replays the same reclamations (which node gets which, and where the faults land, depend on
timing). One reclamation:

1. Start its workloads (1-3 containers with this node's label: exits, checkpoints within the
   budget, ignores SIGTERM), each with a host directory for what it sees.
2. Open it: a notice with its own `terminate_at` in the notice file; a pause over the agent's
   control socket; or a notice then, once the agent has stored the reclamation, its cancel.
3. Follow it through the agent's bundle on disk and the deadline file, noting every D and G
   seen; resume a pause (after its outcome, or now and then in the middle of the drain); once
   a cancel or resume has lifted it, remove the workloads it left running.
4. Wait until it has settled: the bundle finished (the coordinator has its taint, or its lift),
   no workload runs, and every event the agent stored for it is stored at the coordinator.
   Then collect what each workload and the engine saw, and remove the containers.

Only then does the node take its next reclamation, so a reclamation's SIGTERM round never meets
the next one's workloads. The waits are bounded only to stop a broken product from hanging the
soak: one that does not settle in time is reported (`unsettled`), never assumed done.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors

from fakes.dockerenv import remove_test_containers
from fakes.harness import AgentOptions
from fakes.waiting import wait_until
from spotdrain.agent.core.reclamation import Reclamation, reclaim_id_for
from spotdrain.agent.drain.state import STEP_EVENTS
from spotdrain.agent.host import control_socket

from .faults import Fault, FaultInjector
from .observe import EngineSignals, EventMirror, outbox_rows, read_ledger
from .rig import Rig
from .workload import Workload, boot_clock_offset, running

KINDS = ("notice", "pause", "cancel")
DEADLINE_KEYS = ("t0", "terminate_at", "grace_deadline", "overrun_at")
# What the agent's bundle outcome is recorded as, among the reclamation's events.
OUTCOME_EVENTS = {
    "drained": "drained",
    "overrun": "overrun",
    "cancelled": "notice_cancelled",
    "resumed": "pause_resumed",
}
POLL_S = 0.1


@dataclass(frozen=True)
class SoakConfig:
    reclamations: int = 30
    nodes: int = 3
    seed: int = 0
    kinds: tuple[float, float, float] = (0.55, 0.25, 0.20)  # notice, pause, cancel
    notice_s: tuple[float, float] = (8.0, 11.0)  # D - now, written in the notice
    pause_notice_s: float = 9.0  # the agents' --pause-notice-s: D - the pause
    grace_s: float = 3.0  # G = D - grace_s
    overrun_s: float = 1.0  # O = D - overrun_s
    workloads: tuple[int, int] = (1, 3)
    behaviours: tuple[float, float, float] = (0.4, 0.35, 0.25)  # exits, checkpoints, ignores
    # Well inside G - T0 (5 s at the least): a SIGTERM up to 3.5 s late (an agent SIGKILLed at
    # T0 and started again on a loaded host) still leaves the checkpoint its time before G.
    checkpoint_s: tuple[float, float] = (0.2, 1.5)
    resume_mid_drain: float = 0.3  # share of pauses resumed before their outcome
    faults: bool = True
    fault_every_s: tuple[float, float] = (1.0, 6.0)
    settle_s: float = 180.0  # a reclamation not settled by then is reported, and left

    def agent_options(self) -> AgentOptions:
        return AgentOptions(
            grace_s=self.grace_s,
            overrun_s=self.overrun_s,
            extra=["--pause-notice-s", str(self.pause_notice_s)],
        )


@dataclass(frozen=True)
class Plan:
    number: int
    kind: str
    notice_in_s: float
    workloads: tuple[tuple[str, float], ...]  # (behaviour, checkpoint seconds)
    cancel_after_s: float  # a cancel: this long after the agent stored the reclamation
    resume_after_s: float | None  # a pause resumed mid-drain this long after the pause


def plan(config: SoakConfig, number: int) -> Plan:
    rng = random.Random(f"{config.seed}/{number}")
    kind = rng.choices(KINDS, config.kinds)[0]
    count = rng.randint(*config.workloads)
    workloads = tuple(
        (b, round(rng.uniform(*config.checkpoint_s), 2) if b == "checkpoints" else 0.0)
        for b in rng.choices(("exits", "checkpoints", "ignores"), config.behaviours, k=count)
    )
    resume_after = rng.uniform(0.2, 3.0) if rng.random() < config.resume_mid_drain else None
    return Plan(
        number,
        kind,
        round(rng.uniform(*config.notice_s), 3),
        workloads,
        round(rng.uniform(0.0, 1.5), 3),
        resume_after if kind == "pause" else None,
    )


@dataclass
class Round:
    """One reclamation as the soak saw it."""

    plan: Plan
    node: str
    reclaim_id: str = ""
    notice_id: str = ""
    written_terminate_at: float | None = None  # D as the soak wrote it in the notice
    opened_at: float = 0.0
    settled_at: float = 0.0
    workloads: list[Workload] = field(default_factory=list)
    # Every distinct (where, values) the deadlines were seen with: the bundle, the deadline file.
    deadlines_seen: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    agent_outcome: str = ""
    cancel_written_at: float | None = None
    resumed_at: float | None = None
    unsettled: str = ""  # why it did not settle in time
    faults: list[Fault] = field(default_factory=list)

    def saw(self, where: str, values: dict[str, Any]) -> None:
        if (where, values) not in self.deadlines_seen:
            self.deadlines_seen.append((where, values))


class Soak:
    def __init__(
        self,
        config: SoakConfig,
        work: Path,
        docker_host: str,
        nvml_lib: Path,
        prefix: str = "sdsoak-",
        say=print,
    ) -> None:
        self.config = config
        self.work = work
        self.docker_host = docker_host
        self.nvml_lib = nvml_lib
        self.prefix = prefix
        self.say = say
        self.rounds: list[Round] = []
        self.events: list[dict[str, Any]] = []  # the coordinator's, read once at the end
        self.ledgers: dict[str, list[dict[str, Any]]] = {}  # each agent's stored events
        self.timelines: dict[str, Any] = {}
        self.faults: list[Fault] = []
        self.crashes: list[str] = []
        self.wall_s = 0.0
        self._next = 0
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []
        self._offset = boot_clock_offset()
        self.rig: Rig | None = None
        self.mirror: EventMirror | None = None
        self.engine_signals: EngineSignals | None = None

    # --- the run -----------------------------------------------------------------------------

    def run(self) -> None:
        started = time.monotonic()
        client = docker.DockerClient(base_url=self.docker_host, version="auto", timeout=60)
        signals = EngineSignals(client)
        rig = Rig(
            self.work,
            self.docker_host,
            self.nvml_lib,
            self.config.nodes,
            self.config.agent_options(),
        )
        self.rig = rig
        self.engine_signals = signals
        mirror = EventMirror(rig.coordinator.channel())
        self.mirror = mirror
        injector = FaultInjector(
            rig,
            random.Random(f"{self.config.seed}/faults"),
            self.config.fault_every_s,
            self.config.faults,
        )
        try:
            wait_until(
                lambda: (
                    sum(n.connected for n in rig.coordinator.admin().nodes()) == self.config.nodes
                ),
                60,
                "every agent to register",
            )
            injector.start()
            threads = [
                threading.Thread(target=self._node_loop, args=(node,), name=node)
                for node in rig.agents
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            injector.stop()
            if self._errors:
                raise RuntimeError(f"{len(self._errors)} node loop(s) failed") from self._errors[0]
            self._quiesce()
            self.events = mirror.everything()
            self.ledgers = {node: read_ledger(a.state_dir) for node, a in rig.agents.items()}
            for rnd in self.rounds:
                tl = mirror.timeline(rnd.reclaim_id) if rnd.reclaim_id else None
                self.timelines[rnd.reclaim_id] = tl
                rnd.faults = injector.overlapping(
                    rnd.opened_at, rnd.settled_at or time.time(), rnd.node
                )
            self.faults = list(injector.log)
            self.crashes = list(rig.crashes)
        finally:
            with contextlib.suppress(Exception):
                injector.stop()
            signals.close()
            rig.stop()
            self._remove_containers(client)
            client.close()
            self.wall_s = time.monotonic() - started

    def _node_loop(self, node: str) -> None:
        client = docker.DockerClient(base_url=self.docker_host, version="auto", timeout=60)
        try:
            while True:
                with self._lock:
                    number = self._next
                    if number >= self.config.reclamations:
                        return
                    self._next += 1
                rnd = Round(plan(self.config, number), node)
                with self._lock:
                    self.rounds.append(rnd)
                self._run_round(client, rnd)
                self.say(self._progress(rnd))
        except BaseException as e:
            with self._lock:
                self._errors.append(e)
        finally:
            client.close()

    def _progress(self, rnd: Round) -> str:
        what = ", ".join(f"{b}{f' {c}s' if c else ''}" for b, c in rnd.plan.workloads)
        took = rnd.settled_at - rnd.opened_at if rnd.settled_at else float("nan")
        state = f"UNSETTLED: {rnd.unsettled}" if rnd.unsettled else rnd.agent_outcome
        return (
            f"#{rnd.plan.number:<4} {rnd.node} {rnd.plan.kind:<6} [{what}] -> {state} "
            f"in {took:.1f} s"
        )

    def _quiesce(self) -> None:
        """After the last fault: every event each agent stored reaches the coordinator."""

        def all_delivered() -> bool:
            self.mirror.refresh()
            for agent in self.rig.agents.values():
                if outbox_rows(agent.state_dir):
                    return False
                uids = {e["uid"] for e in read_ledger(agent.state_dir)}
                if not self.mirror.has_all(uids):
                    return False
            return True

        with contextlib.suppress(TimeoutError):  # what never arrived is counted as lost
            wait_until(all_delivered, 120, "every agent's outbox to empty", every=0.5)

    def _remove_containers(self, client: docker.DockerClient) -> None:
        with contextlib.suppress(Exception):
            remove_test_containers(client, self.prefix)

    # --- one reclamation ---------------------------------------------------------------------

    def _run_round(self, client: docker.DockerClient, rnd: Round) -> None:
        agent = self.rig.agents[rnd.node]
        p = rnd.plan
        for i, (behaviour, checkpoint_s) in enumerate(p.workloads):
            w = Workload(
                f"{self.prefix}{p.number:05d}-{i}",
                behaviour,
                checkpoint_s,
                self.work / "rounds" / f"{p.number:05d}-{i}",
            )
            w.start(client, rnd.node, agent.deadline_file)
            rnd.workloads.append(w)
        wait_until(lambda: all(w.ready() for w in rnd.workloads), 60, "the workloads' traps")

        rnd.opened_at = time.time()
        if p.kind == "pause":
            answer = self._ask(agent.socket, "pause", self.config.settle_s)
            rnd.reclaim_id = answer["reclaim_id"]
        else:
            rnd.notice_id = f"soak-{self.config.seed}-{p.number}"
            rnd.written_terminate_at = round(rnd.opened_at + p.notice_in_s, 3)
            agent.write_notice(
                {
                    "id": rnd.notice_id,
                    "action": "terminate",
                    "terminate_at": rnd.written_terminate_at,
                    "source": "soak",
                }
            )
            rnd.reclaim_id = reclaim_id_for(rnd.node, "id:" + rnd.notice_id)
        try:
            wait_until(
                lambda: self._follow(client, rnd),
                self.config.settle_s,
                f"reclamation #{p.number} to settle",
                every=POLL_S,
            )
        except TimeoutError as e:
            rnd.unsettled = f"{e}; {self._why_not_settled(client, rnd)}"
        rnd.settled_at = time.time()
        for w in rnd.workloads:
            if running(client, w.container_id):
                client.api.kill(w.container_id)  # unsettled: the next round must start clean
                w.killed_by_soak = True
            wait_until(lambda w=w: not running(client, w.container_id), 30, f"{w.name} to stop")
            w.collect(client, self._offset)
            with contextlib.suppress(docker.errors.NotFound):
                client.api.remove_container(w.container_id, force=True)

    def _bundle(self, rnd: Round) -> dict[str, Any] | None:
        path = self.rig.agents[rnd.node].state_dir / "reclamations" / f"{rnd.reclaim_id}.json"
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        doc.pop(STEP_EVENTS, None)  # the events of the step that wrote it, not its state
        return doc

    def _follow(self, client: docker.DockerClient, rnd: Round) -> bool:
        """One look at the reclamation; True once it has settled."""
        agent = self.rig.agents[rnd.node]
        p = rnd.plan
        doc = self._bundle(rnd)
        self._read_deadline_file(rnd)
        if doc is None:
            return False
        rnd.saw("bundle", {k: doc[k] for k in DEADLINE_KEYS})
        rec = Reclamation.from_json(doc)
        rnd.agent_outcome = rec.outcome
        now = time.time()
        if p.kind == "cancel" and rnd.cancel_written_at is None:
            if now >= rnd.opened_at + p.cancel_after_s:
                agent.write_notice({"id": rnd.notice_id, "action": "cancel", "source": "soak"})
                rnd.cancel_written_at = now
            return False
        if p.kind == "pause" and rnd.resumed_at is None:
            mid_drain = p.resume_after_s is not None and now >= rnd.opened_at + p.resume_after_s
            if (mid_drain or rec.phase == "done") and self._try(agent.socket, "resume"):
                rnd.resumed_at = time.time()
            return False
        if rec.lifted and rec.phase == "done":
            # A cancel or a resume took the machine back: what it left running is the soak's.
            for w in rnd.workloads:
                if not w.killed_by_soak and running(client, w.container_id):
                    w.killed_by_soak = True
                    with contextlib.suppress(docker.errors.APIError):
                        client.api.kill(w.container_id)
        if not rec.finished:
            return False
        if any(running(client, w.container_id) for w in rnd.workloads):
            return False
        stored = read_ledger(agent.state_dir, rnd.reclaim_id)
        if OUTCOME_EVENTS.get(rec.outcome) not in {e["kind"] for e in stored}:
            return False  # the bundle is saved just before its events are put in the outbox
        self.mirror.refresh()
        return self.mirror.has_all({e["uid"] for e in stored})

    def _read_deadline_file(self, rnd: Round) -> None:
        """The deadline file as a workload would read it now, once it names this reclamation.
        (Before that it may still be the previous one's: it is written just after the bundle
        that opens the drain, and before any SIGTERM. What the signalled workloads read is
        their own record, Workload.deadline_seen.)"""
        path = self.rig.agents[rnd.node].deadline_file
        try:
            deadline = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            return
        if deadline.get("reclaim_id") == rnd.reclaim_id:
            rnd.saw(
                "deadline file",
                {
                    "reclaim_id": deadline.get("reclaim_id"),
                    "terminate_at": deadline.get("terminate_at_epoch"),
                    "grace_deadline": deadline.get("grace_deadline_epoch"),
                },
            )

    def _why_not_settled(self, client: docker.DockerClient, rnd: Round) -> str:
        doc = self._bundle(rnd)
        if doc is None:
            return "the agent never stored the reclamation"
        rec = Reclamation.from_json(doc)
        alive = [w.name for w in rnd.workloads if running(client, w.container_id)]
        stored = read_ledger(self.rig.agents[rnd.node].state_dir, rnd.reclaim_id)
        missing = [e["kind"] for e in stored if not self.mirror.has_all({e["uid"]})]
        return (
            f"phase {rec.phase}, outcome {rec.outcome or '-'}, finished {rec.finished}, "
            f"taint {rec.taint_mode or '-'}/remote {rec.remote_taint}, still running "
            f"{alive}, not at the coordinator: {missing}"
        )

    # --- the owner's switch ------------------------------------------------------------------

    @staticmethod
    def _try(socket: Path, command: str) -> dict[str, Any] | None:
        """One request over the control socket; None while the agent cannot answer (killed,
        or starting again)."""
        try:
            answer = asyncio.run(control_socket.request(socket, command, timeout=5.0))
        except (OSError, TimeoutError, ValueError):
            return None
        return answer if answer.get("ok") else None

    def _ask(self, socket: Path, command: str, timeout: float) -> dict[str, Any]:
        return wait_until(
            lambda: self._try(socket, command), timeout, f"the agent to answer {command}", every=0.2
        )
