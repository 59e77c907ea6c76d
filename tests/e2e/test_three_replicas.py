"""Three coordinator replicas on one real PostgreSQL, two leaders SIGKILLed in turn: real agents
given every replica, a real model worker and a checkpointing batch job, the reference router
and spotctl as processes, each of those clients given one follower only (docs/fleet.md
"Several replicas": one address, even a follower's, works too)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from test_pause import start_worker, wait_state
from test_replica_failover import (  # noqa: F401 (fixtures)
    Loop,
    RouterView,
    chat,
    model_image,
    spotctl_nodes,
    stored_events,
    workers_cleanup,
)
from test_replicas import FAILOVER_S, db, leading, lease_row, start_replica  # noqa: F401

from fakes.dockerenv import run_workload
from fakes.harness import AgentOptions, start_agent, start_router
from fakes.waiting import wait_until

pytestmark = pytest.mark.docker

D_S = 20.0  # the notice's deadline: room for two failovers and the job's checkpoint
CHECKPOINT_S = 8.0  # the batch job's checkpoint after SIGTERM: it exits after both kills


class FollowerClients:
    """A router and a spotctl loop given one replica's address only, and requests sent
    through that router: what each saw, for the whole time they ran."""

    def __init__(self, work, replica, worker_id: str) -> None:
        self.replica = replica
        self.router = start_router(work, replica)
        self.view = self.nodes = self.requests = None
        try:
            assert chat(self.router.url) == 200  # the first request starts the model's watch
            self.view = RouterView(self.router.url)
            wait_until(lambda: worker_id in self.view.routable, 10, "the router to route it")
            self.nodes = Loop(lambda: spotctl_nodes(replica), every=0.3)
            self.requests = Loop(lambda: chat(self.router.url))
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for running in (self.nodes, self.requests, self.view):
            if running is not None:
                running.stop()
        self.router.proc.stop()

    def check(self, node_ids: list[str], worker_id: str) -> None:
        """Every spotctl run succeeded and listed every node, every request was answered,
        the router's table never went back, never lost the worker, was never unsynced."""
        for _, run in self.nodes.outcomes:
            assert isinstance(run, subprocess.CompletedProcess), run
            assert run.returncode == 0, run.stderr
            listed = sorted(json.loads(line)["node_id"] for line in run.stdout.splitlines())
            assert listed == node_ids, run.stdout
        assert [s for _, s in self.requests.outcomes if s != 200] == []
        assert self.view.broken == [], self.view.broken[:5]
        assert self.view.unsynced == 0
        assert worker_id in self.view.routable


def test_three_replicas_the_leader_and_then_its_successor_sigkilled_mid_drain_the_last_leads(
    tmp_path,
    db,
    pki,
    docker_engine,
    gpus,
    nvml_lib,
    model_image,
    containers,
    workers_cleanup,
):
    """Replicas A (leading), B and C; two agents know all three. Node-a serves a model worker;
    node-b gets a hard notice (D in 20 s) while a batch job checkpoints for 8 s after its
    SIGTERM. A router and spotctl are given B only, another pair C only. Once node-b is
    tainted, A is SIGKILLed: B or C leads at term 2. Then that one is SIGKILLed too: the last
    leads at term 3. Node-b's drain ends `drained` inside D, after the second kill; every
    event the agents made is stored exactly once (nothing left in their outboxes); and the
    clients given the last replica's address alone worked throughout, through both changes of
    leader (every spotctl run listed both nodes, every request was answered, the router's
    table never went back), as did the other pair until its replica was killed."""
    a = start_replica(tmp_path / "a", db, pki)
    wait_until(lambda: leading(a), 10, "replica A to lead")
    b = start_replica(tmp_path / "b", db, pki)
    c = start_replica(tmp_path / "c", db, pki)
    replicas = {"A": a, "B": b, "C": c}
    for name, replica in (("B", b), ("C", c)):
        wait_until(lambda r=replica: "following" in r.proc.log(), 10, f"replica {name} to follow")
    every = AgentOptions(extra=["--coordinator", ",".join(r.address for r in replicas.values())])
    node_a = start_agent(tmp_path, "node-a", a, docker_engine.host, gpus, nvml_lib, every)
    node_b = start_agent(tmp_path, "node-b", a, docker_engine.host, gpus, nvml_lib, every)
    clients: dict[str, FollowerClients] = {}
    try:
        info = start_worker(a, "node-a", model_image)
        wait_state(a, info.worker_id, "ready", timeout=90)
        wait_until(
            lambda: sum(n.connected for n in a.admin().nodes()) == 2, 20, "both nodes to register"
        )
        for name in ("B", "C"):
            clients[name] = FollowerClients(
                tmp_path / f"router-{name}", replicas[name], info.worker_id
            )
        run_workload(
            docker_engine.client,
            name=containers + "job",
            node_id="node-b",
            kind="checkpoints",
            env={"CHECKPOINT_S": str(CHECKPOINT_S)},
        )
        wait_until(
            lambda: all(c.nodes.outcomes and c.requests.outcomes for c in clients.values()),
            30,
            "the clients at work before anything happens",
        )

        terminate_at = time.time() + D_S
        node_b.write_notice(
            {
                "id": "i-three-1",
                "action": "terminate",
                "terminate_at": terminate_at,
                "source": "aws-imds",
            }
        )
        a.admin().wait_for("tainted", node="node-b", timeout=10)
        a.admin().wait_for("sigterm_sent", node="node-b", timeout=10)

        killed = time.monotonic()
        a.proc.kill()
        second = wait_until(
            lambda: next((n for n in ("B", "C") if leading(replicas[n])), None),
            2 * FAILOVER_S,
            "B or C to lead",
            every=0.02,
        )
        print(f"first failover: {time.monotonic() - killed:.3f} s, replica {second} leads")
        assert lease_row(db) == (2, replicas[second].address)
        last = "C" if second == "B" else "B"

        # The pair given the second leader's address alone worked through the first change;
        # it is stopped before that replica is killed (one dead address is no address).
        wait_until(
            lambda: any(t > killed for t, _ in clients[second].nodes.outcomes),
            30,
            "a spotctl run after the first kill",
        )
        clients[second].stop()
        clients[second].check(["node-a", "node-b"], info.worker_id)

        killed, killed_wall = time.monotonic(), time.time()
        replicas[second].proc.kill()
        wait_until(
            lambda: leading(replicas[last]), 2 * FAILOVER_S, f"replica {last} to lead", every=0.02
        )
        print(f"second failover: {time.monotonic() - killed:.3f} s, replica {last} leads")
        assert lease_row(db) == (3, replicas[last].address)

        admin = replicas[last].admin()
        drained = admin.wait_for("drained", node="node-b", timeout=D_S + 10)
        assert drained["wall_time"] <= terminate_at
        assert drained["wall_time"] > killed_wall  # still draining when the second went

        wait_until(
            lambda: node_a.outbox_left() == 0 and node_b.outbox_left() == 0,
            20,
            "both outboxes to empty",
        )
        survivors = clients[last]
        wait_until(
            lambda: sum(t > killed for t, _ in survivors.nodes.outcomes) >= 5,
            30,
            "spotctl runs after the second kill",
        )
        wait_until(
            lambda: f" from {replicas[last].address}," in survivors.router.proc.log(),
            20,
            "the router's snapshot from the last leader",
        )
        survivors.stop()
        survivors.check(["node-a", "node-b"], info.worker_id)

        rows = stored_events(replicas[last].db)  # (a fact made twice: two uids, counted below)
        node_b_rows = [(k, r) for _, k, n, r in rows if n == "node-b"]
        kinds = [k for k, r in node_b_rows if r == drained["reclaim_id"]]
        for once in (
            "tainted",
            "deadline_file_written",
            "sigterm_sent",
            "container_exited",
            "verified_empty",
            "drained",
        ):
            assert kinds.count(once) == 1, (once, kinds)
        assert "overrun" not in kinds and "sigkill_sent" not in kinds
        assert [k for k, _ in node_b_rows].count("notice_received") == 1
        assert leading(replicas[last])
    finally:
        for pair in clients.values():
            pair.stop()
        node_a.proc.stop()
        node_b.proc.stop()
        for replica in replicas.values():
            replica.proc.stop()
