"""A node lost without notice, end to end: a real coordinator, real agents, a real model
container and a renter's real container. node-a's agent is SIGKILLed and stays down (no
stream, no heartbeat, no notice): after --node-lost-s the node is `node_lost` with its worker
and rental named, the rental ended `lost`, and the model's replacement placed and ready on
node-b. Its agent started again later: `node_returned`, the worker it still runs drained off
it and the ended rental's container stopped."""

from __future__ import annotations

import pytest
from test_pause import wait_state

from fakes.dockerenv import remove_test_containers
from fakes.harness import AgentOptions, start_agent, start_coordinator
from fakes.waiting import wait_until
from images.fake_model import ensure_model_image
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

pytestmark = pytest.mark.docker

LOST_S = 3.0


def test_an_agent_killed_and_never_restarted_is_a_lost_node_then_a_returned_one(
    tmp_path, docker_engine, pki, gpus, nvml_lib, rental_image
):
    image = ensure_model_image(docker_engine.client)
    coordinator = start_coordinator(
        tmp_path / "coordinator", tls=pki, extra=("--node-lost-s", str(LOST_S))
    )
    admin = pb_grpc.AdminStub(coordinator.channel())
    renter = pb_grpc.RentalsStub(coordinator.channel(pki.issue("renter:alice")))
    events = coordinator.admin()
    agents = {}
    try:
        agents["node-a"] = start_agent(
            tmp_path, "node-a", coordinator, docker_engine.host, gpus, nvml_lib, AgentOptions()
        )
        wait_until(lambda: sum(n.connected for n in events.nodes()) == 1, 20, "node-a")
        admin.SetModelReplicas(
            pb.SetModelReplicasRequest(model="fake-model", replicas=1, image=image, slots=4),
            timeout=30,
        )
        first = events.wait_for("worker_starting", node="node-a", timeout=20)
        wait_state(coordinator, first["worker_id"], "ready", timeout=90)
        rental = renter.CreateRental(pb.CreateRentalRequest(node_id="node-a", image=rental_image))
        wait_until(
            lambda: (
                (r := renter.GetRental(pb.GetRentalRequest(rental_id=rental.rental_id))).state
                == "running"
                and r
            ),
            30,
            "the rental to run",
        )
        agents["node-b"] = start_agent(
            tmp_path, "node-b", coordinator, docker_engine.host, gpus, nvml_lib, AgentOptions()
        )
        wait_until(lambda: sum(n.connected for n in events.nodes()) == 2, 20, "node-b")

        agents["node-a"].proc.kill()  # and not restarted: its containers run on, unheard
        lost = events.wait_for("node_lost", node="node-a", timeout=LOST_S + 20)
        assert [w["worker_id"] for w in lost["workers"]] == [first["worker_id"]]
        assert [r["rental_id"] for r in lost["rentals"]] == [rental.rental_id]
        held = docker_engine.client.containers.get(f"spotdrain-rental-{rental.rental_id}")
        [container] = lost["containers"]  # as the agent last reported it
        assert container in (held.id, held.name)
        ended = renter.GetRental(pb.GetRentalRequest(rental_id=rental.rental_id))
        assert (ended.state, ended.ended_by) == ("ended", "lost")
        replacement = events.wait_for("worker_starting", node="node-b", timeout=20)
        wait_state(coordinator, replacement["worker_id"], "ready", timeout=90)
        record = events.timeline(lost["reclaim_id"]).reclamation
        assert (record.reason, record.outcome) == ("lost", "lost")

        agents["node-a"].restart()
        back = events.wait_for("node_returned", node="node-a", timeout=30)
        assert back["reclaim_id"] == lost["reclaim_id"]
        assert back["stale_workers"] == [first["worker_id"]]
        client = docker_engine.client

        def gone(name: str) -> bool:
            found = client.containers.list(filters={"name": name})
            return all(c.status != "running" for c in found)

        wait_until(lambda: gone(f"spotdrain-rental-{rental.rental_id}"), 30, "rental stopped")
        wait_until(lambda: gone(f"spotdrain-{first['worker_id']}"), 30, "stale worker drained")
    finally:
        for agent in agents.values():
            agent.proc.stop()
        coordinator.proc.stop()
        remove_test_containers(docker_engine.client, "spotdrain-w-")
        remove_test_containers(docker_engine.client, "spotdrain-rental-")
