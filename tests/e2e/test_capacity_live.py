"""Desired capacity with real agents and real model containers: the owner pauses a node, and the
model's replacement starts on a free node while the paused node is still draining. A router's
own view of the routes (WatchRoutes, in a background thread) never shows the model without a
ready worker."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from test_pause import spotctl, wait_state

from fakes.dockerenv import remove_test_containers
from fakes.harness import AgentOptions, start_agent
from fakes.waiting import wait_until
from images.fake_model import ensure_model_image
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

pytestmark = pytest.mark.docker

OPTIONS = AgentOptions(grace_s=4.0, overrun_s=1.0, extra=["--pause-notice-s", "12"])


class RouteWatcher:
    """A router's view: the snapshot, then every change. Records the fewest ready workers seen
    once the model first had two."""

    def __init__(self, coordinator, pki) -> None:
        stub = pb_grpc.RoutesStub(coordinator.channel(pki.issue("router:watcher")))
        self.call = stub.WatchRoutes(pb.WatchRoutesRequest(model="fake-model"))
        self.routes: dict[str, str] = {}
        self.armed = False
        self.fewest: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for update in self.call:
                if update.snapshot:
                    self.routes = {}
                for route in update.upsert:
                    self.routes[route.worker_id] = route.node_id
                for worker_id in update.removed:
                    self.routes.pop(worker_id, None)
                self.armed = self.armed or len(self.routes) >= 2
                if self.armed:
                    self.fewest = min(len(self.routes), self.fewest or 99)
        except grpc.RpcError:
            pass


def two_ready_workers(coordinator, admin, image: str) -> tuple[dict, dict]:
    """fake-model's two workers, ready: the first on node-a, then the second on node-b (the
    least loaded of b and c). Their worker_starting events."""
    events = coordinator.admin()
    admin.SetModelReplicas(
        pb.SetModelReplicasRequest(model="fake-model", replicas=1, image=image, slots=4), timeout=30
    )
    first = events.wait_for("worker_starting", node="node-a", timeout=20)
    admin.SetModelReplicas(pb.SetModelReplicasRequest(model="fake-model", replicas=2), timeout=30)
    second = events.wait_for("worker_starting", node="node-b", timeout=20)
    for started in (first, second):
        wait_state(coordinator, started["worker_id"], "ready", timeout=90)
    return first, second


def test_a_paused_nodes_worker_is_replaced_while_it_drains(
    tmp_path, docker_engine, coordinator, pki, gpus, nvml_lib
):
    image = ensure_model_image(docker_engine.client)
    agents = {
        n: start_agent(tmp_path, n, coordinator, docker_engine.host, gpus, nvml_lib, OPTIONS)
        for n in ("node-a", "node-b", "node-c")
    }
    admin = pb_grpc.AdminStub(coordinator.channel())
    events = coordinator.admin()
    watcher = None
    try:
        wait_until(lambda: sum(n.connected for n in events.nodes()) == 3, 20, "three nodes")
        watcher = RouteWatcher(coordinator, pki)
        first, _ = two_ready_workers(coordinator, admin, image)
        wait_until(lambda: watcher.armed, 10, "the router to see two workers")

        # A request in flight keeps node-a's worker draining after the pause.
        worker = wait_state(coordinator, first["worker_id"], "ready")
        gate = f"http://{worker.gate_address}/v1/chat/completions"
        holding = threading.Thread(target=_long_request, args=(gate,), daemon=True)
        holding.start()
        wait_until(
            lambda: (
                next(
                    w
                    for w in admin.ListWorkers(pb.ListWorkersRequest()).workers
                    if w.worker_id == first["worker_id"]
                ).slots_in_use
                == 1
            ),
            10,
            "the long request to hold a slot",
        )

        paused_at = time.time()
        assert spotctl(agents["node-a"], "pause")["paused"] is True
        replacement = events.wait_for("worker_starting", node="node-c", timeout=20)
        assert replacement["wall_time"] - paused_at < 2.0
        # Started while node-a's worker still drains (its request still open).
        assert wait_state(coordinator, first["worker_id"], "draining")
        assert not [e for e in events.events(node="node-a") if e["kind"] == "worker_stopped"]
        wait_state(coordinator, replacement["worker_id"], "ready", timeout=90)
        wait_state(coordinator, first["worker_id"], "stopped", timeout=30)
        events.wait_for("drained", node="node-a", timeout=30)
        [model] = admin.ListModels(pb.ListModelsRequest()).models
        assert (model.ready, model.draining) == (2, 0)
        watcher.call.cancel()
        watcher.thread.join(5)
        assert watcher.fewest is not None and watcher.fewest >= 1
        assert set(watcher.routes.values()) == {"node-b", "node-c"}
    finally:
        if watcher is not None:
            watcher.call.cancel()
        for agent in agents.values():
            agent.proc.stop()
        remove_test_containers(docker_engine.client, "spotdrain-w-")


def _long_request(url: str) -> None:
    import json
    import urllib.request

    body = json.dumps(
        {
            "model": "fake-model",
            "stream": True,
            "max_tokens": 10_000,
            "messages": [{"role": "user", "content": "hold"}],
        }
    ).encode()
    req = urllib.request.Request(
        url,
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", "X-Fake-Tokens-Per-S": "20"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            for _ in resp:
                pass
    except OSError:
        pass  # cut at the grace deadline: expected
