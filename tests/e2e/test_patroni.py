"""The database's own failover: the coordinator on a PostgreSQL cluster under Patroni
(tests/fakes/patroni.py: one etcd, two PostgreSQL instances, synchronous mode), through a multi-host
URI with `target_session_attrs=read-write`. The primary host is killed mid-drain; Patroni
promotes the standby; the coordinator reconnects to it. A real agent and a real container."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import grpc
import psycopg
import pytest

from fakes.dockerenv import run_workload
from fakes.fakenode import FakeNode
from fakes.harness import AgentOptions, start_agent, start_coordinator
from fakes.patroni import Cluster, start_cluster
from fakes.waiting import wait_until
from spotdrain.v1 import spotdrain_pb2 as pb

pytestmark = [pytest.mark.postgres, pytest.mark.docker]


@pytest.fixture
def patroni_cluster():
    """Never a skip: CI must run it (tests/setup.sh installs patroni and etcd-server)."""
    try:
        cluster = start_cluster()
    except Exception as e:  # noqa: BLE001 (any reason it could not start: one clear failure)
        where = (
            "CI must run the Patroni test"
            if os.environ.get("CI") == "true"
            else "tests/setup.sh installs Debian's patroni and etcd-server"
        )
        pytest.fail(f"could not start a Patroni cluster: {e}\n({where})", pytrace=False)
    yield cluster
    cluster.stop()


class TaintProbe:
    """A node's Taint every 100 ms, each with its own reclamation id and the agent's 800 ms
    deadline, in a thread: what each got, and how long it took."""

    def __init__(self, coordinator, pki, node_id: str = "node-probe") -> None:
        self.coordinator, self.pki, self.node_id = coordinator, pki, node_id
        self.answers: list[tuple[float, str, str, float]] = []  # (sent, reclaim id, code, took)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()

    async def _run(self) -> None:
        node = FakeNode(self.coordinator, self.pki, self.node_id)
        try:
            i = 0
            while not self._stop.is_set():
                i += 1
                reclaim_id, now = f"probe-{i}", time.time()
                request = pb.TaintRequest(
                    node_id=self.node_id,
                    reclaim_id=reclaim_id,
                    reason="notice",
                    terminate_at=now + 600,
                    grace_deadline=now + 590,
                )
                sent = time.monotonic()
                try:
                    await node.stub.Taint(request, timeout=0.8)
                    code = "OK"
                except grpc.aio.AioRpcError as e:
                    code = e.code().name
                self.answers.append((sent, reclaim_id, code, time.monotonic() - sent))
                await asyncio.sleep(0.1)
        finally:
            await node.close()

    def stop(self) -> list[tuple[float, str, str, float]]:
        self._stop.set()
        self.thread.join(10)
        return self.answers


def stored(admin, kind: str, node: str, timeout: float) -> dict:
    """The first `kind` event of `node`, asking again while the coordinator answers
    UNAVAILABLE (no primary: its reads fail fast too)."""

    def find() -> dict | None:
        try:
            return next((e for e in admin.events(node) if e["kind"] == kind), None)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
            return None

    return wait_until(find, timeout, f"{kind} on {node}", every=0.2)


def test_the_primary_killed_mid_drain_patroni_promotes_and_the_drain_completes_inside_d(
    tmp_path, patroni_cluster: Cluster, pki, docker_engine, gpus, nvml_lib, containers
):
    """A coordinator on the Patroni cluster's multi-host URI; a node gets a hard notice (D in
    40 s) with a job that checkpoints for 12 s. Right after the taint is stored, the primary
    host is killed (its Patroni and its postmaster, SIGKILL). Patroni promotes the standby;
    the coordinator reconnects to it; the node drains inside D and every event is stored once,
    none lost (the outbox empties). Meanwhile another node's Taints (every 100 ms, 800 ms
    deadline) fail fast with UNAVAILABLE while no primary answers, never with an answer that
    was not stored: each one answered OK is in the new primary."""
    cluster = patroni_cluster
    url = cluster.create_database("spotdrain")
    coordinator = start_coordinator(tmp_path / "coordinator", tls=pki, db=url)
    agent = start_agent(
        tmp_path,
        "node-a",
        coordinator,
        docker_engine.host,
        gpus,
        nvml_lib,
        AgentOptions(grace_s=10.0, overrun_s=2.0),
    )
    probe = None
    try:
        admin = coordinator.admin()
        wait_until(
            lambda: any(n.node_id == "node-a" and n.connected for n in admin.nodes()),
            20,
            "node-a to register",
        )
        run_workload(
            docker_engine.client,
            name=containers + "job",
            node_id="node-a",
            kind="checkpoints",
            env={"CHECKPOINT_S": "12"},
        )
        probe = TaintProbe(coordinator, pki)
        wait_until(lambda: any(a[2] == "OK" for a in probe.answers), 10, "a probe answered")
        terminate_at = time.time() + 40
        agent.write_notice(
            {
                "id": "i-patroni-1",
                "action": "terminate",
                "terminate_at": terminate_at,
                "source": "aws-imds",
            }
        )
        tainted = admin.wait_for("tainted", node="node-a", timeout=10)
        assert tainted["mode"] == "remote"

        old = cluster.primary()
        killed = time.monotonic()
        killed_wall = time.time()
        cluster.kill_primary()
        new = cluster.wait_primary(standby=False, timeout=60)
        promoted_s = time.monotonic() - killed
        assert new is not old
        drained = stored(admin, "drained", "node-a", timeout=60)
        assert killed_wall < drained["wall_time"] <= terminate_at
        wait_until(lambda: agent.outbox_left() == 0, 30, "the agent's outbox to empty")
        wait_until(
            lambda: any(a[0] > killed + promoted_s and a[2] == "OK" for a in probe.answers),
            30,
            "a probe answered after",
        )
        answers = probe.stop()
        print(
            f"primary killed: standby promoted after {promoted_s:.1f} s; probes: "
            + ", ".join(
                f"{code} {took * 1000:.0f} ms" for _, _, code, took in answers if code != "OK"
            )
        )

        with psycopg.connect(url, connect_timeout=5) as conn:
            rows = conn.execute("SELECT uid, kind, node_id, reclaim_id FROM events").fetchall()
            stored_taints = {
                r
                for (r,) in conn.execute(
                    "SELECT reclaim_id FROM taints WHERE node_id = 'node-probe'"
                ).fetchall()
            }
        # (A uid is stored once by the schema; a fact made twice would be two uids.)
        kinds = [k for _, k, n, r in rows if n == "node-a" and r == drained["reclaim_id"]]
        for once in (
            "notice_received",
            "tainted",
            "sigterm_sent",
            "container_exited",
            "verified_empty",
            "drained",
        ):
            assert kinds.count(once) == 1, (once, kinds)
        assert "overrun" not in kinds

        ok = {rid for _, rid, code, _ in answers if code == "OK"}
        assert ok <= stored_taints, f"answered but not stored: {sorted(ok - stored_taints)}"
        failed = [(code, took) for sent, _, code, took in answers if code != "OK"]
        assert failed, "no probe fell into the window with no primary"
        # Fast: refused inside each probe's 800 ms (the agent's), never DEADLINE_EXCEEDED.
        assert {code for code, _ in failed} == {"UNAVAILABLE"}, failed
    finally:
        if probe is not None:
            probe.stop()
        agent.proc.stop()
        coordinator.proc.stop()
