"""Coordinator replicas with real clients through a leader's SIGKILL: two replicas on the real
PostgreSQL (as tests/e2e/test_replicas.py runs them), real agents over fake GPUs, real model and
batch containers, the reference router and spotctl as processes."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import threading
import time
import urllib.request

import psycopg
import pytest
from test_pause import PAUSE, Stream, spotctl, start_worker, wait_state
from test_replicas import (  # noqa: F401 (fixtures)
    FAILOVER_S,
    db,
    leading,
    lease_row,
    replicas,
    store_rows,
)

from fakes.dockerenv import remove_test_containers, run_workload
from fakes.fakenode import FakeNode
from fakes.harness import BIN, AgentOptions, start_agent, start_router
from fakes.waiting import wait_until
from images.fake_model import ensure_model_image

pytestmark = pytest.mark.docker


@pytest.fixture
def model_image(docker_engine) -> str:
    return ensure_model_image(docker_engine.client)


@pytest.fixture
def workers_cleanup(docker_engine):
    yield
    remove_test_containers(docker_engine.client, "spotdrain-w-")


def both(a, b, options: AgentOptions | None = None) -> AgentOptions:
    """`options` with the agent given both replicas."""
    options = options or AgentOptions()
    return AgentOptions(
        **{
            **options.__dict__,
            "extra": [*options.extra, "--coordinator", f"{a.address},{b.address}"],
        }
    )


class RouterView:
    """A router's view (its /routes), read every 10 ms in a thread: the versions it showed
    and, per worker, whether it was routable. Fails the moment a worker the test marked
    draining is routable, or the version goes down."""

    def __init__(self, url: str, model: str = "fake-model") -> None:
        self.url, self.model = url, model
        self.draining: set[str] = set()
        self.broken: list[str] = []
        self.versions: list[int] = []
        self.unsynced = 0  # reads with no table at all
        self.routable: set[str] = set()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            try:
                with urllib.request.urlopen(f"{self.url}/routes", timeout=2) as resp:
                    table = json.load(resp).get(self.model)
            except OSError as e:
                self.broken.append(f"router /routes failed: {e}")
                continue
            if table is None or not table["synced"]:
                self.unsynced += 1
                continue
            self.routable = {w["worker_id"] for w in table["workers"]}
            if self.versions and table["version"] < self.versions[-1]:
                self.broken.append(f"version went down: {self.versions[-1]} -> {table['version']}")
            self.versions.append(table["version"])
            # Taken after the read: a worker marked draining before it was read must be gone.
            if seen := self.routable & self.draining:
                self.broken.append(f"draining worker(s) routable at {table['version']}: {seen}")

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)


class Loop:
    """`what()` again and again in a thread until stopped; every outcome kept."""

    def __init__(self, what, every: float = 0.1) -> None:
        self.what, self.every = what, every
        self.outcomes: list[tuple[float, object]] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                outcome = self.what()
            except Exception as e:  # noqa: BLE001 (kept for the assertion)
                outcome = e
            self.outcomes.append((time.monotonic(), outcome))
            self._stop.wait(self.every)

    def stop(self) -> list[tuple[float, object]]:
        self._stop.set()
        self.thread.join(60)
        return self.outcomes


def spotctl_nodes(coordinator) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "spotctl"), *coordinator.cli_args(), "nodes", "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )


def chat(router_url: str) -> int:
    body = json.dumps(
        {"model": "fake-model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    request = urllib.request.Request(
        f"{router_url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_router_and_spotctl_given_only_the_follower_work_throughout_a_leader_sigkill(
    tmp_path, replicas, docker_engine, gpus, nvml_lib, model_image, workers_cleanup
):
    """A router and spotctl know only replica B, the follower; a real agent knows both and
    serves a model worker. The leader A is SIGKILLed: B leads within the failover time; every
    `spotctl nodes` (one every 100 ms) succeeds and lists the node; the router keeps a table
    with the worker, its version never goes down, it takes B's snapshot, and every request
    sent through it (one every 100 ms) is answered."""
    a, b = replicas
    agent = start_agent(tmp_path, "node-a", a, docker_engine.host, gpus, nvml_lib, both(a, b))
    router = start_router(tmp_path / "router", b)
    view = nodes = requests = None
    try:
        info = start_worker(a, "node-a", model_image)
        wait_state(a, info.worker_id, "ready", timeout=90)
        assert chat(router.url) == 200  # the first request starts the model's watch
        view = RouterView(router.url)
        wait_until(lambda: info.worker_id in view.routable, 10, "the router to route it")
        nodes = Loop(lambda: spotctl_nodes(b))
        requests = Loop(lambda: chat(router.url))
        wait_until(
            lambda: nodes.outcomes and requests.outcomes, 30, "the clients at work before the kill"
        )

        killed = time.monotonic()
        a.proc.kill()
        wait_until(lambda: leading(b), 2 * FAILOVER_S, "replica B to lead", every=0.02)
        assert time.monotonic() - killed <= FAILOVER_S
        wait_until(
            lambda: re.search(rf"snapshot at version \d+ from {b.address},", router.proc.log()),
            20,
            "the router's snapshot from B",
        )
        wait_until(
            lambda: sum(t > killed for t, _ in nodes.outcomes) >= 5,
            30,
            "spotctl runs after the kill",
        )

        for _, run in nodes.stop():
            assert isinstance(run, subprocess.CompletedProcess), run
            assert run.returncode == 0, run.stderr
            assert [json.loads(line)["node_id"] for line in run.stdout.splitlines()] == ["node-a"]
        ran_after = [t for t, _ in nodes.outcomes if t > killed]
        assert len(ran_after) >= 5
        answered = requests.stop()
        assert [s for _, s in answered if s != 200] == []
        view.stop()
        assert view.broken == [] and view.unsynced == 0
        assert info.worker_id in view.routable
        assert lease_row(b.db) == (2, b.address)
    finally:
        for loop in (nodes, requests):
            if loop is not None:
                loop.stop()
        if view is not None:
            view.stop()
        router.proc.stop()
        agent.proc.stop()


def stored_events(db_url: str) -> list[tuple[str, str, str, str]]:
    with psycopg.connect(db_url) as conn:
        return conn.execute(
            "SELECT uid, kind, node_id, reclaim_id FROM events ORDER BY id"
        ).fetchall()


def test_the_leader_sigkilled_mid_pause_and_mid_notice_both_nodes_drain_inside_d(
    tmp_path,
    replicas,
    docker_engine,
    gpus,
    nvml_lib,
    model_image,
    containers,
    workers_cleanup,
):
    """Node A's owner pauses while a client streams from its model worker; node B gets a hard
    notice (D in 10 s) with a batch job running that checkpoints for 4 s. The leader is
    SIGKILLed right after both are tainted. Replica B leads within the failover time; both
    reclamations end `drained` inside their D, after the kill, the stream cut at the grace
    deadline as `interrupted`; every event the agents made is stored exactly once (by uid;
    nothing left in their outboxes); and a router's view, read every 10 ms across the change
    of leader, never shows the draining worker routable."""
    a, b = replicas
    node_a = start_agent(
        tmp_path, "node-a", a, docker_engine.host, gpus, nvml_lib, both(a, b, PAUSE)
    )
    node_b = start_agent(
        tmp_path,
        "node-b",
        a,
        docker_engine.host,
        gpus,
        nvml_lib,
        both(a, b, AgentOptions(grace_s=3.0, overrun_s=1.0)),
    )
    router = start_router(tmp_path / "router", b)
    view = None
    try:
        info = start_worker(a, "node-a", model_image)
        ready = wait_state(a, info.worker_id, "ready", timeout=90)
        assert chat(router.url) == 200
        view = RouterView(router.url)
        wait_until(lambda: info.worker_id in view.routable, 10, "the router to route the worker")
        wait_until(
            lambda: any(n.node_id == "node-b" and n.connected for n in a.admin().nodes()),
            20,
            "node-b to register",
        )
        # Checkpoints for 4 s after its SIGTERM: it exits after the leader is gone.
        run_workload(
            docker_engine.client,
            name=containers + "job",
            node_id="node-b",
            kind="checkpoints",
            env={"CHECKPOINT_S": "4"},
        )
        stream = Stream(ready.gate_address, tokens=300, tokens_per_s=10)
        wait_until(lambda: len(stream.lines) >= 2, 10, "the stream to flow")

        paused_at = time.time()
        assert spotctl(node_a, "pause")["ok"] is True
        wait_until(lambda: info.worker_id not in view.routable, 10, "the router to drop it")
        view.draining.add(info.worker_id)  # from here on it must never be routable again
        terminate_at = time.time() + 10
        node_b.write_notice(
            {
                "id": "i-failover-1",
                "action": "terminate",
                "terminate_at": terminate_at,
                "source": "aws-imds",
            }
        )
        admin = a.admin()
        admin.wait_for("tainted", node="node-a", timeout=5)
        admin.wait_for("tainted", node="node-b", timeout=5)
        killed, killed_wall = time.monotonic(), time.time()
        a.proc.kill()
        wait_until(lambda: leading(b), 2 * FAILOVER_S, "replica B to lead", every=0.02)
        assert time.monotonic() - killed <= FAILOVER_S

        admin = b.admin()
        drained_a = admin.wait_for("drained", node="node-a", timeout=30)
        drained_b = admin.wait_for("drained", node="node-b", timeout=30)
        assert drained_a["wall_time"] <= paused_at + 8  # the pause's D (--pause-notice-s 8)
        assert drained_b["wall_time"] <= terminate_at
        # Both really were mid-drain when the leader went.
        assert min(drained_a["wall_time"], drained_b["wall_time"]) > killed_wall
        stream.join(15)
        assert stream.interrupted and not stream.done_marker
        wait_state(b, info.worker_id, "stopped", timeout=20)

        wait_until(
            lambda: node_a.outbox_left() == 0 and node_b.outbox_left() == 0,
            20,
            "both outboxes to empty",
        )
        # Every event acknowledged: nothing is left to arrive. (A uid is stored once by the
        # schema; a fact made twice would be two uids, counted below.)
        rows = stored_events(b.db)
        for node, reclaim_id in (
            ("node-a", drained_a["reclaim_id"]),
            ("node-b", drained_b["reclaim_id"]),
        ):
            kinds = [k for _, k, n, r in rows if n == node and r == reclaim_id]
            for once in ("tainted", "verified_empty", "drained"):
                assert kinds.count(once) == 1, (node, once, kinds)
            assert "overrun" not in kinds
        node_b_kinds = [k for _, k, n, _ in rows if n == "node-b"]
        assert node_b_kinds.count("notice_received") == 1
        assert node_b_kinds.count("sigterm_sent") == 1
        assert [k for _, k, n, _ in rows if n == "node-a"].count("stream_interrupted") == 1
        view.stop()
        assert view.broken == [], view.broken[:5]
        assert len(view.versions) > 100 and view.unsynced == 0
    finally:
        if view is not None:
            view.stop()
        router.proc.stop()
        node_a.proc.stop()
        node_b.proc.stop()


@pytest.mark.parametrize("when", ["at_once", "as_it_steps_down"])
async def test_a_deposed_leader_resumed_and_told_to_stop_exits_cleanly_writing_nothing(
    replicas, db, pki, when
):
    """The leader, with an agent's stream open, is SIGSTOPped past its lease and the follower
    leads. While it is stopped the agent sends an event on that stream. Then it is resumed and
    told to stop (SIGTERM), as systemd stops a unit it had frozen: at once, or once it has
    found itself deposed and is stepping down. Either way it ends through its own orderly
    shutdown, never the forced exit a deposed leader falls back on when its shutdown hangs
    (coordinator/replicas/leadership.py, STEP_DOWN_EXIT_S), and the store holds exactly what it held
    before."""
    a, b = replicas
    node = FakeNode(a, pki, "node-a")
    try:
        await node.connect()
        a.proc.signal(signal.SIGSTOP)
        wait_until(lambda: leading(b), 2 * FAILOVER_S, "replica B to lead")
        before = store_rows(db)
        uid = await node.event("notice_received", {"note": "sent to a stopped leader"})
        a.proc.signal(signal.SIGCONT)
        if when == "as_it_steps_down":
            wait_until(
                lambda: "stepping down from term 1" in a.proc.log(),
                10,
                "replica A to step down",
                every=0.001,
            )
        a.proc.signal(signal.SIGTERM)
        # The bound only stops a hang from hanging the test; the forced exit comes first.
        await asyncio.to_thread(a.proc.popen.wait, 30)
        log = a.proc.log()
        assert "still not stopped: exiting now" not in log, log[-3000:]
        assert "coordinator INFO stopping" in log, log[-3000:]
        after = store_rows(db)
        assert after == before
        assert uid not in {row[1] for row in after["events"]}
        assert lease_row(db) == (2, b.address)
        assert leading(b)
    finally:
        await node.close()
