"""Two coordinator replicas on one real PostgreSQL (tests/fakes/pgserver.py), as processes that
can be SIGKILLed and SIGSTOPped: one leads through the lease, the other sends callers to it, and a
leader that is gone or deposed is replaced within the lease's TTL
(coordinator/replicas/leadership.py)."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import grpc
import psycopg
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fakes.fakenode import FakeNode, aio_channel
from fakes.harness import AgentOptions, start_agent, start_coordinator
from fakes.pgserver import fresh_database
from fakes.waiting import wait_until
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

TTL_S, RENEW_S = 2.0, 0.5  # the defaults
# Kill to a new leader serving: the TTL, at most one renewal interval of the follower's asking
# (it asks right at the expiry it last saw), and the rebuild; the slack is a loaded test host's.
FAILOVER_S = TTL_S + RENEW_S + 1.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replica(work: Path, db: str, pki, *extra: str):
    port = free_port()
    return start_coordinator(
        work,
        tls=pki,
        db=db,
        port=port,
        extra=(
            "--advertise",
            f"127.0.0.1:{port}",
            "--lease-ttl-s",
            str(TTL_S),
            "--lease-renew-s",
            str(RENEW_S),
            *extra,
        ),
    )


def health(replica, service: str = "spotdrain.v1.AgentLink") -> str:
    with replica.channel() as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=0.5
            )
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def leading(replica) -> bool:
    return health(replica) == "SERVING"


def lease_row(db: str) -> tuple[int, str]:
    with psycopg.connect(db) as conn:
        [(term, holder)] = conn.execute("SELECT term, holder FROM leader_lease").fetchall()
    return term, holder.split(" ")[0]


def store_rows(db: str) -> dict[str, list]:
    with psycopg.connect(db) as conn:
        return {
            table: conn.execute(f"SELECT * FROM {table} ORDER BY 1, 2").fetchall()
            for table in ("nodes", "taints", "events", "node_drains", "reclamations", "workers")
        }


@pytest.fixture
def db(postgres, request) -> str:
    return fresh_database(postgres, request.node.name)


@pytest.fixture
def replicas(tmp_path, db, pki):
    """Replica A started first (it leads), then B (it follows)."""
    a = start_replica(tmp_path / "a", db, pki)
    wait_until(lambda: leading(a), 10, "replica A to lead")
    b = start_replica(tmp_path / "b", db, pki)
    wait_until(lambda: "following" in b.proc.log(), 10, "replica B to follow")
    yield a, b
    for replica in (a, b):
        replica.proc.stop()


async def test_a_follower_sends_agents_to_the_leader_and_serves_store_reads(replicas, pki):
    """An agent's Taint at the follower is refused UNAVAILABLE with the leader's address; the
    same Taint at the leader is stored, and the follower's WatchEvents and GetTimeline read it
    back from the store. Health says which replica serves what."""
    a, b = replicas
    node = FakeNode(b, pki, "node-a")
    try:
        request = pb.TaintRequest(
            node_id="node-a",
            reclaim_id="r-1",
            reason="notice",
            terminate_at=time.time() + 60,
            grace_deadline=time.time() + 50,
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await node.stub.Taint(request, timeout=2)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"the leader is {a.address}" in refused.value.details()
        assert ("spotdrain-leader", a.address) in tuple(refused.value.trailing_metadata())
        with pytest.raises(grpc.aio.AioRpcError) as stream_refused:
            await node.connect()
        assert stream_refused.value.code() == grpc.StatusCode.UNAVAILABLE

        leader = pb_grpc.AgentLinkStub(aio_channel(a, pki.issue("node:node-a")))
        reply = await leader.Taint(request, timeout=2)
        assert [t.reclaim_id for t in reply.taints] == ["r-1"]

        admin = b.admin()

        def timeline_at_the_follower():
            try:
                return admin.timeline("r-1")
            except grpc.RpcError as e:  # the record may land just after the Taint's answer
                assert e.code() == grpc.StatusCode.NOT_FOUND
                return None

        timeline = wait_until(timeline_at_the_follower, 5, "the follower to read the record")
        assert timeline.reclamation.node_id == "node-a"
        assert any(e["kind"] == "tainted" or e["reclaim_id"] == "r-1" for e in admin.events())
        with pytest.raises(grpc.RpcError) as listing:
            admin.nodes()  # live state: the leader's
        assert listing.value.code() == grpc.StatusCode.UNAVAILABLE

        services = (
            "spotdrain.v1.AgentLink",
            "spotdrain.v1.Routes",
            "spotdrain.v1.Rentals",
            "spotdrain.v1.Admin",
        )
        assert [health(a, s) for s in ("", *services)] == ["SERVING"] * 5
        assert [health(b, s) for s in ("", *services)] == ["SERVING"] + ["NOT_SERVING"] * 4
    finally:
        await node.close()


def test_the_leader_sigkilled_another_leads_in_time_and_a_real_agents_taint_succeeds(
    tmp_path, replicas, db, docker_engine, gpus, nvml_lib
):
    """A real agent is given both replicas. The leader is SIGKILLed: the follower leads within
    the TTL and a renewal interval, at the next term, and the agent's Taint for a hard notice
    succeeds there (mode remote, inside the agent's 800 ms), stored once."""
    a, b = replicas
    agent = start_agent(
        tmp_path,
        "node-a",
        a,
        docker_engine.host,
        gpus,
        nvml_lib,
        AgentOptions(extra=["--coordinator", f"{a.address},{b.address}"]),
    )
    try:
        wait_until(
            lambda: "registered with coordinator" in agent.proc.log(),
            20,
            "the agent to register with the leader",
        )
        assert lease_row(db) == (1, a.address)
        killed = time.monotonic()
        a.proc.kill()
        wait_until(lambda: leading(b), 2 * FAILOVER_S, "replica B to lead", every=0.02)
        failover_s = time.monotonic() - killed
        print(f"failover: {failover_s:.3f} s from SIGKILL to the new leader serving")
        assert failover_s <= FAILOVER_S
        assert lease_row(db) == (2, b.address)

        agent.write_notice(
            {
                "id": "i-replicas-1",
                "action": "terminate",
                "terminate_at": time.time() + 8,
                "source": "aws-imds",
            }
        )
        admin = b.admin()
        tainted = admin.wait_for("tainted", node="node-a", timeout=20)
        assert tainted["mode"] == "remote"
        assert [t.reclaim_id for t in pb_node(admin, "node-a").taints] == [tainted["reclaim_id"]]
        wait_until(
            lambda: (
                "registered with coordinator 127.0.0.1:" + b.address.split(":")[1]
                in agent.proc.log()
            ),
            20,
            "the agent's stream to move to B",
        )
        kinds = [e["kind"] for e in admin.events(node="node-a")]
        assert kinds.count("tainted") == 1 and kinds.count("notice_received") == 1
    finally:
        agent.proc.stop()


def pb_node(admin, node_id: str) -> pb.Node:
    [node] = [n for n in admin.nodes() if n.node_id == node_id]
    return node


async def test_a_leader_stopped_past_its_lease_is_deposed_and_changes_nothing(replicas, db, pki):
    """The leader is SIGSTOPped past its lease: the follower leads at the next term. Meanwhile
    an agent's stream to the old leader carries an event, and a Taint waits in its socket.
    SIGCONT: every write it attempts is refused (by its term, or once it knows, by itself), it
    steps down and exits non-zero, and the store holds exactly what it held before."""
    a, b = replicas
    node = FakeNode(a, pki, "node-a")
    try:
        await node.connect()
        a.proc.signal(19)  # SIGSTOP
        wait_until(lambda: leading(b), 2 * FAILOVER_S, "replica B to lead")
        assert lease_row(db) == (2, b.address)
        before = store_rows(db)

        uid = await node.event("notice_received", {"note": "sent to a stopped leader"})
        request = pb.TaintRequest(
            node_id="node-a",
            reclaim_id="r-late",
            reason="notice",
            terminate_at=time.time() + 60,
            grace_deadline=time.time() + 50,
        )
        late_taint = asyncio.ensure_future(node.stub.Taint(request, timeout=10))
        await asyncio.sleep(0.5)
        a.proc.signal(18)  # SIGCONT
        assert a.proc.popen.wait(10) != 0
        log = a.proc.log()
        assert "stepping down from term 1" in log, log[-3000:]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await late_taint
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        after = store_rows(db)
        assert after == before
        assert uid not in {row[1] for row in after["events"]}
        assert lease_row(db) == (2, b.address)
        assert leading(b)
    finally:
        await node.close()
