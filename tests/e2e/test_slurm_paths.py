"""The Slurm drain's harder paths on a real cluster (tests/fakes/slurm.py): the controller away
at the notice, the agent SIGKILLed mid-drain, a cancel, the owner's pause and resume, and a host
running Docker containers beside Slurm jobs. docs/workloads.md "Slurm"."""

from __future__ import annotations

import json
import signal
import time

import pytest
from test_pause import spotctl
from test_slurm_drain import CHECKPOINTING, STUBBORN, cluster, running_on, slurm_agent

from fakes.dockerenv import run_workload
from fakes.waiting import wait_until

__all__ = ["cluster"]  # the fixture, shared with test_slurm_drain.py


def submit_training(cluster, tmp_path, node: str | None = None) -> int:
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    return cluster.submit(
        CHECKPOINTING,
        node,
        requeue=True,
        name="train",
        args=[f"--export=ALL,CKPT_DIR={tmp_path}/ckpt"],
    )


def node_line(cluster, node: str) -> str:
    return cluster.cli("scontrol", "-o", "show", "node", node)


def test_with_slurmctld_stopped_the_agent_signals_the_steps_itself_and_drains_later(
    tmp_path, cluster, coordinator, gpus, nvml_lib
):
    """slurmctld is down when the notice comes. The DRAIN cannot land; after the taint's 800 ms
    the agent SIGTERMs the job's processes itself (from the node's own slurmstepd), the job
    checkpoints. Once slurmctld is back the DRAIN lands, the job is requeued, and the node is
    verified drained: an unanswered controller is never taken for an empty node."""
    job = submit_training(cluster, tmp_path)
    node = running_on(cluster, job)
    wait_until(lambda: "running on" in cluster.output(job), 10, "the job's first line")
    agent = slurm_agent(tmp_path, cluster, node, coordinator, gpus, nvml_lib)
    admin = coordinator.admin()
    cluster.stop_controller()
    try:
        noticed = time.time()
        agent.write_notice({"id": "i-away-1", "action": "terminate", "terminate_at": noticed + 25})
        sigterm = admin.wait_for("sigterm_sent", node=node, timeout=20)
        assert sigterm["via"] == "pid" and sigterm["container"] == f"slurm:{job}"
        assert sigterm["wall_time"] - noticed < 2.0  # not held for the controller's timeouts
        wait_until(lambda: "checkpointed" in cluster.output(job), 10, "the checkpoint")
        failed = admin.wait_for("verification_failed", node=node, timeout=20)
        assert "slurm" in failed["error"]
        assert "drained" not in admin.kinds(node=node)
    finally:
        cluster.start_controller()
    try:
        drained = admin.wait_for("drained", node=node, timeout=30)
        requeued = admin.wait_for("requeued", node=node, timeout=30)
        assert requeued["unit"] == f"slurm:{job}"
        story = admin.events(node=node, reclaim_id=drained["reclaim_id"])
        kinds = [e["kind"] for e in story]
        # The SIGTERM did not wait for the DRAIN, which landed once slurmctld was back.
        assert "manager_cordon_failed" in kinds and "overrun" not in kinds
        assert kinds.index("sigterm_sent") < kinds.index("manager_cordoned")
        assert "DRAIN" in node_line(cluster, node)
    finally:
        agent.proc.stop()


def test_an_agent_killed_mid_drain_keeps_its_deadlines_and_kills_at_g_without_a_second_sigterm(
    tmp_path, cluster, coordinator, gpus, nvml_lib
):
    """The agent is SIGKILLed right after the job ignoring SIGTERM had its SIGTERM. The
    restarted agent resumes from its bundle: the same deadlines, no second SIGTERM, and its own
    SIGKILL at G to what is left; the node is verified drained."""
    job = cluster.submit(STUBBORN, None, requeue=False, name="stubborn")
    node = running_on(cluster, job)
    agent = slurm_agent(tmp_path, cluster, node, coordinator, gpus, nvml_lib)
    admin = coordinator.admin()
    try:
        noticed = time.time()
        agent.write_notice({"id": "i-kill-1", "action": "terminate", "terminate_at": noticed + 10})
        admin.wait_for("sigterm_sent", node=node, timeout=20)
        bundle_before = bundle(agent)
        agent.proc.kill()
        agent.restart()
        drained = admin.wait_for("drained", node=node, timeout=30)
        story = admin.events(node=node, reclaim_id=drained["reclaim_id"])
        assert [e["via"] for e in story if e["kind"] == "sigterm_sent"] == ["scancel"]
        sigkill = next(e for e in story if e["kind"] == "sigkill_sent")
        assert sigkill["via"] == "pid" and sigkill["wall_time"] >= noticed + 4  # G = D - 6 s
        after = bundle(agent)
        assert (after["terminate_at"], after["grace_deadline"]) == (
            bundle_before["terminate_at"],
            bundle_before["grace_deadline"],
        )
    finally:
        agent.proc.stop()


def bundle(agent) -> dict:
    (path,) = (agent.state_dir / "reclamations").glob("*.json")
    return json.loads(path.read_text())


def test_a_cancel_before_anything_stopped_lifts_the_drain(
    tmp_path, cluster, coordinator, gpus, nvml_lib
):
    """The provider withdraws its notice while the coordinator is hung and nothing was
    signalled yet: spotdrain's DRAIN is lifted, the job runs on untouched."""
    job = submit_training(cluster, tmp_path)
    node = running_on(cluster, job)
    agent = slurm_agent(tmp_path, cluster, node, coordinator, gpus, nvml_lib, taint_answer_s=10.0)
    admin = coordinator.admin()
    wait_until(lambda: any(n.connected for n in admin.nodes()), 10, "registration")
    coordinator.proc.signal(signal.SIGSTOP)
    try:
        agent.write_notice(
            {"id": "i-cancel-1", "action": "terminate", "terminate_at": time.time() + 30}
        )
        wait_until(lambda: "DRAIN" in node_line(cluster, node), 10, "spotdrain's DRAIN")
        agent.write_notice({"id": "i-cancel-1", "action": "cancel"})
        wait_until(lambda: "DRAIN" not in node_line(cluster, node), 10, "the DRAIN lifted")
    finally:
        coordinator.proc.signal(signal.SIGCONT)
    admin.wait_for("manager_uncordoned", node=node, timeout=20)
    assert "sigterm_sent" not in admin.kinds(node=node)
    assert cluster.job_field(job, "JobState") == "RUNNING"
    assert cluster.job_field(job, "Restarts") == "0"
    agent.proc.stop()


def test_the_owners_pause_drains_the_slurm_node_and_the_resume_lifts_it(
    tmp_path, cluster, coordinator, gpus, nvml_lib
):
    """The owner pauses: the node is DRAINed, its training job requeued (D = pause + 20 s
    here). The resume lifts spotdrain's DRAIN: the node takes jobs again."""
    job = submit_training(cluster, tmp_path)
    node = running_on(cluster, job)
    agent = slurm_agent(tmp_path, cluster, node, coordinator, gpus, nvml_lib)
    admin = coordinator.admin()
    try:
        assert spotctl(agent, "pause")["ok"] is True
        admin.wait_for("drained", node=node, timeout=30)
        assert "Reason=spotdrain:" in node_line(cluster, node)
        assert spotctl(agent, "resume")["ok"] is True
        admin.wait_for("manager_uncordoned", node=node, timeout=30)
        line = node_line(cluster, node)
        assert "DRAIN" not in line and "Reason=spotdrain" not in line
        again = cluster.submit("sleep 1\n", node, name="after-resume")
        cluster.wait_state(again, {"RUNNING", "COMPLETED"})
    finally:
        agent.proc.stop()


@pytest.mark.docker
def test_one_reclamation_drains_a_container_and_a_slurm_job_on_one_host(
    tmp_path, cluster, coordinator, gpus, nvml_lib, docker_engine, containers
):
    """A host runs a batch container beside a Slurm job: one notice drains both, each its own
    way (the container by the engine's SIGTERM, the job by its requeue), verified together."""
    job = submit_training(cluster, tmp_path)
    node = running_on(cluster, job)
    container = run_workload(
        docker_engine.client, name=containers + "batch", node_id=node, kind="exits_on_term"
    )
    agent = slurm_agent(
        tmp_path, cluster, node, coordinator, gpus, nvml_lib, docker_host=docker_engine.host
    )
    admin = coordinator.admin()
    try:
        agent.write_notice(
            {"id": "i-both-1", "action": "terminate", "terminate_at": time.time() + 20}
        )
        drained = admin.wait_for("drained", node=node, timeout=30)
        story = admin.events(node=node, reclaim_id=drained["reclaim_id"])
        vias = {e["container"]: e["via"] for e in story if e["kind"] == "sigterm_sent"}
        assert vias == {container.id: "api", f"slurm:{job}": "requeue"}
        container.reload()
        assert container.status == "exited"
    finally:
        agent.proc.stop()


def test_a_host_back_after_d_has_its_old_drain_lifted_and_not_before(
    tmp_path, cluster, coordinator, gpus, nvml_lib
):
    """The node drained for a notice and its agent stopped with spotdrain's DRAIN still set.
    Restarted before D (the host is about to go) the DRAIN stays; restarted after D (a new
    boot on a host that came back) the old DRAIN is lifted, so Slurm may place work again."""
    node = "sd-n3"
    agent = slurm_agent(tmp_path, cluster, node, coordinator, gpus, nvml_lib)
    admin = coordinator.admin()
    terminate_at = time.time() + 8
    agent.write_notice({"id": "i-back-1", "action": "terminate", "terminate_at": terminate_at})
    admin.wait_for("drained", node=node, timeout=20)
    agent.proc.stop()
    agent.restart()  # before D: READY comes after the start-up look at the old drain
    wait_until(lambda: agent.proc.log().count("agent up") == 2, 20, "the agent up again")
    assert "Reason=spotdrain: " in node_line(cluster, node)
    agent.proc.stop()
    wait_until(lambda: time.time() > terminate_at, 20, "D to pass")
    agent.restart()
    wait_until(lambda: "DRAIN" not in node_line(cluster, node), 20, "the old DRAIN lifted")
    agent.proc.stop()


def test_without_slurmctld_an_srun_steps_task_gets_its_sigterm_and_time_to_save(
    tmp_path, cluster, coordinator, gpus, nvml_lib
):
    """A batch script whose work runs in an srun step, slurmctld down at the notice: the agent
    signals the step's processes itself, and the step's task gets its TERM and the second it
    needs to save its work, as the batch shell does. (The agent leaves srun itself out: with
    slurmctld up, srun asked to stop turns TERM into a KILL of the step. With it down, as here,
    srun cannot, so this test does not tell the two apart.)"""
    # The task takes a second to save its work after the TERM: a KILL meanwhile loses it.
    step = "trap 'echo step got TERM; sleep 1; echo step saved; exit 0' TERM; echo step up; " + (
        "sleep 300 & wait"
    )
    job = cluster.submit(
        f"trap 'echo shell got TERM' TERM\nsrun bash -c \"{step}\" &\nwait\nwait\n", node="sd-n1"
    )
    wait_until(lambda: "step up" in cluster.output(job), 15, "the step's task")
    agent = slurm_agent(tmp_path, cluster, "sd-n1", coordinator, gpus, nvml_lib)
    admin = coordinator.admin()
    cluster.stop_controller()
    try:
        agent.write_notice(
            {"id": "i-srun-1", "action": "terminate", "terminate_at": time.time() + 20}
        )
        sigterm = admin.wait_for("sigterm_sent", node="sd-n1", timeout=20)
        assert sigterm["via"] == "pid"
        wait_until(lambda: "step saved" in cluster.output(job), 10, "the step's saved work")
        wait_until(lambda: "shell got TERM" in cluster.output(job), 10, "the shell's trap")
    finally:
        cluster.start_controller()
        agent.proc.stop()


def test_an_agent_killed_before_its_drain_landed_sets_it_once_slurmctld_is_back(
    tmp_path, cluster, coordinator, gpus, nvml_lib
):
    """slurmctld is down at the notice and the agent, still retrying its DRAIN, is SIGKILLed.
    The restarted agent asks for the DRAIN again (it lived only in the old process's memory):
    once slurmctld is back the node is DRAINed and verified drained, never an overrun."""
    job = cluster.submit(CHECKPOINTING.replace("$CKPT_DIR", str(tmp_path)), None, name="train")
    node = running_on(cluster, job)
    agent = slurm_agent(tmp_path, cluster, node, coordinator, gpus, nvml_lib)
    admin = coordinator.admin()
    cluster.stop_controller()
    try:
        notice = {"id": "i-restart-1", "action": "terminate", "terminate_at": time.time() + 25}
        agent.write_notice(notice)
        admin.wait_for("sigterm_sent", node=node, timeout=20)
        agent.proc.kill()
        agent.restart()
        wait_until(lambda: agent.proc.log().count("agent up") == 2, 20, "the agent up again")
    finally:
        cluster.start_controller()
    try:
        drained = admin.wait_for("drained", node=node, timeout=30)
        assert "Reason=spotdrain: " + drained["reclaim_id"] in node_line(cluster, node)
        assert "overrun" not in admin.kinds(node=node)
    finally:
        agent.proc.stop()
