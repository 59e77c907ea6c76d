"""The renter's side of a reclaim, end to end: a real coordinator, a real agent, the renter's
real container. The owner pauses the node; the renter sees reclaim_at in the Rentals API, in its
watch stream and in the deadline file inside its container within a second; the container runs
until reclaim_at and no longer; reputation moves only when an on-demand provider broke its
promise. And a hard notice asks another node group for capacity before the node's containers
have exited."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from datetime import datetime

import grpc
import pytest

from fakes.dockerenv import run_workload
from fakes.harness import BIN, AgentOptions, start_agent, start_coordinator
from fakes.waiting import wait_until
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

pytestmark = pytest.mark.docker

# G = pause + 8 - 3: long enough to look at the container before reclaim_at, short for a test.
PAUSE = ["--pause-notice-s", "8", "--provider", "acme"]


def docker_time(stamp: str) -> float:
    """Docker's RFC 3339 times carry nanoseconds; Python parses microseconds."""
    head, _, frac = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(head + "+00:00").timestamp() + float("0." + (frac or "0"))


class Watch:
    """WatchRental in a thread, keeping (time received, rental) pairs."""

    def __init__(self, stub: pb_grpc.RentalsStub, rental_id: str) -> None:
        self.seen: list[tuple[float, pb.Rental]] = []
        self.call = stub.WatchRental(pb.GetRentalRequest(rental_id=rental_id))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for rental in self.call:
                self.seen.append((time.time(), rental))
        except grpc.RpcError:
            pass

    def first(self, predicate) -> tuple[float, pb.Rental] | None:
        return next(((t, r) for t, r in self.seen if predicate(r)), None)


@pytest.mark.parametrize("spot, ended_by", [(True, "reclaim"), (False, "provider")])
def test_a_paused_nodes_rental_runs_until_reclaim_at_and_no_longer(
    tmp_path,
    docker_engine,
    coordinator,
    pki,
    gpus,
    nvml_lib,
    rental_image,
    spot,
    ended_by,
    coordinator_db,
):
    extra = [*PAUSE, "--spot", "true" if spot else "false"]
    agent = start_agent(
        tmp_path,
        "node-a",
        coordinator,
        docker_engine.host,
        gpus,
        nvml_lib,
        AgentOptions(grace_s=3.0, overrun_s=1.0, extra=extra),
    )
    admin = pb_grpc.AdminStub(coordinator.channel())
    renter = pb_grpc.RentalsStub(coordinator.channel(pki.issue("renter:alice")))
    container = None
    try:
        wait_until(lambda: any(n.connected for n in coordinator.admin().nodes()), 20, "register")
        rental = renter.CreateRental(pb.CreateRentalRequest(node_id="node-a", image=rental_image))
        rental = wait_until(
            lambda: (
                (r := renter.GetRental(pb.GetRentalRequest(rental_id=rental.rental_id))).state
                == "running"
                and r
            ),
            30,
            "the rental to run",
        )
        assert rental.started_on_spot is spot and rental.provider == "acme"
        container = docker_engine.client.containers.get(f"spotdrain-rental-{rental.rental_id}")
        status = json.loads(
            subprocess.run(
                [str(BIN / "spotctl"), "--socket", str(agent.socket), "status", "--json"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
        )
        assert [r["rental_id"] for r in status["rentals"]] == [rental.rental_id]
        before = [
            admin.GetReputation(pb.GetReputationRequest(node_id="node-a")),
            admin.GetReputation(pb.GetReputationRequest(provider="acme")),
        ]
        watch = Watch(renter, rental.rental_id)
        wait_until(lambda: watch.seen, 10, "the watch's first answer")

        paused_at = time.time()
        out = subprocess.run(
            [str(BIN / "spotctl"), "--socket", str(agent.socket), "pause", "--json"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert json.loads(out.stdout)["paused"] is True, out

        # Within a second: in the watch stream, the API and the deadline file in the container.
        seen_at, told = wait_until(
            lambda: watch.first(lambda r: r.HasField("reclaim_at")),
            5,
            "reclaim_at in the watch stream",
        )
        assert seen_at - paused_at < 1.0
        reclaim_at = told.reclaim_at
        assert told.reclaim_reason == "pause" and told.state == "running"
        assert (
            renter.GetRental(pb.GetRentalRequest(rental_id=rental.rental_id)).reclaim_at
            == reclaim_at
        )
        assert reclaim_at == pytest.approx(paused_at + 5, abs=1.0)  # G = D - 3, D = pause + 8

        def deadline_in_container():
            code, output = container.exec_run(["cat", "/run/spotdrain/workload/deadline.json"])
            return code == 0 and json.loads(output)

        doc = wait_until(deadline_in_container, 5, "the deadline file in the container", 0.02)
        assert time.time() - paused_at < 1.0
        assert doc["reclaim_at_epoch"] == pytest.approx(reclaim_at, abs=1e-3)
        assert doc["reason"] == "pause"

        # It runs until reclaim_at ...
        time.sleep(max(0.0, reclaim_at - 0.7 - time.time()))
        container.reload()
        assert container.status == "running"
        # ... and no longer.
        ended = wait_until(
            lambda: (
                (r := renter.GetRental(pb.GetRentalRequest(rental_id=rental.rental_id))).state
                == "ended"
                and r
            ),
            15,
            "the rental to end",
        )
        container.reload()
        finished = docker_time(container.attrs["State"]["FinishedAt"])
        assert reclaim_at - 0.05 <= finished <= reclaim_at + 2.0
        assert (ended.ended_by, ended.exit_code) == (ended_by, 137)
        watch.thread.join(5)
        assert watch.seen[-1][1].state == "ended"  # the stream followed it to its end

        after = [
            admin.GetReputation(pb.GetReputationRequest(node_id="node-a")),
            admin.GetReputation(pb.GetReputationRequest(provider="acme")),
        ]
        for b, a in zip(before, after, strict=True):
            if spot:  # reclaiming is what spot means: neither score moves
                assert (a.score, a.counted, a.excluded_spot) == (b.score, 0, 1)
            else:  # the owner took back an on-demand rental: both scores drop
                assert a.score < b.score and a.failures == 1
        coordinator.admin().wait_for("drained", node="node-a", timeout=20)
    finally:
        agent.proc.stop()
        if container is not None:
            container.remove(force=True)


ACQUIRE = """
import json, sys, time
request = json.load(sys.stdin)
with open(sys.argv[1], "w") as f:
    json.dump({"at": time.time(), "request": request}, f)
"""


def test_a_hard_notice_asks_another_group_before_the_nodes_containers_exit(
    tmp_path, docker_engine, pki, gpus, nvml_lib, containers
):
    script, called = tmp_path / "acquire.py", tmp_path / "called.json"
    script.write_text(ACQUIRE)
    config = tmp_path / "acquirers.toml"
    config.write_text(f'[groups.group-b]\nexec = ["{sys.executable}", "{script}", "{called}"]\n')
    coordinator = start_coordinator(tmp_path / "c", tls=pki, extra=("--acquirers", str(config)))
    job = run_workload(
        docker_engine.client, name=containers + "ckpt", node_id="node-a", kind="checkpoints"
    )
    agent = start_agent(
        tmp_path,
        "node-a",
        coordinator,
        docker_engine.host,
        gpus,
        nvml_lib,
        AgentOptions(extra=["--node-group", "group-a"]),
    )
    admin = coordinator.admin()
    try:
        wait_until(lambda: any(n.connected for n in admin.nodes()), 20, "node-a to register")
        agent.write_notice(
            {"id": "i-group-a-1", "action": "terminate", "terminate_at": time.time() + 8}
        )
        drained = admin.wait_for("drained", node="node-a", timeout=30)
        asked = json.loads(called.read_text())
        assert asked["request"]["target_group"] == "group-b"
        assert asked["request"]["reclaimed_group"] == "group-a"
        notice = admin.wait_for("notice_received", node="node-a")
        [exited] = [
            e
            for e in admin.events(node="node-a", reclaim_id=drained["reclaim_id"])
            if e["kind"] == "container_exited"
        ]
        assert asked["at"] - notice["t0"] < 1.0  # within a second of the notice
        assert asked["at"] < exited["wall_time"]  # before the node's container had exited
        kinds = [e["kind"] for e in admin.events(reclaim_id=drained["reclaim_id"])]
        assert {"replacement_requested", "replacement_result"} <= set(kinds)
        job.reload()
        assert job.status == "exited"
    finally:
        agent.proc.stop()
        coordinator.proc.stop()
