"""A reclaimed node running the reference checkpointing job (examples/checkpoint_job), on real
parts: coordinator and agent processes, the real Docker engine, the job in its own image with
only spotdrain.workload's one file copied in. Its final checkpoint appears in the timeline."""

from __future__ import annotations

import json
import subprocess
import time
import zlib

import docker.types
import pytest

from fakes.harness import BIN, AgentOptions, start_agent
from fakes.waiting import wait_until
from images.checkpoint_job import ensure_checkpoint_job_image
from spotdrain.agent.workloads.jobs import CONTAINER_DEADLINE_DIR
from spotdrain.agent.workloads.status_dirs import CONTAINER_STATUS_DIR
from spotdrain.workload import DEADLINE_FILE_ENV, KIND_LABEL, NODE_LABEL, STATUS_DIR_ENV

pytestmark = pytest.mark.docker

STATE_MB = 48


def run_job(client, name, node, bucket, deadline_dir=None, status=None):
    mounts = [docker.types.Mount("/bucket", str(bucket), type="bind")]
    env = {
        "CHECKPOINT_BUCKET": "/bucket",
        "CHECKPOINT_STATE_MB": str(STATE_MB),
        "CHECKPOINT_OBJECT_MB": "8",
    }
    if deadline_dir is not None:
        mounts.append(
            docker.types.Mount(
                CONTAINER_DEADLINE_DIR, str(deadline_dir), type="bind", read_only=True
            )
        )
        env[DEADLINE_FILE_ENV] = f"{CONTAINER_DEADLINE_DIR}/deadline.json"
    if status is not None:
        mounts.append(docker.types.Mount(CONTAINER_STATUS_DIR, str(status), type="bind"))
        env[STATUS_DIR_ENV] = CONTAINER_STATUS_DIR
    c = client.containers.run(
        ensure_checkpoint_job_image(client),
        name=name,
        labels={NODE_LABEL: node, KIND_LABEL: "batch"},
        environment=env,
        mounts=mounts,
        network_mode="none",
        detach=True,
    )
    wait_until(
        lambda: b"job: ready" in c.logs() or c.reload() or c.status == "exited",
        60,
        f"{name} to be ready",
    )
    assert b"job: ready" in c.logs(), c.logs()
    return c


def test_the_final_checkpoint_in_the_timeline(
    tmp_path, docker_engine, coordinator, gpus, nvml_lib, containers
):
    """A provider reclaims node A while the reference job holds 48 MB of state. The job writes
    its final checkpoint to its bucket and exits 0; `spotctl timeline` shows sigterm_sent, then
    checkpoint_started, then checkpoint_committed (generation 1, 48 MiB), then container_exited
    0, then drained. The bucket holds generation 1, whole, and a new run resumes from it."""
    client = docker_engine.client
    ensure_checkpoint_job_image(client)
    agent = start_agent(
        tmp_path,
        "node-a",
        coordinator,
        docker_engine.host,
        gpus,
        nvml_lib,
        AgentOptions(grace_s=4.0, overrun_s=1.0),
    )
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    agent.deadline_file.parent.mkdir(parents=True, exist_ok=True)
    name = containers + "ckpt"
    job = run_job(
        client, name, "node-a", bucket, agent.deadline_file.parent, agent.status_dir(name)
    )
    try:
        agent.write_notice(
            {
                "id": "i-ckpt-1",
                "action": "terminate",
                "terminate_at": time.time() + 15,
                "source": "aws-imds",
            }
        )
        admin = coordinator.admin()
        drained = admin.wait_for("drained", node="node-a", timeout=40)
        out = subprocess.run(
            [
                str(BIN / "spotctl"),
                *coordinator.cli_args(),
                "timeline",
                drained["reclaim_id"],
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        timeline = json.loads(out)
        ours = [e for e in timeline["events"] if e.get("name") == name]
        kinds = [e["kind"] for e in ours]
        assert kinds == [
            "sigterm_sent",
            "checkpoint_started",
            "checkpoint_committed",
            "container_exited",
        ], kinds
        started, done, exited = ours[1], ours[2], ours[3]
        assert started["generation"] == done["generation"] == 1
        assert done["bytes"] == STATE_MB * 1024 * 1024
        assert exited["exit_code"] == 0, job.logs().decode()
        assert 0 <= done["since_sigterm_s"] < timeline["grace_deadline"] - timeline["t0"]
        assert started["container"] == job.id
        all_kinds = [e["kind"] for e in timeline["events"]]
        assert all_kinds.index("container_exited") < all_kinds.index("drained")
        assert "workload_report_invalid" not in all_kinds and "overrun" not in all_kinds
        # The human table shows the steps too.
        table = subprocess.run(
            [str(BIN / "spotctl"), *coordinator.cli_args(), "timeline", drained["reclaim_id"]],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        assert "checkpoint_committed" in table and "generation=1" in table

        # The bucket: generation 1's manifest, and every object it names, whole.
        manifest = json.loads((bucket / "manifests" / "gen-000000000001.json").read_bytes())
        assert manifest["generation"] == 1 and manifest["bytes"] == STATE_MB * 1024 * 1024
        for o in manifest["objects"]:
            data = (bucket / o["key"]).read_bytes()
            assert f"{zlib.crc32(data):08x}" == o["crc32"]
        assert b"job: committed generation 1" in job.logs()

        # A new run (elsewhere: not this node's) resumes from that generation.
        again = run_job(client, containers + "again", "node-z", bucket)
        assert f"job: resumed generation 1 at step {manifest['step']} ".encode() in again.logs()
        again.kill()
    finally:
        agent.proc.stop()
