"""Rentals and batch/render jobs on a real Docker engine: the plain containers the coordinator
asks the agent for (agent/workloads/jobs.py). docs/design.md "Four drain paths": a rental runs until
reclaim_at (the grace deadline G) and reads it from the deadline file, bind-mounted read-only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest

from dockerenv import run_workload
from spotdrain.agent.core.reclamation_commands import SIGKILL, SIGTERM, SignalContainers
from spotdrain.agent.drain.state import write_deadline_file
from spotdrain.agent.workloads.docker_engine import DockerEngine
from spotdrain.agent.workloads.jobs import CONTAINER_DEADLINE_DIR, PlainWorkloads

pytestmark = pytest.mark.docker


@dataclass
class Node:
    """One node's plain workloads over the real engine, with every report recorded."""

    node_id: str
    docker: DockerEngine
    deadline_file: Path
    refusing: str | None = None  # what the agent's refuse_start() answers
    reports: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    plain: PlainWorkloads = field(init=False)

    def __post_init__(self) -> None:
        self.plain = self.manager()

    def manager(self) -> PlainWorkloads:
        """A fresh manager, as a restarted agent makes one."""
        return PlainWorkloads(
            self.node_id,
            self.docker,
            self.deadline_file,
            refuse_start=lambda: self.refusing,
            report_rental=lambda rid, rep: self.reports.append(("rental", rid, rep)),
            report_worker=lambda wid, rep: self.reports.append(("worker", wid, rep)),
            stop_grace_s=1.0,
        )

    async def report(
        self, what: str, key: str, state: str, timeout: float = 10.0, after: int = 0
    ) -> dict[str, Any]:
        """The first report about `key` in `state`, among those from index `after` on."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for w, k, rep in self.reports[after:]:
                if (w, k, rep.get("state")) == (what, key, state):
                    return rep
            await asyncio.sleep(0.05)
        raise AssertionError(f"no {what} {key} {state} in {self.reports}")


@pytest.fixture
async def node(docker_engine, rental_image, tmp_path) -> AsyncIterator[Node]:
    node_id = f"rent-{uuid.uuid4().hex[:8]}"
    engine = DockerEngine(docker_engine.host, node_id, call_timeout_s=5.0)
    n = Node(node_id, engine, tmp_path / "workload" / "deadline.json")
    yield n
    await n.plain.close()
    engine.close()
    client: docker.DockerClient = docker_engine.client
    for c in client.containers.list(all=True, filters={"label": f"spotdrain.node={node_id}"}):
        with contextlib.suppress(docker.errors.NotFound):
            c.remove(force=True)


def container(docker_engine, container_id: str):
    return docker_engine.client.containers.get(container_id)


async def eventually(predicate: Callable[[], Any], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def in_thread(fn: Callable[[], Any]) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn)


async def test_a_rental_runs_the_renters_image_labelled_with_the_deadline_dir_read_only(
    node: Node, docker_engine, rental_image
) -> None:
    """The coordinator rents the node out. The renter's container carries the node and rental
    labels, runs on the host network, and sees the deadline file the agent writes when a
    reclaim begins, updated in place when the agent replaces it, through a read-only mount."""
    await node.plain.start_rental("r-1", rental_image, gpus=1, renter="alice")
    started = await node.report("rental", "r-1", "started")
    c = await in_thread(lambda: container(docker_engine, started["container"]))
    assert c.labels["spotdrain.node"] == node.node_id
    assert c.labels["spotdrain.kind"] == "rental"
    assert c.labels["spotdrain.rental"] == "r-1"
    in_container = f"{CONTAINER_DEADLINE_DIR}/deadline.json"
    assert f"SPOTDRAIN_DEADLINE_FILE={in_container}" in c.attrs["Config"]["Env"]
    assert "RENTAL_ID=r-1" in c.attrs["Config"]["Env"]
    assert c.attrs["HostConfig"]["NetworkMode"] == "host"
    [mount] = c.attrs["Mounts"]
    assert (mount["Source"], mount["Destination"], mount["RW"]) == (
        str(node.deadline_file.parent),
        CONTAINER_DEADLINE_DIR,
        False,
    )

    # A reclaim begins: the agent writes the file; the renter reads reclaim_at = G.
    write_deadline_file(node.deadline_file, "rcl-1", 2000.0, 1990.0, "notice")
    code, out = await in_thread(lambda: c.exec_run(["cat", in_container]))
    doc = json.loads(out)
    assert code == 0 and doc["reclaim_at_epoch"] == 1990.0
    assert doc["reclaim_at"] == "1970-01-01T00:33:10Z"
    # Replaced by rename (a new inode): the directory mount shows the new one.
    write_deadline_file(node.deadline_file, "rcl-1", 2000.0, 1980.0, "notice")
    code, out = await in_thread(lambda: c.exec_run(["cat", in_container]))
    assert json.loads(out)["reclaim_at_epoch"] == 1980.0
    code, _ = await in_thread(lambda: c.exec_run(["touch", f"{CONTAINER_DEADLINE_DIR}/x"]))
    assert code != 0  # read-only

    # The coordinator says it again (a lost answer): the same container, started again.
    before = len(node.reports)
    await node.plain.start_rental("r-1", rental_image)
    again = await node.report("rental", "r-1", "started", after=before)
    assert again["container"] == started["container"]


async def test_the_renter_ending_its_container_is_reported_with_its_exit_code(
    node: Node, rental_image
) -> None:
    """The renter's program ends on its own with code 7: the agent reports the rental stopped
    with that code and forgets it."""
    await node.plain.start_rental("r-exits-7", rental_image)
    started = await node.report("rental", "r-exits-7", "started")
    stopped = await node.report("rental", "r-exits-7", "stopped")
    assert stopped == {"state": "stopped", "exit_code": 7, "container": started["container"]}
    assert node.plain.rentals == {}


async def test_stop_rental_sigterms_the_container_and_reports_it_stopped(
    node: Node, rental_image
) -> None:
    """The renter ends the rental early: SIGTERM, and the renter's program exits (code 3)."""
    await node.plain.start_rental("r-2", rental_image)
    await node.report("rental", "r-2", "started")
    await node.plain.stop_rental("r-2", "renter ended it")
    stopped = await node.report("rental", "r-2", "stopped")
    assert (stopped["exit_code"], stopped["reason"]) == (3, "renter ended it")


async def test_stop_rental_kills_a_container_that_ignores_sigterm_after_the_grace(
    node: Node, rental_image
) -> None:
    await node.plain.start_rental("r-ignores-term", rental_image)
    await node.report("rental", "r-ignores-term", "started")
    began = time.monotonic()
    await node.plain.stop_rental("r-ignores-term")
    stopped = await node.report("rental", "r-ignores-term", "stopped")
    assert stopped["exit_code"] == 137
    assert 1.0 <= time.monotonic() - began < 5.0  # the 1 s grace, then SIGKILL


async def test_stop_rental_for_a_rental_not_here_answers_stopped(node: Node) -> None:
    await node.plain.stop_rental("r-unknown", "platform")
    assert node.reports == [
        (
            "rental",
            "r-unknown",
            {"state": "stopped", "exit_code": -1, "reason": "not running on this node"},
        )
    ]


async def test_a_restarted_agent_adopts_the_running_rentals_and_jobs(
    node: Node, docker_engine, docker_images, rental_image
) -> None:
    """The agent restarts while a rental and a batch job run. The new agent finds both by their
    labels, says they are started, and watches their exits; a container started by hand (no
    rental or worker label) is not taken for either."""
    await node.plain.start_rental("r-3", rental_image)
    await node.plain.start_job("job-1", "batch", rental_image, model="m")
    await node.report("rental", "r-3", "started")
    await node.report("worker", "job-1", "started")
    by_hand = await in_thread(
        lambda: run_workload(
            docker_engine.client,
            name=f"sdt-by-hand-{node.node_id}",
            node_id=node.node_id,
            kind="exits_on_term",
            image=docker_images["base"],
        )
    )
    await node.plain.close()  # the old agent is gone; its containers run on

    node.plain = node.manager()
    before = len(node.reports)
    await node.plain.adopt_running()
    assert sorted(node.plain.rentals) == ["r-3"] and sorted(node.plain.jobs) == ["job-1"]
    assert by_hand.id not in {c.container_id for c in node.plain.jobs.values()}
    await node.report("rental", "r-3", "started", after=before)
    await node.report("worker", "job-1", "started", after=before)
    await node.plain.adopt_running()  # again (the engine came back): nothing new
    assert len([r for r in node.reports[before:] if r[2]["state"] == "started"]) == 2

    await node.plain.stop_rental("r-3")
    assert (await node.report("rental", "r-3", "stopped"))["exit_code"] == 3


async def test_a_start_is_refused_while_the_agent_refuses_starts(
    node: Node, docker_engine, rental_image
) -> None:
    """The owner has paused the node (or it is tainted, or draining): no rental and no job
    starts, whatever the coordinator says (docs/design.md invariant 4)."""
    node.refusing = "node is paused by its owner"
    await node.plain.start_rental("r-4", rental_image)
    await node.plain.start_job("job-2", "render", rental_image)
    assert node.reports == [
        ("rental", "r-4", {"state": "refused", "reason": "node is paused by its owner"}),
        ("worker", "job-2", {"state": "refused", "reason": "node is paused by its owner"}),
    ]
    assert await node.docker.running() == []


async def test_a_batch_job_is_a_plain_container_reported_started_then_stopped(
    node: Node, docker_engine, rental_image
) -> None:
    """A batch job: no gate, never routed; started (no gate address, capacity 0), the deadline
    directory mounted as for rentals, and its exit code reported. A drain command for it is a
    no-op the heartbeat remembers (the reclamation's signal rounds stop it)."""
    await node.plain.start_job("job-exits-7", "batch", rental_image, model="trainer")
    started = await node.report("worker", "job-exits-7", "started")
    assert started == {"state": "started", "gate_address": "", "capacity": 0}
    [job] = node.plain.jobs.values()
    c = await in_thread(lambda: container(docker_engine, job.container_id))
    assert c.labels["spotdrain.kind"] == "batch"
    assert c.labels["spotdrain.worker"] == "job-exits-7"
    assert [m["Destination"] for m in c.attrs["Mounts"]] == [CONTAINER_DEADLINE_DIR]
    assert node.plain.drain_job("job-exits-7") and not node.plain.drain_job("inference-1")
    assert node.plain.job_slots() == [("job-exits-7", 0, 0, "draining")]
    stopped = await node.report("worker", "job-exits-7", "stopped")
    assert stopped == {"state": "stopped", "exit_code": 7}


async def test_the_sigterm_round_passes_a_rental_by_and_the_sigkill_round_at_g_takes_it(
    node: Node, rental_image
) -> None:
    """A reclaim on the real engine: the SIGTERM round after the taint signals the batch job
    and leaves the rental running (its renter has until reclaim_at = G); the SIGKILL round at
    G kills the rental."""
    await node.plain.start_rental("r-5", rental_image)
    await node.plain.start_job("job-3", "batch", rental_image)
    rental = (await node.report("rental", "r-5", "started"))["container"]
    job = node.plain.jobs["job-3"].container_id

    term = SignalContainers(SIGTERM)
    signalled = [
        s.container async for s in node.docker.signal_all(SIGTERM, term.skip, term.skip_kinds)
    ]
    assert signalled == [job]
    assert (await node.report("worker", "job-3", "stopped"))["exit_code"] == 3
    assert [c.id for c in await node.docker.running()] == [rental]

    kill = SignalContainers(SIGKILL)
    signalled = [
        s.container async for s in node.docker.signal_all(SIGKILL, kill.skip, kill.skip_kinds)
    ]
    assert signalled == [rental]
    assert (await node.report("rental", "r-5", "stopped"))["exit_code"] == 137


async def test_the_agent_routes_rental_and_job_commands_and_registers_them(
    docker_engine, rental_image, tmp_path
) -> None:
    """The coordinator's StartRental and StartWorker(kind=batch) reach the plain-workload
    manager through the agent's command(); Register then carries the rental, the job and the
    node's provider, and a DrainWorker for the job is a no-op the heartbeat shows."""
    from spotdrain.agent.config import AgentConfig
    from spotdrain.agent.daemon import Agent
    from spotdrain.v1 import spotdrain_pb2 as pb

    node_id = f"rent-{uuid.uuid4().hex[:8]}"
    cfg = AgentConfig(
        coordinator="127.0.0.1:1",
        node_id=node_id,
        notice_file=tmp_path / "notice.json",
        state_dir=tmp_path / "state",
        docker_host=docker_engine.host,
        insecure=True,
        deadline_file=tmp_path / "workload" / "deadline.json",
        socket=tmp_path / "agent.sock",
        provider="acme-gpu",
    )
    agent = Agent(cfg)
    sent = agent.link._reports
    try:
        agent.command(
            pb.CoordinatorMessage(
                start_rental=pb.StartRental(rental_id="r-9", image=rental_image, renter="bob")
            )
        )
        agent.command(
            pb.CoordinatorMessage(
                start_worker=pb.StartWorker(worker_id="job-9", image=rental_image, kind="batch")
            )
        )
        await eventually(lambda: len(sent) >= 2, "two reports")
        reported = {m.WhichOneof("body"): m for m in sent}
        assert reported["rental"].rental.state == "started"
        assert (reported["worker"].worker.worker_id, reported["worker"].worker.state) == (
            "job-9",
            "started",
        )
        register = await agent.registration()
        assert register.provider == "acme-gpu"
        assert [(r.rental_id, r.state) for r in register.rentals] == [("r-9", "started")]
        assert [(w.worker_id, w.gate_address, w.capacity) for w in register.workers] == [
            ("job-9", "", 0)
        ]
        agent.command(pb.CoordinatorMessage(drain_worker=pb.DrainWorker(worker_id="job-9")))
        assert agent.link.heartbeat_slots() == [("job-9", 0, 0, "draining")]
        agent.command(pb.CoordinatorMessage(stop_rental=pb.StopRental(rental_id="r-9")))
        await eventually(lambda: not agent.plain.rentals, "the rental to stop")
        assert sent[-1].rental.state == "stopped" and sent[-1].rental.exit_code == 3
    finally:
        await agent.shutdown()
        client: docker.DockerClient = docker_engine.client
        for c in client.containers.list(all=True, filters={"label": f"spotdrain.node={node_id}"}):
            c.remove(force=True)
