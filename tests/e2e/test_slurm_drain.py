"""Slurm job steps drained on a real cluster (Debian's slurmctld and slurmd, tests/fakes/slurm.py):
a coordinator and an agent as processes, the agent draining its Slurm node with Slurm's own
controls (agent/workloads/slurm.py, docs/workloads.md "Slurm")."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from test_pause import spotctl

from fakes.harness import BIN, AgentOptions, start_agent
from fakes.slurm import SlurmCluster
from fakes.waiting import wait_until

# A training job that checkpoints its counter on SIGTERM and resumes from it when run again.
CHECKPOINTING = """#!/bin/bash
ckpt="$CKPT_DIR/ckpt-$SLURM_JOB_ID"
i=0
if [ -f "$ckpt" ]; then i=$(cat "$ckpt"); echo "resumed from $i on $SLURMD_NODENAME"; fi
trap 'echo "$i" > "$ckpt"; echo "checkpointed $i on $SLURMD_NODENAME"; exit 0' TERM
echo "running on $SLURMD_NODENAME"
while true; do i=$((i + 1)); sleep 0.1; done
"""
# A job that ignores SIGTERM: only a SIGKILL ends it.
STUBBORN = """#!/bin/bash
trap '' TERM
echo "running on $SLURMD_NODENAME"
while true; do sleep 0.1; done
"""


@pytest.fixture
def cluster(slurm_cluster: SlurmCluster) -> SlurmCluster:
    yield slurm_cluster
    slurm_cluster.reset()


def slurm_agent(
    tmp_path: Path,
    cluster: SlurmCluster,
    node: str,
    coordinator,
    gpus,
    nvml_lib,
    docker_host: str = "",
    **options: float,
):
    """An agent on one Slurm node; Docker drained beside it only when docker_host is given."""
    config = tmp_path / f"{node}.toml"
    config.write_text(
        "pause_notice_s = 20\n"
        f"[workloads]\ndocker = {'true' if docker_host else 'false'}\n[workloads.slurm]\n"
        f'node_name = "{node}"\nbin_dir = "{cluster.bin_dir}"\nconf = "{cluster.conf}"\n'
        "call_timeout_s = 3\n"
    )
    opts = {"grace_s": 6.0, "overrun_s": 1.0, **options}
    return start_agent(
        tmp_path,
        node,
        coordinator,
        docker_host or "unix:///nonexistent/docker.sock",
        gpus,
        nvml_lib,
        AgentOptions(**opts, extra=["--config", str(config)]),  # type: ignore[arg-type]
    )


def running_on(cluster: SlurmCluster, job: int) -> str:
    try:
        cluster.wait_state(job, {"RUNNING"})
    except TimeoutError as e:
        raise AssertionError(cluster.cli("scontrol", "show", "job", str(job))) from e
    return wait_until(lambda: cluster.job_field(job, "NodeList"), 10, f"job {job}'s node")


def test_a_requeueable_job_checkpoints_and_runs_on_from_it_on_another_node(
    tmp_path, cluster, coordinator, gpus, nvml_lib
):
    """AWS gives the node 20 s. Its training job (requeueable) is requeued only after the node
    is DRAINed: it gets its SIGTERM, checkpoints, leaves the node, and runs on another node from
    its checkpoint; the node is verified `drained` with seconds to spare and stays drained (the
    reason is ours, lifted only by a resume)."""
    (tmp_path / "ckpt").mkdir()
    job = cluster.submit(
        CHECKPOINTING,
        None,
        requeue=True,
        name="train",
        args=[f"--export=ALL,CKPT_DIR={tmp_path}/ckpt"],
    )
    node = running_on(cluster, job)
    wait_until(lambda: "running on" in cluster.output(job), 10, "the job's first line")
    agent = slurm_agent(tmp_path, cluster, node, coordinator, gpus, nvml_lib)
    admin = coordinator.admin()
    try:
        agent.write_notice(
            {"id": "i-slurm-1", "action": "terminate", "terminate_at": time.time() + 20}
        )
        drained = admin.wait_for("drained", node=node, timeout=30)
        left = admin.wait_for("container_exited", node=node, timeout=30)
        story = admin.events(node=node, reclaim_id=drained["reclaim_id"])
        kinds = [e["kind"] for e in story]
        # The DRAIN landed before any signal (new jobs could no longer start here).
        assert kinds.index("manager_cordoned") < kinds.index("sigterm_sent")
        sigterm = next(e for e in story if e["kind"] == "sigterm_sent")
        assert (sigterm["container"], sigterm["via"]) == (f"slurm:{job}", "requeue")
        assert "verified_empty" in kinds
        assert left["state"] in {"PENDING", "REQUEUED", "RUNNING"}  # back in the queue
        assert drained["spare_s"] > 5

        info = cluster.cli("scontrol", "-o", "show", "node", node)
        assert "DRAIN" in info and f"Reason=spotdrain: {drained['reclaim_id']}" in info
        # The job checkpointed here and went on elsewhere from that checkpoint.
        elsewhere = running_on(cluster, job)
        assert elsewhere != node
        wait_until(lambda: "resumed from" in cluster.output(job), 30, "the job to resume")
        out = cluster.output(job)
        saved = out.split("checkpointed ")[1].split(" on ")[0]
        assert f"checkpointed {saved} on {node}" in out
        assert f"resumed from {saved} on {elsewhere}" in out
    finally:
        agent.proc.stop()


def test_a_job_ignoring_sigterm_is_killed_at_g_and_the_node_drains(
    tmp_path, cluster, coordinator, gpus, nvml_lib
):
    """A job that may not be requeued is cancelled (its SIGTERM); it ignores it. G comes 2 s
    after the notice, before slurmd's own SIGKILL (KillWait, 5 s here): the agent SIGKILLs the
    job's processes itself at G, and the node is verified drained before O."""
    job = cluster.submit(STUBBORN, "sd-n2", requeue=False, name="stubborn")
    node = running_on(cluster, job)
    agent = slurm_agent(tmp_path, cluster, node, coordinator, gpus, nvml_lib)
    admin = coordinator.admin()
    try:
        noticed = time.time()
        agent.write_notice({"id": "i-slurm-2", "action": "terminate", "terminate_at": noticed + 8})
        drained = admin.wait_for("drained", node=node, timeout=30)
        admin.wait_for("container_exited", node=node, timeout=30)
        story = admin.events(node=node, reclaim_id=drained["reclaim_id"])
        by_kind = {e["kind"]: e for e in story}
        assert by_kind["sigterm_sent"]["via"] == "scancel"
        assert by_kind["sigkill_sent"]["via"] == "pid"
        assert by_kind["sigkill_sent"]["wall_time"] >= noticed + 2  # at G (D - 6 s), not before
        assert "overrun" not in by_kind
        assert by_kind["container_exited"]["state"] in {"CANCELLED", "COMPLETED", "FAILED"}
    finally:
        agent.proc.stop()


def test_an_administrators_drain_survives_a_pause_and_resume(
    tmp_path, cluster, coordinator, gpus, nvml_lib
):
    """The owner pauses and resumes a node an administrator had drained for maintenance:
    spotdrain's DRAIN never replaces the administrator's reason, and the resume leaves the
    node drained."""
    node = "sd-n3"
    cluster.cli("scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=disk swap")
    agent = slurm_agent(tmp_path, cluster, node, coordinator, gpus, nvml_lib)
    admin = coordinator.admin()
    try:
        spotctl(agent, "pause")
        admin.wait_for("drained", node=node, timeout=30)
        spotctl(agent, "resume")
        admin.wait_for("pause_resumed", node=node, timeout=30)
        info = cluster.cli("scontrol", "-o", "show", "node", node)
        assert "DRAIN" in info and "Reason=disk swap" in info
    finally:
        agent.proc.stop()


def test_the_node_registers_its_slurm_name_and_cluster(
    tmp_path, cluster, coordinator, gpus, nvml_lib
):
    """An agent on sd-n3 (Docker off) registers: the coordinator lists Slurm as the node's one
    work manager, with its NodeName and the ClusterName slurmctld told the agent at start, and
    `spotctl nodes` shows them (as text and in --json)."""
    agent = slurm_agent(tmp_path, cluster, "sd-n3", coordinator, gpus, nvml_lib)
    admin = coordinator.admin()
    try:
        node = wait_until(
            lambda: next((n for n in admin.nodes() if n.node_id == "sd-n3" and n.managers), None),
            30,
            "sd-n3's registration",
        )
        assert [(m.name, m.node_name, m.cluster) for m in node.managers] == [
            ("slurm", "sd-n3", "spotdrain")
        ]
        run = subprocess.run(
            [str(BIN / "spotctl"), *coordinator.cli_args(), "nodes"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        header, row = run.stdout.splitlines()
        assert header.split()[-3:] == ["managers", "cloud", "taints"]
        assert row.split()[0] == "sd-n3" and "slurm:spotdrain/sd-n3" in row.split()
        run = subprocess.run(
            [str(BIN / "spotctl"), *coordinator.cli_args(), "nodes", "--json"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        (doc,) = [json.loads(line) for line in run.stdout.splitlines()]
        assert doc["managers"] == [{"name": "slurm", "node_name": "sd-n3", "cluster": "spotdrain"}]
    finally:
        agent.proc.stop()


def test_a_node_name_slurmctld_does_not_know_stops_the_agent_with_one_line(
    tmp_path, cluster, coordinator, gpus, nvml_lib
):
    """A typo in workloads.slurm.node_name would leave the node undrainable: the agent refuses
    to start, one line and exit 2, as for every other bad setting."""
    with pytest.raises(RuntimeError, match="exited 2") as refused:
        slurm_agent(tmp_path, cluster, "sd-n9", coordinator, gpus, nvml_lib)
    assert "node_name 'sd-n9': slurmctld knows no such node" in str(refused.value)
