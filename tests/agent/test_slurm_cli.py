"""The agent's Slurm calls (agent/workloads/slurm_cli.py) against a real cluster: what each
answers, what a cancel and a requeue do to a job, and that a controller which stops answering is
an error within the bound, while the node's own answers (listpids) still come."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fakes.slurm import SlurmCluster
from fakes.waiting import eventually
from spotdrain.agent.workloads.settings import SlurmSettings
from spotdrain.agent.workloads.slurm import SlurmWork
from spotdrain.agent.workloads.slurm_cli import JobInfo, SlurmCli, SlurmError

# Records its shell's pid and what it is sent; exits on SIGTERM like a job that checkpoints.
TRAPPER = """\
echo $$ > "pid.$SLURM_JOB_ID"
echo "start on $SLURMD_NODENAME restart=${SLURM_RESTART_COUNT:-0}"
trap 'echo "got TERM on $SLURMD_NODENAME"; exit 0' TERM
sleep 300 &
wait
"""
# Ignores SIGTERM: only slurmd's SIGKILL, KillWait later, ends it.
STUBBORN = 'trap "" TERM\necho $$ > "pid.$SLURM_JOB_ID"\nwhile true; do sleep 1; done\n'


@pytest.fixture
def cluster(slurm_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    yield slurm_cluster
    slurm_cluster.reset()


@pytest.fixture
def cli(cluster: SlurmCluster) -> SlurmCli:
    return SlurmCli(cluster.bin_dir, cluster.conf, timeout_s=5)


def _pid_file(cluster: SlurmCluster, job_id: int) -> Path:
    return Path(cluster.root, "jobs", f"pid.{job_id}")


async def _running(cluster: SlurmCluster, job_id: int, timeout: float = 10) -> int:
    """Wait until the job's shell has started; its pid."""
    path = _pid_file(cluster, job_id)
    text = await eventually(
        lambda: path.exists() and path.read_text().strip(), "the job's pid", timeout=timeout
    )
    return int(text)


async def test_a_drain_and_its_resume_show_in_the_node(cluster: SlurmCluster, cli) -> None:
    """An idle node drained with spotdrain's reason is `drained` at once, with that reason (not
    scontrol's [user@time] stamp); resumed, it is neither drained nor draining, with no reason,
    and idle once the controller has heard from its slurmd again."""
    await cli.drain("sd-n3", "spotdrain: r-17 until 2026-12-03T16:00:00Z")
    node = await cli.node("sd-n3")
    assert (node.name, node.state, node.flags) == ("sd-n3", "IDLE", frozenset({"DRAIN"}))
    assert node.reason == "spotdrain: r-17 until 2026-12-03T16:00:00Z"
    assert node.drained and not node.draining
    assert cluster.node_state("sd-n3") == "drained"

    await cli.resume("sd-n3")
    node = await cli.node("sd-n3")
    assert (node.state, node.reason) == ("IDLE", "")
    assert not node.drained and not node.draining
    # Slurm marks a resumed node NOT_RESPONDING until its next ping of that slurmd.
    assert node.flags <= {"NOT_RESPONDING"}
    node = await eventually(lambda: cli.node("sd-n3"), "the ping", ok=lambda n: not n.flags)
    assert node.state == "IDLE"


async def test_a_node_is_draining_until_its_last_job_has_completed(cluster: SlurmCluster, cli):
    """A job that ignores SIGTERM keeps its drained node `draining`: while it runs, and after the
    cancel while it is COMPLETING (no CPU allocated any more, yet not drained), until KillWait's
    SIGKILL. Our reading agrees with sinfo's at each step."""
    job = cluster.submit(STUBBORN, node="sd-n2")
    await _running(cluster, job)
    await cli.drain("sd-n2", "spotdrain: r-18")
    node = await cli.node("sd-n2")
    assert (node.state, node.draining, cluster.node_state("sd-n2")) == (
        "MIXED",
        True,
        "draining",
    )

    cancelled_at = time.monotonic()
    await cli.cancel(job)
    node = await eventually(lambda: cli.node("sd-n2"), "completing", ok=lambda n: n.cpu_alloc == 0)
    assert "COMPLETING" in node.flags and node.draining and not node.drained
    assert cluster.node_state("sd-n2") == "draining"

    node = await eventually(
        lambda: cli.node("sd-n2"), "drained", ok=lambda n: n.drained, timeout=20
    )
    assert time.monotonic() - cancelled_at >= cluster.kill_wait_s - 1
    assert cluster.node_state("sd-n2") == "drained"
    assert await cli.listpids("sd-n2") == {}
    ended = await cli.job(job)
    assert (ended.state, ended.exit_code, ended.exit_signal) == ("CANCELLED", 0, 9)


async def test_the_jobs_on_a_node_and_what_each_allows(cluster: SlurmCluster, cli) -> None:
    """squeue lists each job on the node with the flags the drain chooses by: a requeueable batch
    job, a batch job that may not be requeued, and an interactive srun (never a batch job); a job
    on another node is not listed. scontrol tells the same, and None for a job it never had."""
    requeueable = cluster.submit(TRAPPER, node="sd-n1", requeue=True, name="train | step 1")
    plain = cluster.submit(TRAPPER, node="sd-n1", name="eval")
    elsewhere = cluster.submit(TRAPPER, node="sd-n2")
    srun = subprocess.Popen(
        [str(cluster.bin_dir / "srun"), "-w", "sd-n1", "-J", "shell", "sleep", "300"],
        env=cluster.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for job in (requeueable, plain, elsewhere):
            await _running(cluster, job)
        jobs = await eventually(lambda: cli.jobs_on("sd-n1"), "3 jobs", ok=lambda js: len(js) == 3)
        by_name = {j.name: j for j in jobs}
        assert sorted(by_name) == ["eval", "shell", "train | step 1"]
        assert (by_name["train | step 1"].job_id, by_name["eval"].job_id) == (requeueable, plain)
        assert {n: (j.state, j.requeue, j.batch) for n, j in by_name.items()} == {
            "train | step 1": ("RUNNING", True, True),
            "eval": ("RUNNING", False, True),
            # JobRequeue=1 makes every job requeueable, an interactive one included.
            "shell": ("RUNNING", True, False),
        }

        shown = await cli.job(requeueable)
        assert shown == JobInfo(
            requeueable, "train | step 1", "RUNNING", True, True, exit_code=0, exit_signal=0
        )
        assert await cli.job(999_999) is None
    finally:
        srun.kill()
        srun.wait()


async def test_a_job_that_may_not_be_requeued_is_cancelled_with_sigterm(cluster, cli) -> None:
    """The cancel reaches the batch shell as SIGTERM (it exits 0 from its trap); the job ends
    CANCELLED and the node's slurmstepd no longer lists it."""
    job = cluster.submit(TRAPPER, node="sd-n3")
    await _running(cluster, job)
    assert (await cli.job(job)).requeue is False

    await cli.cancel(job)
    await eventually(lambda: "got TERM on sd-n3" in cluster.output(job), "the job's trap")
    assert (await eventually(lambda: cli.job(job), ok=lambda j: j.state == "CANCELLED")).batch
    assert await eventually(lambda: cli.listpids("sd-n3", job), ok=lambda p: p == {}) == {}
    # Cancelling it again: it is already leaving, which is what was asked.
    await cli.cancel(job)


async def test_a_cancel_reaches_an_srun_steps_tasks_as_sigterm(cluster: SlurmCluster, cli):
    """A batch script whose work runs in an srun step: the cancel reaches the step's task as
    SIGTERM it can act on (not srun's own TERM-to-KILL), as it reaches the batch shell."""
    step = "trap 'echo step got TERM; exit 0' TERM; echo step up; sleep 300 & wait"
    job = cluster.submit(
        f"trap 'echo shell got TERM' TERM\nsrun bash -c \"{step}\" &\nwait\nwait\n", node="sd-n1"
    )
    await eventually(lambda: "step up" in cluster.output(job), "the step's task")
    assert len(await cli.listpids("sd-n1", job)) == 1

    await cli.cancel(job)
    await eventually(lambda: "step got TERM" in cluster.output(job), "the step's trap")
    await eventually(lambda: "shell got TERM" in cluster.output(job), "the shell's trap")


async def test_a_requeued_batch_job_runs_again_on_another_node(cluster: SlurmCluster, cli) -> None:
    """A requeueable job on sd-n1 (placed there by Slurm, so free to move): sd-n1 drained and the
    job requeued, it gets SIGTERM, and runs again on another node as its first restart."""
    for other in ("sd-n2", "sd-n3"):  # leave Slurm one place for the job
        await cli.drain(other, "test: placement")
    job = cluster.submit(TRAPPER, node=None, requeue=True)
    await _running(cluster, job)
    assert (await cli.job(job)).state == "RUNNING"
    assert cluster.job_field(job, "NodeList") == "sd-n1"
    for other in ("sd-n2", "sd-n3"):
        await cli.resume(other)

    await cli.drain("sd-n1", "spotdrain: r-19")
    _pid_file(cluster, job).unlink()
    await cli.requeue(job)
    again = await _running(cluster, job, timeout=40)  # cred_expire (10 s here) delays it

    assert cluster.job_field(job, "NodeList") in ("sd-n2", "sd-n3")
    assert cluster.job_field(job, "Restarts") == "1"
    # What the job wrote itself, without slurmstepd's "CANCELLED ... DUE TO JOB REQUEUE".
    lines = [line for line in cluster.output(job).splitlines() if "slurmstepd" not in line]
    assert lines[:2] == ["start on sd-n1 restart=0", "got TERM on sd-n1"]
    assert lines[2].startswith("start on sd-n") and lines[2].endswith("restart=1")
    assert again in (await cli.listpids(cluster.job_field(job, "NodeList"), job))[job]
    assert (await cli.node("sd-n1")).drained


async def test_the_configuration_tells_killwait(cluster: SlurmCluster, cli) -> None:
    config = await cli.config()
    assert config["ClusterName"] == "spotdrain"
    assert config["KillWait"] == f"{cluster.kill_wait_s} sec"
    assert await cli.kill_wait_s() == cluster.kill_wait_s
    assert await cli.ping() is True


async def test_refusals_are_errors(cluster: SlurmCluster, cli) -> None:
    """A node or job Slurm does not know is a SlurmError, scancel's exit 0 included; a listpids
    for a node with no slurmd here, or with no scontrol to run, is an error, never empty."""
    with pytest.raises(SlurmError, match="Node nosuch not found"):
        await cli.node("nosuch")
    with pytest.raises(SlurmError, match="Invalid node name"):
        await cli.drain("nosuch", "spotdrain: r-20")
    with pytest.raises(SlurmError, match="Invalid job id"):
        await cli.cancel(999_999)
    with pytest.raises(SlurmError, match="Invalid job id"):
        await cli.requeue(999_999)
    with pytest.raises(SlurmError, match="Domain socket directory"):
        await cli.listpids("nosuch")
    with pytest.raises(SlurmError, match="cannot run"):
        await SlurmCli("/nonexistent", cluster.conf, 5).ping()
    with pytest.raises(SlurmError, match="cannot run"):
        await SlurmCli("/nonexistent", cluster.conf, 5).listpids("sd-n1")


def _children(name: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        comm, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat.rsplit(")", 1)[1].split()
        if comm == name and int(fields[1]) == os.getpid():
            found.append(int(entry.name))
    return found


async def test_a_frozen_controller_is_an_error_within_the_bound(cluster: SlurmCluster) -> None:
    """slurmctld SIGSTOPped (it accepts connections but never answers): each call is a SlurmError
    after its timeout, the scontrol it started is killed, and ping says no; the node still lists
    its job's processes."""
    job = cluster.submit(TRAPPER, node="sd-n2")
    shell = await _running(cluster, job)
    cli = SlurmCli(cluster.bin_dir, cluster.conf, timeout_s=1)
    cluster.freeze_controller()

    for call in (cli.node("sd-n2"), cli.jobs_on("sd-n2"), cli.drain("sd-n2", "spotdrain: r-21")):
        started = time.monotonic()
        with pytest.raises(SlurmError, match="no answer within 1 s"):
            await call
        assert 1 <= time.monotonic() - started < 3  # the bound, plus killing and reaping scontrol
        assert _children("scontrol") == _children("squeue") == []
    assert await cli.ping() is False
    assert shell in (await cli.listpids("sd-n2"))[job]


async def test_listpids_answers_while_the_controller_is_stopped(cluster: SlurmCluster, cli):
    """slurmctld stopped: the controller's calls fail at once, listpids still answers from the
    node's slurmstepd, for one job or for all, and is empty for a node running nothing."""
    job = cluster.submit(TRAPPER, node="sd-n2")
    shell = await _running(cluster, job)
    cluster.stop_controller()

    assert await cli.ping() is False
    with pytest.raises(SlurmError):
        await cli.node("sd-n2")
    pids = await cli.listpids("sd-n2")
    assert list(pids) == [job] and shell in pids[job]
    assert await cli.listpids("sd-n2", job) == pids
    assert await cli.listpids("sd-n1") == {}


async def test_the_nodes_cluster_is_read_at_start_and_left_empty_without_the_controller(
    cluster: SlurmCluster,
) -> None:
    """The agent's start (SlurmWork.check_node) reads the cluster's name for its registration;
    started while slurmctld is stopped it goes on with none, after the one failed call."""
    settings = SlurmSettings("sd-n1", cluster.bin_dir, cluster.conf, call_timeout_s=5)
    up = SlurmWork(settings, lambda rid, ev: None)
    await up.check_node()
    assert (up.node, up.cluster) == ("sd-n1", "spotdrain")

    cluster.stop_controller()
    away = SlurmWork(settings, lambda rid, ev: None)
    await away.check_node()
    assert (away.node, away.cluster) == ("sd-n1", "")
