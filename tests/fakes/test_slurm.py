"""The Slurm cluster fixture is a real cluster: three slurmd on one host, each running the jobs
sent to it, and the node-local answers (`scontrol listpids`) that the agent relies on while the
controller is away."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fakes.slurm import SlurmCluster
from fakes.waiting import wait_until

# Writes its shell's pid where the test can read it, then waits to be signalled.
SLEEPER = 'echo $$ > "pid.$SLURM_JOB_ID"\necho "on $SLURMD_NODENAME"\nsleep 300\n'


@pytest.fixture(autouse=True)
def cluster(slurm_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    yield slurm_cluster
    slurm_cluster.reset()


def _pid_of(cluster: SlurmCluster, job_id: int) -> int:
    path = Path(cluster.root, "jobs", f"pid.{job_id}")
    return int(wait_until(lambda: path.exists() and path.read_text().strip(), what="job's pid"))


def _listpids(cluster: SlurmCluster, job_id: int | str, node: str) -> set[int]:
    out = cluster.cli("scontrol", "listpids", str(job_id), node, check=False)
    return {int(line.split()[0]) for line in out.splitlines()[1:] if line.split()}


def test_three_nodes_come_up_idle_with_two_gpus_each(cluster: SlurmCluster) -> None:
    """The session starts with three idle nodes, each with its fake GPUs as gres."""
    out = cluster.cli("sinfo", "-h", "-N", "-o", "%N %T %G")
    assert sorted(out.split("\n")[:-1]) == [f"{node} idle gpu:2" for node in cluster.nodes]


def test_a_job_runs_on_the_node_asked_and_its_output_appears(cluster: SlurmCluster) -> None:
    """A job sent to sd-n2 runs there (not on the host's first slurmd) and writes its output."""
    job = cluster.submit('echo "ran on $SLURMD_NODENAME"\n', node="sd-n2")
    assert cluster.wait_state(job, {"COMPLETED", "FAILED"}) == "COMPLETED"
    assert cluster.job_field(job, "NodeList") == "sd-n2"
    assert cluster.output(job) == "ran on sd-n2\n"


def test_listpids_names_the_node_among_the_hosts_slurmd(cluster: SlurmCluster) -> None:
    """`scontrol listpids JOB NODE` lists the job's processes on the node that runs it; asked of
    another slurmd of the same host it finds nothing, and without a node name it asks the host's
    own name, which no slurmd here is."""
    job = cluster.submit(SLEEPER, node="sd-n3")
    cluster.wait_state(job, {"RUNNING"})
    shell = _pid_of(cluster, job)

    assert shell in _listpids(cluster, job, "sd-n3")
    assert shell in _listpids(cluster, "*", "sd-n3")
    assert _listpids(cluster, job, "sd-n1") == set()
    assert cluster.cli("scontrol", "listpids", str(job), check=False).splitlines()[1:] == []


def test_a_stopped_controller_leaves_listpids_answering_and_keeps_its_jobs(
    cluster: SlurmCluster,
) -> None:
    """slurmctld stops: `scontrol ping` says it is down, the node still lists its job's processes;
    slurmctld starts again from its saved state and the job is still running where it was."""
    job = cluster.submit(SLEEPER, node="sd-n1")
    cluster.wait_state(job, {"RUNNING"})
    shell = _pid_of(cluster, job)

    cluster.stop_controller()
    assert "is DOWN" in cluster.cli("scontrol", "ping", check=False)
    assert shell in _listpids(cluster, job, "sd-n1")

    cluster.start_controller()
    assert cluster.job_field(job, "JobState") == "RUNNING"
    assert cluster.job_field(job, "NodeList") == "sd-n1"
    assert shell in _listpids(cluster, job, "sd-n1")
