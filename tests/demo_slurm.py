"""The demo's Slurm act (tests/demo.sh --slurm): a private Slurm cluster (tests/fakes/slurm.py:
munged, slurmctld, three slurmd), a training job that checkpoints on SIGTERM, and an agent on
the job's node. The provider's notice DRAINs the node, requeues the job, and the job runs on
from its checkpoint on another node; the reclamation's timeline is printed."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from fakes.fakenvml import FakeGpus
from fakes.harness import BIN, AgentOptions, Coordinator, start_agent
from fakes.slurm import start_cluster
from fakes.waiting import wait_until

# Counts, checkpoints its count on SIGTERM, and resumes from the checkpoint when run again.
TRAINING = """#!/bin/bash
ckpt="$CKPT_DIR/ckpt-$SLURM_JOB_ID"
i=0
if [ -f "$ckpt" ]; then i=$(cat "$ckpt"); echo "resumed from step $i on $SLURMD_NODENAME"; fi
trap 'echo "$i" > "$ckpt"; echo "checkpointed step $i on $SLURMD_NODENAME"; exit 0' TERM
echo "training on $SLURMD_NODENAME"
while true; do i=$((i + 1)); sleep 0.1; done
"""


def slurm_act(
    work: Path,
    coordinator: Coordinator,
    leader: Coordinator,
    nvml_lib: Path,
    deadline_s: float,
    grace_s: float,
    say: Callable[[str], None],
) -> bool:
    """Run the act; True when the node drained and the job resumed elsewhere from its
    checkpoint. The agent is given `coordinator` (every replica); the demo reads from
    `leader`."""
    cluster = start_cluster()
    agent = None
    try:
        say(
            f"Slurm cluster up: slurmctld and slurmd {', '.join(cluster.nodes)} (KillWait "
            f"{cluster.kill_wait_s} s)"
        )
        (work / "ckpt").mkdir(parents=True, exist_ok=True)
        job = cluster.submit(
            TRAINING, None, requeue=True, name="train", args=[f"--export=ALL,CKPT_DIR={work}/ckpt"]
        )
        cluster.wait_state(job, {"RUNNING"})
        node = wait_until(lambda: cluster.job_field(job, "NodeList"), 10, "the job's node")
        wait_until(lambda: "training on" in cluster.output(job), 10, "the job's first line")
        config = work / f"{node}.toml"
        config.write_text(
            "[workloads]\ndocker = false\n[workloads.slurm]\n"
            f'node_name = "{node}"\nbin_dir = "{cluster.bin_dir}"\nconf = "{cluster.conf}"\n'
        )
        gpus = FakeGpus(work / f"{node}.gpus")
        gpus.set(gpus=2)
        agent = start_agent(
            work,
            node,
            coordinator,
            "unix:///nonexistent/docker.sock",
            gpus,
            nvml_lib,
            AgentOptions(grace_s=grace_s, extra=["--config", str(config)]),
        )
        say(f"job {job} (requeueable) trains on {node}; its agent is up")
        say(f"ACT 3: the provider gives {node} a hard notice")
        agent.write_notice(
            {
                "id": f"i-slurm-{job}",
                "action": "terminate",
                "terminate_at": time.time() + deadline_s,
            }
        )
        admin = leader.admin()
        drained = wait_until(
            lambda: next(
                (e for e in admin.events(node) if e["kind"] in ("drained", "overrun")), None
            ),
            deadline_s + 15,
            f"{node}'s outcome",
            0.2,
        )
        elsewhere = wait_until(
            lambda: "resumed from" in cluster.output(job) and cluster.job_field(job, "NodeList"),
            60,
            "the job to resume elsewhere",
            0.5,
        )
        print()
        spotctl = [str(BIN / "spotctl"), *leader.cli_args()]
        print(_text([*spotctl, "timeline", drained["reclaim_id"]]))
        for line in cluster.output(job).splitlines():
            say(f"job {job}: {line}")
        state = cluster.cli("sinfo", "-h", "-n", node, "-o", "%T %E").strip()
        say(f"{node} is now: {state}; the job runs on {elsewhere}")
        return drained["kind"] == "drained" and elsewhere != node
    finally:
        if agent is not None:
            agent.proc.stop()
        cluster.stop()


def _text(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout
