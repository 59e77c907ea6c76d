"""The agent keeps its promise without its disk (issue 11, item 6), on real parts: the agent's
state directory is a small tmpfs, filled to the last byte before the notice. A coordinator and
an agent as processes, a real Docker engine, the real pynvml over the fake library.

Mounting a tmpfs needs root (CAP_SYS_ADMIN), as the Docker-backed tests do already.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fakes.dockerenv import run_workload
from fakes.harness import AgentOptions, start_agent
from fakes.waiting import wait_until

pytestmark = pytest.mark.docker

TMPFS_SIZE = "512k"


@pytest.fixture
def small_state_dir(tmp_path: Path) -> Iterator[Path]:
    """node-a's state directory (as harness.start_agent lays it out) on its own small tmpfs."""
    state = tmp_path / "node-a" / "state"
    state.mkdir(parents=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE},mode=0700", "tmpfs", str(state)],
        check=True,
    )
    try:
        yield state
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)


def fill(directory: Path) -> Path:
    """Write a file until the filesystem refuses another byte."""
    path = directory / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for chunk in (65536, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    return path


def outbox_rows(state: Path) -> int:
    db = sqlite3.connect(f"file:{state / 'outbox.sqlite'}?mode=ro", uri=True)
    try:
        return int(db.execute("SELECT count(*) FROM outbox").fetchone()[0])
    finally:
        db.close()


def test_a_notice_on_a_full_state_disk_is_answered_and_nothing_is_lost_when_it_frees(
    tmp_path, small_state_dir, docker_engine, coordinator, gpus, nvml_lib, containers
):
    """The agent's state disk fills up before the notice. The notice is still answered on time
    from memory: remote taint, SIGTERM to both jobs, SIGKILL at G for the one that ignores it,
    verified empty, drained. The coordinator hears why the bundle is not on disk
    (state_write_failed naming it, ENOSPC), and the agent stays up. Space is freed: the bundle
    is written, every event is stored exactly once at the coordinator, the outbox empties. The
    disk fills again and the agent is SIGKILLed: it starts, stays up, and the notice still on
    disk is the same reclamation, not a new one."""
    client = docker_engine.client
    quick = run_workload(client, name=containers + "quick", node_id="node-a", kind="exits_on_term")
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
        AgentOptions(grace_s=3.0, overrun_s=1.0),
    )
    assert agent.state_dir == small_state_dir
    admin = coordinator.admin()
    try:
        wait_until(lambda: any(n.connected for n in admin.nodes()), 10, "node-a to register")
        filler = fill(small_state_dir)
        agent.write_notice(
            {"id": "full-disk-1", "action": "terminate", "terminate_at": time.time() + 8}
        )
        drained = admin.wait_for("drained", node="node-a", timeout=30)
        rid = drained["reclaim_id"]
        bundle = small_state_dir / "reclamations" / f"{rid}.json"
        events = admin.events(node="node-a", reclaim_id=rid)
        kinds = [e["kind"] for e in events if not e["uid"].startswith("coordinator-")]
        assert kinds.index("tainted") < kinds.index("sigterm_sent")
        notice = next(e for e in events if e["kind"] == "notice_received")
        assert {e["name"] for e in events if e["kind"] == "sigterm_sent"} == {
            quick.name,
            stubborn.name,
        }
        [kill] = [e for e in events if e["kind"] == "sigkill_sent"]
        assert kill["name"] == stubborn.name and kill["wall_time"] >= notice["grace_deadline"]
        assert drained["spare_s"] > 0
        failed = admin.wait_for("state_write_failed", node="node-a", path=str(bundle))
        assert failed["errno"] == "ENOSPC"
        assert not bundle.exists()
        assert agent.proc.popen.poll() is None  # never exits because a write failed

        filler.unlink()
        admin.wait_for("state_write_resumed", node="node-a", path=str(bundle), timeout=15)
        wait_until(bundle.exists, 10, "the bundle to be written")
        wait_until(lambda: outbox_rows(small_state_dir) == 0, 15, "the outbox to empty")
        everything = admin.events(node="node-a")
        uids = [e["uid"] for e in everything]
        assert len(uids) == len(set(uids))
        ours = [e["kind"] for e in everything if e["reclaim_id"] == rid]
        for kind in ("notice_received", "sigkill_sent", "verified_empty", "drained"):
            assert ours.count(kind) == 1, (kind, ours)
        assert ours.count("sigterm_sent") == 2 and ours.count("container_exited") == 2
        assert [e["path"] for e in everything if e["kind"] == "state_write_failed"].count(
            str(bundle)
        ) == 1

        fill(small_state_dir)
        agent.proc.kill()
        agent.restart()
        wait_until(
            lambda: agent.proc.log().count("agent up") == 2 or agent.proc.popen.poll(),
            20,
            "the agent to start again on the full disk",
        )
        # A later notice's notice_received comes after whatever the restarted agent made of
        # the notice still on disk (one watcher, one ordered outbox) and after its start on
        # the full disk: the barrier for "not a new reclamation" and "no crash".
        agent.write_notice(
            {"id": "full-disk-2", "action": "terminate", "terminate_at": time.time() + 60}
        )
        admin.wait_for("notice_received", node="node-a", notice_id="full-disk-2", timeout=20)
        assert agent.proc.popen.poll() is None
        received = [e for e in admin.events(node="node-a") if e["kind"] == "notice_received"]
        assert [e["notice_id"] for e in received] == ["full-disk-1", "full-disk-2"]
    finally:
        agent.proc.stop()
