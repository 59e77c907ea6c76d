"""Who may say what to the coordinator: a node only for itself, operators only through the
admin API, and nobody in plaintext unless the coordinator was started --insecure."""

from __future__ import annotations

import subprocess
import time

import grpc
import pytest

from fakes.harness import BIN, start_coordinator
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc


def node_stub(coordinator, pki, node_id: str) -> pb_grpc.AgentLinkStub:
    return pb_grpc.AgentLinkStub(coordinator.channel(pki.issue(f"node:{node_id}")))


def event(node_id: str, uid: str, kind: str = "notice_received") -> pb.Event:
    return pb.Event(
        uid=uid,
        kind=kind,
        node_id=node_id,
        reclaim_id="rcl-x",
        wall_time=time.time(),
        details_json="{}",
    )


def test_node_taints_only_itself(coordinator, pki):
    """Node B's certificate asks for node A's taint: refused, nothing stored, the attempt kept."""
    stub_b = node_stub(coordinator, pki, "node-b")
    with pytest.raises(grpc.RpcError) as err:
        stub_b.Taint(pb.TaintRequest(node_id="node-a", reclaim_id="rcl-1"), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    reply = stub_b.Taint(pb.TaintRequest(node_id="node-b", reclaim_id="rcl-2"), timeout=5)
    assert [t.reclaim_id for t in reply.taints] == ["rcl-2"]
    admin = coordinator.admin()
    taints = {n.node_id: [t.reclaim_id for t in n.taints] for n in admin.nodes()}
    assert "node-a" not in taints
    refused = [e for e in admin.events() if e["kind"] == "identity_refused"]
    assert len(refused) == 1
    assert refused[0]["identity"] == "node:node-b" and refused[0]["claimed_node"] == "node-a"
    assert refused[0]["call"] == "Taint"


def test_node_reports_only_for_itself(coordinator, pki):
    """Node B registers honestly, then slips an event for node A into its stream: the stream
    is refused with PERMISSION_DENIED, and no event of the batch is stored."""
    stub_b = node_stub(coordinator, pki, "node-b")

    def messages():
        yield pb.AgentMessage(register=pb.Register(node_id="node-b", node_group="g"))
        yield pb.AgentMessage(
            events=pb.EventBatch(events=[event("node-b", "u-1"), event("node-a", "u-2")])
        )

    with pytest.raises(grpc.RpcError) as err:
        list(stub_b.Connect(messages(), timeout=5))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    events = coordinator.admin().events()
    assert [e["kind"] for e in events] == ["identity_refused"]
    assert events[0]["claimed_node"] == "node-a" and events[0]["call"] == "Event"


def test_node_registering_as_another_is_refused(coordinator, pki):
    stub_b = node_stub(coordinator, pki, "node-b")
    with pytest.raises(grpc.RpcError) as err:
        list(
            stub_b.Connect(
                iter([pb.AgentMessage(register=pb.Register(node_id="node-a"))]), timeout=5
            )
        )
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert coordinator.admin().nodes() == []


def test_events_are_idempotent_by_uid(coordinator, pki):
    """An agent resends a batch after a lost ack: each uid is stored once."""
    stub = node_stub(coordinator, pki, "node-a")

    def messages():
        yield pb.AgentMessage(register=pb.Register(node_id="node-a"))
        for _ in range(3):
            yield pb.AgentMessage(events=pb.EventBatch(events=[event("node-a", "same-uid")]))

    replies = list(stub.Connect(messages(), timeout=5))
    assert [r.WhichOneof("body") for r in replies] == ["registered", "ack", "ack", "ack"]
    assert [e["uid"] for e in coordinator.admin().events()] == ["same-uid"]


def test_nodes_cannot_use_the_admin_api(coordinator, pki):
    admin = pb_grpc.AdminStub(coordinator.channel(pki.issue("node:node-a")))
    with pytest.raises(grpc.RpcError) as err:
        admin.ListNodes(pb.ListNodesRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_plaintext_is_refused_by_a_tls_coordinator(coordinator):
    stub = pb_grpc.AdminStub(grpc.insecure_channel(coordinator.address))
    with pytest.raises(grpc.RpcError) as err:
        stub.ListNodes(pb.ListNodesRequest(), timeout=3)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_certificate_from_another_ca_is_refused(coordinator, tmp_path):
    from fakes.pki import Pki

    rogue = Pki(tmp_path / "rogue").issue("operator:mallory")
    creds = grpc.ssl_channel_credentials(
        open(coordinator.operator.ca, "rb").read(),
        open(rogue.key, "rb").read(),
        open(rogue.cert, "rb").read(),
    )
    stub = pb_grpc.AdminStub(grpc.secure_channel(coordinator.address, creds))
    with pytest.raises(grpc.RpcError) as err:
        stub.ListNodes(pb.ListNodesRequest(), timeout=3)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_coordinator_needs_tls_or_an_explicit_insecure(tmp_path):
    """Started with neither TLS flags nor --insecure: one clear line, exit code 2."""
    run = subprocess.run(
        [
            str(BIN / "spotdrain-coordinator"),
            "--listen",
            "127.0.0.1:0",
            "--db",
            str(tmp_path / "c.sqlite"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "spotdrain-coordinator: error: give --tls-cert, --tls-key and --client-ca, or --insecure"
    ]


def test_insecure_says_so_on_every_start(tmp_path):
    coord = start_coordinator(tmp_path / "c", tls=None)
    try:
        assert "PLAINTEXT" in coord.proc.log()
        assert "WARNING: --insecure" in coord.proc.log()
    finally:
        coord.proc.stop()


def test_health_and_reflection_are_served(coordinator):
    """Load balancers probe gRPC health; grpcurl and friends discover the API by reflection."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    channel = coordinator.channel()
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "spotdrain.v1.AgentLink", "spotdrain.v1.Admin"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"spotdrain.v1.AgentLink", "spotdrain.v1.Admin", "grpc.health.v1.Health"} <= names


SLURM = pb.WorkManager(name="slurm", node_name="gpu-017", cluster="west")


@pytest.mark.parametrize(
    "managers, named",
    [
        ([SLURM] * 9, "managers: 9 of them, at most 8"),
        ([pb.WorkManager(name="slurm", cluster="w" * 65)], "managers[0].cluster"),
        ([SLURM, pb.WorkManager(name="slurm", node_name="gpu\x1b[2J")], "managers[1].node_name"),
        ([pb.WorkManager(node_name="gpu-017")], "managers[0].name is required"),
    ],
)
def test_a_registration_with_bad_work_managers_is_refused(coordinator, pki, managers, named):
    """A node registers with too many work managers, or one whose fields are too long, hold a
    control character or have no name: INVALID_ARGUMENT naming the field, and the node is not
    stored. The same node with a manager of a name the coordinator does not know is taken, and
    its next registration replaces the list (a reconnect claiming nothing new stores nothing)."""
    stub = node_stub(coordinator, pki, "node-a")
    bad = pb.AgentMessage(register=pb.Register(node_id="node-a", managers=managers))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Connect(iter([bad]), timeout=5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in err.value.details()
    assert coordinator.admin().nodes() == []

    other = pb.WorkManager(name="pbs", node_name="n1", cluster="c" * 64)
    good = pb.AgentMessage(register=pb.Register(node_id="node-a", managers=[SLURM, other]))
    assert [r.WhichOneof("body") for r in stub.Connect(iter([good]), timeout=5)] == ["registered"]
    (node,) = coordinator.admin().nodes()
    assert list(node.managers) == [SLURM, other]
    # Its next registration, otherwise the same, replaces the list.
    again = pb.AgentMessage(register=pb.Register(node_id="node-a", managers=[SLURM]))
    list(stub.Connect(iter([again]), timeout=5))
    (node,) = coordinator.admin().nodes()
    assert list(node.managers) == [SLURM]


AWS = pb.CloudIdentity(
    provider="aws",
    instance_id="i-0123456789abcdef0",
    region="us-east-1",
    zone="us-east-1a",
    instance_type="g5.xlarge",
    spot=True,
)


@pytest.mark.parametrize(
    "cloud, named",
    [
        (pb.CloudIdentity(provider="ibm", instance_id="i-1"), "cloud.provider must be one of"),
        (pb.CloudIdentity(provider="aws", instance_id="i" * 65), "cloud.instance_id"),
        (pb.CloudIdentity(provider="gcp", zone="us-central1-a\x1b[2J"), "cloud.zone"),
        (pb.CloudIdentity(provider="azure", instance_type="Standard\n"), "cloud.instance_type"),
    ],
)
def test_a_registration_with_a_bad_cloud_identity_is_refused(coordinator, pki, cloud, named):
    """A node registers with a provider spotdrain does not read, or a value too long or holding a
    control character: INVALID_ARGUMENT naming the field, and the node is not stored. The same
    node with a good identity is listed with it; its next registration without one (an agent
    restarted before its metadata service answered) keeps it."""
    stub = node_stub(coordinator, pki, "node-a")
    bad = pb.AgentMessage(register=pb.Register(node_id="node-a", cloud=cloud))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Connect(iter([bad]), timeout=5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in err.value.details()
    assert coordinator.admin().nodes() == []

    good = pb.AgentMessage(register=pb.Register(node_id="node-a", cloud=AWS))
    assert [r.WhichOneof("body") for r in stub.Connect(iter([good]), timeout=5)] == ["registered"]
    (node,) = coordinator.admin().nodes()
    assert node.cloud == AWS
    again = pb.AgentMessage(register=pb.Register(node_id="node-a"))
    list(stub.Connect(iter([again]), timeout=5))
    (node,) = coordinator.admin().nodes()
    assert node.cloud == AWS
