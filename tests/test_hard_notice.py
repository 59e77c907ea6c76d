"""The hard-notice timeline on real parts: a coordinator and an agent as processes, a real
Docker engine with real containers, the real pynvml over the fake libnvidia-ml.so.1."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dockerenv import remove_test_containers, run_workload
from fakenvml import FakeGpus, build
from harness import AgentOptions, start_agent, start_coordinator, wait_until
from pki import Pki

pytestmark = pytest.mark.docker


@pytest.fixture(scope="session")
def nvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("nvml"))


@pytest.fixture
def gpus(tmp_path: Path) -> FakeGpus:
    g = FakeGpus(tmp_path / "gpus.state")
    g.set(gpus=2)
    return g


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki")


@pytest.fixture
def coordinator(tmp_path: Path, pki: Pki):
    coord = start_coordinator(tmp_path / "coordinator", tls=pki)
    yield coord
    coord.proc.stop()


@pytest.fixture
def containers(docker_engine, docker_images, request):
    prefix = f"sdt-{request.node.name[:30]}-{int(time.time() * 1000) % 100000}-"
    yield prefix
    remove_test_containers(docker_engine.client, prefix)


def test_whole_timeline_on_one_node(
    tmp_path, docker_engine, coordinator, gpus, nvml_lib, containers
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
        tmp_path, "node-a", coordinator, docker_engine.host, gpus, nvml_lib,
        AgentOptions(grace_s=4.0, overrun_s=1.0),
    )
    admin = coordinator.admin()
    try:
        t_notice = time.time()
        agent.write_notice(
            {"id": "i-0abc-1", "action": "terminate", "terminate_at": t_notice + 8,
             "source": "aws-imds"}
        )
        drained = admin.wait_for("drained", node="node-a", timeout=30)
        events = admin.events(node="node-a", reclaim_id=drained["reclaim_id"])
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
        assert exits == {containers + "quick": 0, containers + "ckpt": 0,
                         containers + "stubborn": 137}
        assert kinds[-2:] == ["verified_empty", "drained"]
        notice = events[0]
        # G = D - 4: the SIGKILL went out at G, not before.
        kill_ev = next(e for e in events if e["kind"] == "sigkill_sent")
        assert kill_ev["wall_time"] >= notice["grace_deadline"]
        assert drained["spare_s"] == pytest.approx(
            notice["terminate_at"] - drained["wall_time"], abs=0.01)
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
