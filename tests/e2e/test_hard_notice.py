"""The hard-notice timeline on real parts: a coordinator and an agent as processes, a real
Docker engine with real containers, the real pynvml over the fake libnvidia-ml.so.1."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import time

import pytest

from fakes.dockerenv import run_workload
from fakes.harness import AgentOptions, start_agent
from fakes.waiting import wait_until

pytestmark = pytest.mark.docker


def test_whole_timeline_on_one_node(
    tmp_path, docker_engine, coordinator, gpus, nvml_lib, containers, coordinator_db
):
    """A provider gives node A eight seconds. Its three batch jobs (one quits at once, one
    checkpoints for a second, one ignores SIGTERM) are signalled after the taint, the stubborn
    one is killed at G, the node is verified empty and `drained` is recorded with the seconds to
    spare. Node B's container and an unlabelled one are never touched."""
    client = docker_engine.client
    mk = lambda name, node, kind, **kw: run_workload(  # noqa: E731
        client, name=containers + name, node_id=node, kind=kind, **kw
    )
    quick = mk("quick", "node-a", "exits_on_term")
    ckpt = mk("ckpt", "node-a", "checkpoints", env={"CHECKPOINT_S": "1"})
    stubborn = mk("stubborn", "node-a", "ignores_term")
    other_node = mk("other", "node-b", "exits_on_term")
    unlabelled = mk("unlabelled", "node-a", "exits_on_term", labels={"spotdrain.node": ""})
    agent = start_agent(
        tmp_path,
        "node-a",
        coordinator,
        docker_engine.host,
        gpus,
        nvml_lib,
        AgentOptions(grace_s=4.0, overrun_s=1.0),
    )
    admin = coordinator.admin()
    try:
        t_notice = time.time()
        agent.write_notice(
            {
                "id": "i-0abc-1",
                "action": "terminate",
                "terminate_at": t_notice + 8,
                "source": "aws-imds",
            }
        )
        drained = admin.wait_for("drained", node="node-a", timeout=30)
        everything = admin.events(node="node-a", reclaim_id=drained["reclaim_id"])
        # The coordinator's own part of the timeline (step 6: no other node group to ask, in
        # this test) lands whenever its Taint ran; the agent's part is checked in order.
        ours = [e["kind"] for e in everything if e["uid"].startswith("coordinator-")]
        assert ours == ["replacement_unavailable"]
        events = [e for e in everything if not e["uid"].startswith("coordinator-")]
        kinds = [e["kind"] for e in events]
        # Invariant 1: tainted before the first SIGTERM.
        assert kinds.index("tainted") < kinds.index("sigterm_sent")
        assert kinds[0] == "notice_received"
        assert [e["mode"] for e in events if e["kind"] == "tainted"] == ["remote"]
        signalled = {e["name"] for e in events if e["kind"] == "sigterm_sent"}
        assert signalled == {containers + n for n in ("quick", "ckpt", "stubborn")}
        killed = [e["name"] for e in events if e["kind"] == "sigkill_sent"]
        assert killed == [containers + "stubborn"]
        exits = {e["name"]: e["exit_code"] for e in events if e["kind"] == "container_exited"}
        assert exits == {
            containers + "quick": 0,
            containers + "ckpt": 0,
            containers + "stubborn": 137,
        }
        assert kinds[-2:] == ["verified_empty", "drained"]
        notice = events[0]
        # G = D - 4: the SIGKILL went out at G, not before.
        kill_ev = next(e for e in events if e["kind"] == "sigkill_sent")
        assert kill_ev["wall_time"] >= notice["grace_deadline"]
        assert drained["spare_s"] == pytest.approx(
            notice["terminate_at"] - drained["wall_time"], abs=0.01
        )
        assert 0 < drained["spare_s"] < 4
        other_node.reload()
        unlabelled.reload()
        assert other_node.status == "running" and unlabelled.status == "running"
        for c in (quick, ckpt, stubborn):
            c.reload()
            assert c.status == "exited"
        assert "overrun" not in kinds
        deadline_doc = agent.deadline_file.read_text()
        assert drained["reclaim_id"] in deadline_doc
    finally:
        agent.proc.stop()


def by_kind(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["kind"] == kind]


def test_coordinator_frozen_local_taint_then_remote(
    tmp_path, docker_engine, coordinator, gpus, nvml_lib, containers
):
    """The coordinator hangs (SIGSTOP: calls neither answer nor fail) just as the notice lands.
    The agent waits 800 ms for the taint, then taints locally and signals right after; when the
    coordinator comes back the remote taint lands and every event made meanwhile arrives, once."""
    quick = run_workload(
        docker_engine.client, name=containers + "quick", node_id="node-a", kind="exits_on_term"
    )
    agent = start_agent(
        tmp_path,
        "node-a",
        coordinator,
        docker_engine.host,
        gpus,
        nvml_lib,
        AgentOptions(grace_s=3.0, overrun_s=1.0),
    )
    admin = coordinator.admin()
    try:
        wait_until(lambda: any(n.connected for n in admin.nodes()), 10, "node-a to register")
        coordinator.proc.signal(signal.SIGSTOP)
        agent.write_notice(
            {"id": "frozen-1", "action": "terminate", "terminate_at": time.time() + 10}
        )
        wait_until(lambda: quick.reload() or quick.status == "exited", 10, "the SIGTERM")
        coordinator.proc.signal(signal.SIGCONT)
        drained = admin.wait_for("drained", node="node-a", timeout=20)
        admin.wait_for("tainted", node="node-a", mode="remote", timeout=20)
        events = admin.events(node="node-a", reclaim_id=drained["reclaim_id"])
        kinds = [e["kind"] for e in events]
        taints = by_kind(events, "tainted")
        assert [t["mode"] for t in taints] == ["local", "remote"]
        assert taints[1]["after_local"] is True
        # The local taint came at the 800 ms deadline, not before; SIGTERM after it.
        assert taints[0]["t_offset_s"] >= 0.8
        sigterm = by_kind(events, "sigterm_sent")[0]
        assert sigterm["wall_time"] >= taints[0]["wall_time"]
        assert kinds.index("tainted") < kinds.index("sigterm_sent")
        # Every event exactly once, despite the stream stalling and resending.
        uids = [e["uid"] for e in admin.events()]
        assert len(uids) == len(set(uids))
        for kind in ("notice_received", "sigterm_sent", "container_exited", "drained"):
            assert kinds.count(kind) == 1, kind
        assert [t.reclaim_id for n in admin.nodes() for t in n.taints] == [drained["reclaim_id"]]
    finally:
        coordinator.proc.signal(signal.SIGCONT)
        agent.proc.stop()


def test_gpu_process_outlives_every_container(
    tmp_path, docker_engine, coordinator, gpus, nvml_lib, containers
):
    """A CUDA process outside any container keeps a GPU busy after the jobs exit. The node is
    not empty, so there is no `drained`; at O the agent records `overrun`, once. When the
    process finally dies the node is seen empty, but it is still not `drained`."""
    run_workload(
        docker_engine.client, name=containers + "quick", node_id="node-a", kind="exits_on_term"
    )
    holder = subprocess.Popen(["sleep", "120"])
    gpus.add_process(holder.pid, gpu=1)
    agent = start_agent(
        tmp_path,
        "node-a",
        coordinator,
        docker_engine.host,
        gpus,
        nvml_lib,
        AgentOptions(grace_s=2.0, overrun_s=1.0),
    )
    admin = coordinator.admin()
    try:
        agent.write_notice(
            {"id": "gpu-hold", "action": "terminate", "terminate_at": time.time() + 4}
        )
        overrun = admin.wait_for("overrun", node="node-a", timeout=20)
        holder.kill()
        holder.wait()
        admin.wait_for("verified_empty", node="node-a", timeout=10)
        # A later notice's event comes through the same ordered outbox after anything this
        # reclamation could still say (a second overrun, a late drained): a barrier.
        agent.write_notice({"id": "later", "action": "terminate", "terminate_at": time.time() + 60})
        admin.wait_for("notice_received", node="node-a", notice_id="later", timeout=10)
        kinds = [e["kind"] for e in admin.events(node="node-a", reclaim_id=overrun["reclaim_id"])]
        assert kinds.count("overrun") == 1
        assert "drained" not in kinds
        notice = by_kind(admin.events(node="node-a"), "notice_received")[0]
        assert overrun["wall_time"] >= notice["overrun_at"]
        assert kinds.index("container_exited") < kinds.index("overrun")
        assert admin.timeline(overrun["reclaim_id"]).reclamation.outcome == "overrun"
    finally:
        holder.kill()
        agent.proc.stop()


@pytest.mark.parametrize("fault", ["gpu_lost", "init_failed", "slow_ms"])
def test_nvml_failing_is_never_drained(
    tmp_path, docker_engine, coordinator, gpus, nvml_lib, containers, fault
):
    """NVML cannot answer (the GPU fell off the bus, the driver will not load, or every call
    hangs past its timeout). Docker says the containers are gone, but an observation that
    failed is not "empty": no `drained`, the failure is recorded, and the node overruns."""
    run_workload(
        docker_engine.client, name=containers + "quick", node_id="node-a", kind="exits_on_term"
    )
    if fault == "init_failed":
        gpus.fault("init_failed")
    agent = start_agent(
        tmp_path,
        "node-a",
        coordinator,
        docker_engine.host,
        gpus,
        nvml_lib,
        AgentOptions(grace_s=2.0, overrun_s=1.0, nvml_timeout_s=0.3),
    )
    admin = coordinator.admin()
    try:
        gpus.fault(fault, 1500) if fault == "slow_ms" else gpus.fault(fault)
        agent.write_notice(
            {"id": f"nvml-{fault}", "action": "terminate", "terminate_at": time.time() + 4}
        )
        admin.wait_for("overrun", node="node-a", timeout=20)
        events = admin.events(node="node-a")
        kinds = [e["kind"] for e in events]
        assert "drained" not in kinds and "verified_empty" not in kinds
        failures = by_kind(events, "verification_failed")
        assert failures and all("nvml" in f["error"] for f in failures)
        assert by_kind(events, "container_exited")[0]["exit_code"] == 0
    finally:
        agent.proc.stop()


def test_agent_killed_mid_reclamation_resumes_with_same_deadlines(
    tmp_path, docker_engine, coordinator, gpus, nvml_lib, containers
):
    """The agent is SIGKILLed while its node drains, and systemd restarts it. It reloads the
    bundle: the same T0, D, G and O, no second SIGTERM to anything, the stubborn job still
    killed at the original G, and the reclamation completes."""
    client = docker_engine.client
    ckpt = run_workload(
        client,
        name=containers + "ckpt",
        node_id="node-a",
        kind="checkpoints",
        env={"CHECKPOINT_S": "2"},
    )
    stubborn = run_workload(
        client, name=containers + "stubborn", node_id="node-a", kind="ignores_term"
    )
    agent = start_agent(
        tmp_path,
        "node-a",
        coordinator,
        docker_engine.host,
        gpus,
        nvml_lib,
        AgentOptions(grace_s=4.0, overrun_s=1.0),
    )
    admin = coordinator.admin()
    try:
        agent.write_notice(
            {"id": "restart-1", "action": "terminate", "terminate_at": time.time() + 7}
        )
        wait_until(
            lambda: len(by_kind(admin.events(node="node-a"), "sigterm_sent")) == 2,
            10,
            "both SIGTERMs",
        )
        bundle_path = next((agent.state_dir / "reclamations").glob("rcl-*.json"))
        before = json.loads(bundle_path.read_text())
        agent.proc.kill()
        agent.restart()
        drained = admin.wait_for("drained", node="node-a", timeout=20)
        after = json.loads(bundle_path.read_text())
        for key in ("t0", "terminate_at", "grace_deadline", "overrun_at"):
            assert after[key] == before[key], key
        events = admin.events(node="node-a", reclaim_id=drained["reclaim_id"])
        kinds = [e["kind"] for e in events]
        assert kinds.count("notice_received") == 1
        assert kinds.count("sigterm_sent") == 2  # one round, before the kill
        assert [e["name"] for e in by_kind(events, "sigkill_sent")] == [containers + "stubborn"]
        kill = by_kind(events, "sigkill_sent")[0]
        assert kill["wall_time"] >= before["grace_deadline"]
        # The stubborn job heard SIGTERM once: the restart sent no second round.
        assert stubborn.logs().decode().count("SIGTERM ignored") == 1
        ckpt.reload()
        assert ckpt.attrs["State"]["ExitCode"] == 0
    finally:
        agent.proc.stop()


def test_events_made_while_the_coordinator_is_down_arrive_once_it_is_back(
    tmp_path, docker_engine, pki, gpus, nvml_lib, containers, coordinator_db
):
    """The coordinator crashes (SIGKILL) before the notice and comes back on the same database
    a few seconds later. The agent drained under its local taint meanwhile; every event it made
    is in its outbox on disk and reaches the coordinator exactly once."""
    from fakes.harness import start_coordinator

    coord = start_coordinator(tmp_path / "coordinator", tls=pki, db=coordinator_db)
    port = int(coord.address.rsplit(":", 1)[1])
    run_workload(
        docker_engine.client, name=containers + "job", node_id="node-a", kind="exits_on_term"
    )
    agent = start_agent(
        tmp_path,
        "node-a",
        coord,
        docker_engine.host,
        gpus,
        nvml_lib,
        AgentOptions(grace_s=3.0, overrun_s=1.0),
    )
    try:
        wait_until(lambda: any(n.connected for n in coord.admin().nodes()), 10, "registration")
        coord.proc.kill()
        agent.write_notice(
            {"id": "away-1", "action": "terminate", "terminate_at": time.time() + 20}
        )
        wait_until(lambda: "drained" in agent.proc.log(), 15, "the drain under the local taint")

        def stored() -> int:
            return (
                sqlite3.connect(agent.state_dir / "outbox.sqlite")
                .execute("SELECT count(*) FROM outbox")
                .fetchone()[0]
            )

        # A step's events reach SQLite a moment after the step (its bundle holds them until
        # then): notice, tainted, deadline file, sigterm, exit, verified, drained.
        wait_until(lambda: stored() >= 6, 10, "the drain's events in the outbox on disk")
        coord = start_coordinator(tmp_path / "coordinator", tls=pki, db=coord.db, port=port)
        admin = coord.admin()
        admin.wait_for("tainted", node="node-a", mode="remote", timeout=20)
        events = admin.events(node="node-a")
        kinds = [e["kind"] for e in events]
        for kind in (
            "notice_received",
            "sigterm_sent",
            "container_exited",
            "verified_empty",
            "drained",
        ):
            assert kinds.count(kind) == 1, kind
        assert [e["mode"] for e in by_kind(events, "tainted")] == ["local", "remote"]
        wait_until(
            lambda: (
                sqlite3.connect(agent.state_dir / "outbox.sqlite")
                .execute("SELECT count(*) FROM outbox")
                .fetchone()[0]
                == 0
            ),
            10,
            "the outbox to empty",
        )
        timeline = admin.timeline()
        assert timeline.reclamation.outcome == "drained"
    finally:
        agent.proc.stop()
        coord.proc.stop()


def test_a_job_started_by_hand_during_the_drain_is_stopped_too(
    tmp_path, docker_engine, coordinator, gpus, nvml_lib, containers
):
    """While the node is tainted an operator starts a labelled job by hand. The node accepts
    no new work: the agent's next look finds it and signals it like the rest."""
    client = docker_engine.client
    run_workload(client, name=containers + "stubborn", node_id="node-a", kind="ignores_term")
    agent = start_agent(
        tmp_path,
        "node-a",
        coordinator,
        docker_engine.host,
        gpus,
        nvml_lib,
        AgentOptions(grace_s=4.0, overrun_s=1.0),
    )
    admin = coordinator.admin()
    try:
        agent.write_notice(
            {"id": "late-start", "action": "terminate", "terminate_at": time.time() + 8}
        )
        admin.wait_for("sigterm_sent", node="node-a")
        late = run_workload(
            client, name=containers + "late", node_id="node-a", kind="exits_on_term"
        )
        admin.wait_for("sigterm_sent", node="node-a", name=containers + "late")
        drained = admin.wait_for("drained", node="node-a")
        late.reload()
        assert late.status == "exited" and late.attrs["State"]["ExitCode"] == 0
        assert drained["spare_s"] > 0
    finally:
        agent.proc.stop()


def test_an_agent_with_the_wrong_certificate_still_answers_notices(
    tmp_path, docker_engine, coordinator, pki, gpus, nvml_lib, containers
):
    """node-a was given node-b's certificate by mistake. The coordinator refuses everything it
    says (and records the attempts), but the provider's deadline does not care: the agent stays
    up, taints locally (the refused Taint call is no answer), and drains its node."""
    job = run_workload(
        docker_engine.client, name=containers + "job", node_id="node-a", kind="exits_on_term"
    )
    agent = start_agent(
        tmp_path,
        "node-a",
        coordinator,
        docker_engine.host,
        gpus,
        nvml_lib,
        AgentOptions(grace_s=3.0, overrun_s=1.0),
        identity=pki.issue("node:node-b"),
    )
    admin = coordinator.admin()
    try:
        admin.wait_for("identity_refused", claimed_node="node-a", call="Register", timeout=10)
        agent.write_notice(
            {"id": "wrong-cert", "action": "terminate", "terminate_at": time.time() + 10}
        )
        wait_until(lambda: "drained" in agent.proc.log(), 15, "the local drain")
        assert "tainted {'mode': 'local'" in agent.proc.log()
        job.reload()
        assert job.status == "exited"
        assert agent.proc.popen.poll() is None
        assert not [
            e for e in admin.events() if e["node"] == "node-a" and e["kind"] != "identity_refused"
        ]
        assert admin.nodes() == []
    finally:
        agent.proc.stop()
