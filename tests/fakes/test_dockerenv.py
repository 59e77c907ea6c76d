"""The Docker test environment does what the drain tests rely on (tests/fakes/dockerenv.py)."""

from __future__ import annotations

import json
import threading
import time
import uuid

import docker.types
import pytest

from fakes.dockerenv import (
    BASE_IMAGE,
    READY_LINE,
    SignalProbe,
    ensure_images,
    ping,
    remove_test_containers,
    run_workload,
    workload_command,
)

pytestmark = pytest.mark.docker

NODE = "node-dockerenv"


@pytest.fixture
def name_prefix(docker_engine):
    """A unique container name prefix per test; its containers are removed afterwards."""
    prefix = f"spotdrain-test-{uuid.uuid4().hex[:8]}-"
    yield prefix
    remove_test_containers(docker_engine.client, prefix)


def wait_exit(container, timeout: float = 15.0) -> tuple[int, float]:
    """Exit code and seconds waited."""
    started = time.monotonic()
    status = container.wait(timeout=timeout)
    return status["StatusCode"], time.monotonic() - started


def logs(container) -> str:
    return container.logs().decode(errors="replace")


def test_engine_answers(docker_engine):
    """The session's engine answers a ping and reports its version through the client."""
    assert docker_engine.host.startswith(("unix://", "tcp://", "ssh://"))
    assert ping(docker_engine.host) or docker_engine.client.ping()
    assert docker_engine.client.version()["ApiVersion"]


def test_images_are_imported_once(docker_engine, docker_images):
    """A second ensure_images finds the image current and does not import it again."""
    before = docker_engine.client.images.get(BASE_IMAGE).id
    started = time.monotonic()
    images = ensure_images(docker_engine.client)
    assert time.monotonic() - started < 5
    assert docker_engine.client.images.get(BASE_IMAGE).id == before
    assert images == docker_images
    assert {"base", "exits_on_term", "checkpoints", "ignores_term"} <= set(images)


def test_workload_carries_drain_labels(docker_engine, docker_images, name_prefix):
    """A workload carries its node and drain kind, and has no network."""
    container = run_workload(
        docker_engine.client,
        name=name_prefix + "w",
        node_id=NODE,
        kind="exits_on_term",
        drain_kind="render",
        labels={"team": "ml"},
    )
    container.reload()
    labels = container.labels
    assert labels["spotdrain.node"] == NODE
    assert labels["spotdrain.kind"] == "render"
    assert labels["spotdrain.test.behaviour"] == "exits_on_term"
    assert labels["team"] == "ml"
    assert container.attrs["HostConfig"]["NetworkMode"] == "none"
    assert container.attrs["HostConfig"]["AutoRemove"] is False
    assert container.attrs["Config"]["Cmd"] == workload_command("exits_on_term")
    assert container.status == "running"


def test_default_drain_kind_is_batch(docker_engine, docker_images, name_prefix):
    """Without a drain kind, a workload is a batch job (SIGTERM, checkpoint, exit)."""
    container = run_workload(
        docker_engine.client, name=name_prefix + "w", node_id=NODE, kind="ignores_term"
    )
    assert container.labels["spotdrain.kind"] == "batch"


def test_exits_on_term_exits_zero_at_once(docker_engine, docker_images, name_prefix):
    """A job that traps TERM exits 0 right after the signal, not after its sleep ends."""
    container = run_workload(
        docker_engine.client, name=name_prefix + "w", node_id=NODE, kind="exits_on_term"
    )
    container.kill(signal="SIGTERM")
    code, waited = wait_exit(container)
    assert code == 0, logs(container)
    assert waited < 2.0
    assert "SIGTERM, exiting" in logs(container)


def test_checkpoints_for_checkpoint_s_then_exits(
    docker_engine, docker_images, name_prefix, tmp_path
):
    """A checkpointing job reads the deadline file, keeps running for CHECKPOINT_S, exits 0."""
    deadline = {
        "reclaim_id": "i-0abc-1",
        "terminate_at": 1795979220.0,
        "grace_deadline": 1795979210.0,
        "reason": "notice",
    }
    (tmp_path / "deadline.json").write_text(json.dumps(deadline))
    container = run_workload(
        docker_engine.client,
        name=name_prefix + "w",
        node_id=NODE,
        kind="checkpoints",
        env={"CHECKPOINT_S": "1.5", "SPOTDRAIN_DEADLINE_FILE": "/run/spotdrain/deadline.json"},
        mounts=[
            docker.types.Mount(
                target="/run/spotdrain", source=str(tmp_path), type="bind", read_only=True
            )
        ],
    )
    signalled = time.monotonic()
    container.kill(signal="SIGTERM")
    time.sleep(0.7)
    container.reload()
    assert container.status == "running", "exited before its checkpoint was done"
    container.kill(signal="SIGTERM")  # a second TERM does not restart the checkpoint
    code, _ = wait_exit(container)
    took = time.monotonic() - signalled
    out = logs(container)
    assert code == 0, out
    assert 1.5 <= took < 5.0, out
    assert out.count("checkpointing for 1.5s") == 1
    assert "SIGTERM again, still checkpointing" in out
    assert "checkpoint done" in out
    printed = out.split("deadline file: ", 1)[1].splitlines()[0]
    assert json.loads(printed) == deadline


def test_checkpoints_finds_a_deadline_file_written_after_the_signal(
    docker_engine, docker_images, name_prefix, tmp_path
):
    """The agent signals first and writes the deadline file right after (DESIGN step 4)."""
    container = run_workload(
        docker_engine.client,
        name=name_prefix + "w",
        node_id=NODE,
        kind="checkpoints",
        env={"CHECKPOINT_S": "2", "SPOTDRAIN_DEADLINE_FILE": "/run/spotdrain/deadline.json"},
        mounts=[
            docker.types.Mount(
                target="/run/spotdrain", source=str(tmp_path), type="bind", read_only=True
            )
        ],
    )
    container.kill(signal="SIGTERM")
    time.sleep(0.3)
    (tmp_path / "deadline.json").write_text('{"reason": "pause"}')
    code, _ = wait_exit(container)
    assert code == 0
    assert 'deadline file: {"reason": "pause"}' in logs(container)


def test_checkpoint_default_comes_from_the_command(docker_engine, docker_images):
    """Without CHECKPOINT_S the option baked into the command applies (3 s unless given)."""
    assert ': "${CHECKPOINT_S:=3}"' in workload_command("checkpoints")[2]
    assert ': "${CHECKPOINT_S:=0.5}"' in workload_command("checkpoints", checkpoint_s=0.5)[2]
    with pytest.raises(TypeError):
        workload_command("exits_on_term", checkpoint_s=1)
    with pytest.raises(ValueError):
        workload_command("sleeps_forever")


def test_ignores_term_runs_until_sigkill(docker_engine, docker_images, name_prefix):
    """A job that ignores TERM keeps running; only SIGKILL ends it, with exit code 137."""
    container = run_workload(
        docker_engine.client, name=name_prefix + "w", node_id=NODE, kind="ignores_term"
    )
    container.kill(signal="SIGTERM")
    time.sleep(1.0)
    container.reload()
    assert container.status == "running"
    assert "SIGTERM ignored" in logs(container)
    container.kill(signal="SIGKILL")
    code, waited = wait_exit(container)
    assert code == 137
    assert waited < 2.0


@pytest.mark.parametrize("kind", ["exits_on_term", "checkpoints", "ignores_term"])
def test_signal_probe_reports_term(docker_engine, docker_images, name_prefix, tmp_path, kind):
    """The trap's first act is a line on the FIFO, so the host can time SIGTERM delivery."""
    with SignalProbe(tmp_path / "probe") as probe:
        container = run_workload(
            docker_engine.client,
            name=name_prefix + "w",
            node_id=NODE,
            kind=kind,
            env={**probe.env, "SPOTDRAIN_PROBE_ID": f"probe-{kind}", "CHECKPOINT_S": "0.2"},
            mounts=[probe.mount],
        )
        got = []
        reader = threading.Thread(target=lambda: got.append(probe.read(timeout=10)))
        reader.start()
        sent = time.monotonic()
        container.kill(signal="SIGTERM")
        reader.join()
        assert got, "no probe line"
        assert got[0].text == f"TERM probe-{kind}"
        assert 0 <= got[0].monotonic - sent < 1.0
        with pytest.raises(TimeoutError):
            probe.read(timeout=0.1)
    if kind == "ignores_term":
        container.kill(signal="SIGKILL")
    assert wait_exit(container)[0] == (137 if kind == "ignores_term" else 0)


def test_probe_is_optional(docker_engine, docker_images, name_prefix):
    """A SIGNAL_FIFO that does not exist in the container is ignored."""
    container = run_workload(
        docker_engine.client,
        name=name_prefix + "w",
        node_id=NODE,
        kind="exits_on_term",
        env={"SIGNAL_FIFO": "/nonexistent/fifo"},
    )
    container.kill(signal="SIGTERM")
    assert wait_exit(container)[0] == 0


def test_workload_is_ready_only_after_its_trap_is_set(docker_engine, docker_images, name_prefix):
    """run_workload returns after READY_LINE, so a TERM sent at once is not lost."""
    for i in range(3):
        container = run_workload(
            docker_engine.client, name=f"{name_prefix}{i}", node_id=NODE, kind="exits_on_term"
        )
        assert READY_LINE in logs(container)
        container.kill(signal="SIGTERM")
        assert wait_exit(container)[0] == 0


def test_remove_test_containers_removes_only_the_prefix(docker_engine, docker_images, name_prefix):
    client = docker_engine.client
    mine = [
        run_workload(client, name=f"{name_prefix}{i}", node_id=NODE, kind="ignores_term")
        for i in range(2)
    ]
    other_prefix = f"spotdrain-test-{uuid.uuid4().hex[:8]}-"
    other = run_workload(client, name=other_prefix + "x", node_id=NODE, kind="exits_on_term")
    try:
        assert remove_test_containers(client, name_prefix) == 2
        names = {c.name for c in client.containers.list(all=True)}
        assert not any(c.name in names for c in mine)
        assert other.name in names
    finally:
        remove_test_containers(client, other_prefix)
