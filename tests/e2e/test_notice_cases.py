"""What the agent does with each kind of notice file, on a real node: duplicates, cancels,
deadlines already past, AWS's own format, and malformed input."""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import UTC, datetime

import pytest
from test_pause import spotctl

from fakes.dockerenv import run_workload
from fakes.harness import AgentOptions, start_agent
from fakes.waiting import wait_until

pytestmark = pytest.mark.docker


def bundle(agent, notice_id: str) -> dict | None:
    """The agent's reclamation bundle for a notice, as on disk (what spotctl reads)."""
    for path in (agent.state_dir / "reclamations").glob("*.json"):
        doc = json.loads(path.read_text())
        if doc["notice_id"] == notice_id:
            return doc
    return None


def file_reads(agent) -> int:
    """Parses of the notice file the agent has handed on (its file source's `reads`)."""
    status = spotctl(agent, "status")
    return next(s["reads"] for s in status["sources"] if s["source"] == "file")


def by_kind(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["kind"] == kind]


@pytest.fixture
def node_a(tmp_path, docker_engine, coordinator, gpus, nvml_lib):
    agent = start_agent(
        tmp_path,
        "node-a",
        coordinator,
        docker_engine.host,
        gpus,
        nvml_lib,
        AgentOptions(grace_s=2.0, overrun_s=1.0),
    )
    yield agent
    agent.proc.stop()


def test_duplicate_notice_is_one_reclamation(node_a, coordinator, docker_engine, containers):
    """The relay rewrites the same notice (same id) with a later terminate_at. It is the same
    reclamation: recorded once, and its deadlines do not move (invariant 2)."""
    run_workload(
        docker_engine.client, name=containers + "job", node_id="node-a", kind="exits_on_term"
    )
    admin = coordinator.admin()
    first_deadline = time.time() + 6
    node_a.write_notice({"id": "dup-1", "action": "terminate", "terminate_at": first_deadline})
    admin.wait_for("drained", node="node-a")
    node_a.write_notice(
        {
            "id": "dup-1",
            "action": "terminate",
            "terminate_at": first_deadline + 600,
            "source": "relay-retry",
        }
    )
    # The same bytes again, and a notice with no id whose content repeats: also one each.
    node_a.write_notice(b'{"action": "terminate", "time": "2031-01-01T00:00:00Z"}')
    wait_until(
        lambda: len(by_kind(admin.events(node="node-a"), "notice_received")) == 2,
        10,
        "the no-id notice",
    )
    node_a.write_notice({"id": "other", "action": "terminate", "terminate_at": 1924992000})
    wait_until(
        lambda: len(by_kind(admin.events(node="node-a"), "notice_received")) == 3,
        10,
        "the third notice",
    )
    read = file_reads(node_a)
    node_a.write_notice(b'{"action": "terminate", "time": "2031-01-01T00:00:00Z"}')
    wait_until(lambda: file_reads(node_a) == read + 1, 10, "the repeat read")
    # A refused notice after it: its event comes through the same ordered outbox after
    # anything the repeat would have caused (the barrier for "nothing").
    node_a.write_notice(b"not json")
    admin.wait_for("notice_invalid", node="node-a")
    received = by_kind(admin.events(node="node-a"), "notice_received")
    assert [r["notice_id"] for r in received][0] == "dup-1"
    assert received[0]["terminate_at"] == pytest.approx(first_deadline)
    assert len(received) == 3
    assert len({r["reclaim_id"] for r in received}) == 3


def test_cancel_before_anything_was_stopped_lifts_the_taint(
    node_a, coordinator, docker_engine, containers
):
    """The provider withdraws its notice while the coordinator is hung and the agent is still
    waiting for the taint. Nothing was stopped yet, so the taint is lifted (remote too, once the
    coordinator is back), the job never sees a signal, and the cancel is recorded."""
    job = run_workload(
        docker_engine.client, name=containers + "job", node_id="node-a", kind="exits_on_term"
    )
    admin = coordinator.admin()
    wait_until(lambda: any(n.connected for n in admin.nodes()), 10, "registration")
    coordinator.proc.signal(signal.SIGSTOP)
    try:
        node_a.write_notice(
            {"id": "cancel-1", "action": "terminate", "terminate_at": time.time() + 20}
        )
        # The agent took the notice in (its bundle on disk) before the cancel replaces it, and
        # then the cancel, both while the coordinator is still hung: barriers, not sleeps.
        wait_until(lambda: bundle(node_a, "cancel-1"), 10, "the notice's bundle")
        node_a.write_notice({"id": "cancel-1", "action": "cancel"})
        wait_until(
            lambda: (bundle(node_a, "cancel-1") or {}).get("cancel_recorded"),
            10,
            "the cancel in the bundle",
        )
    finally:
        coordinator.proc.signal(signal.SIGCONT)
    cancelled = admin.wait_for("notice_cancelled", node="node-a")
    assert cancelled["lifted"] is True
    wait_until(lambda: not [t for n in admin.nodes() for t in n.taints], 10, "the taint lifted")
    # A later notice the agent refuses (it taints and stops nothing) comes through the same
    # ordered outbox after anything the cancelled reclamation said: the barrier.
    node_a.write_notice(b"not json")
    admin.wait_for("notice_invalid", node="node-a")
    kinds = admin.kinds(node="node-a")
    assert "sigterm_sent" not in kinds and "tainted" not in kinds
    job.reload()
    assert job.status == "running"
    assert not node_a.deadline_file.exists()


def test_cancel_after_signals_is_recorded_and_the_drain_goes_on(
    node_a, coordinator, docker_engine, containers
):
    """The cancel comes after the jobs were signalled: what was stopped stays stopped, the
    cancel is recorded, and the drain finishes under its original deadlines."""
    run_workload(
        docker_engine.client,
        name=containers + "job",
        node_id="node-a",
        kind="checkpoints",
        env={"CHECKPOINT_S": "1"},
    )
    admin = coordinator.admin()
    node_a.write_notice({"id": "cancel-2", "action": "terminate", "terminate_at": time.time() + 8})
    admin.wait_for("sigterm_sent", node="node-a")
    node_a.write_notice({"id": "cancel-2", "action": "cancel"})
    cancelled = admin.wait_for("notice_cancelled", node="node-a")
    assert cancelled["lifted"] is False
    drained = admin.wait_for("drained", node="node-a")
    assert drained["reclaim_id"] == cancelled["reclaim_id"]


def test_notice_with_deadline_already_past(node_a, coordinator, docker_engine, containers):
    """The relay was slow and the deadline has passed when the notice lands. The agent still
    taints and stops everything at once (SIGTERM, then SIGKILL since G is gone too), and counts
    the reclamation as an overrun: it could not finish inside the provider's deadline."""
    stubborn = run_workload(
        docker_engine.client, name=containers + "stubborn", node_id="node-a", kind="ignores_term"
    )
    admin = coordinator.admin()
    node_a.write_notice({"id": "late-1", "action": "terminate", "terminate_at": time.time() - 5})
    admin.wait_for("overrun", node="node-a")
    admin.wait_for("verified_empty", node="node-a")
    events = admin.events(node="node-a")
    kinds = [e["kind"] for e in events]
    assert by_kind(events, "notice_received")[0]["late"] is True
    assert kinds.index("tainted") < kinds.index("sigterm_sent") < kinds.index("sigkill_sent")
    assert "drained" not in kinds
    stubborn.reload()
    assert stubborn.attrs["State"]["ExitCode"] == 137


def test_aws_instance_action_document_as_is(node_a, coordinator, docker_engine, containers):
    """A relay copies AWS's instance-action document verbatim: it is understood as a notice
    with D at its `time`, deduplicated by its content."""
    run_workload(
        docker_engine.client, name=containers + "job", node_id="node-a", kind="exits_on_term"
    )
    admin = coordinator.admin()
    d = datetime.fromtimestamp(int(time.time()) + 9, UTC)
    node_a.write_notice({"action": "terminate", "time": d.strftime("%Y-%m-%dT%H:%M:%SZ")})
    drained = admin.wait_for("drained", node="node-a")
    notice = by_kind(admin.events(node="node-a"), "notice_received")[0]
    assert notice["source"] == "aws-instance-action"
    assert notice["terminate_at"] == d.timestamp()
    assert notice["notice_id"].startswith("sha256:")
    assert 0 < drained["spare_s"] <= 9


MALFORMED = [
    (b'{"id": "x", "action": "terminate", "terminate_at": ', "not JSON"),
    (b"\xff\xfe garbage", "not UTF-8"),
    (b'["terminate"]', "not a JSON object"),
    (b'{"id": "x", "action": "explode"}', "action must be one of"),
    (b'{"id": "x", "action": "terminate", "terminate_at": "tomorrow"}', "ISO 8601"),
    (b'{"id": "x", "action": "terminate", "terminate_at": "2026-11-29T18:44:00"}', "time zone"),
    (b'{"action": "cancel"}', "cancel notice needs the id"),
]


def test_malformed_notices_are_reported_and_change_nothing(
    node_a, coordinator, docker_engine, containers
):
    """A broken relay writes garbage, one shape after another. Each is a clear
    `notice_invalid` with its reason; the agent keeps running, taints nothing, stops nothing,
    and still answers the valid notice that follows."""
    job = run_workload(
        docker_engine.client, name=containers + "job", node_id="node-a", kind="exits_on_term"
    )
    admin = coordinator.admin()
    for n, (raw, _) in enumerate(MALFORMED, 1):
        node_a.write_notice(raw)
        # Each one read before the next replaces it (the watcher reads the file as it is now).
        wait_until(
            lambda n=n: len(by_kind(admin.events(node="node-a"), "notice_invalid")) == n,
            10,
            f"notice_invalid number {n}",
        )
    invalid = by_kind(admin.events(node="node-a"), "notice_invalid")
    for (_, reason), ev in zip(MALFORMED, invalid, strict=True):
        assert reason in ev["reason"]
    assert set(admin.kinds(node="node-a")) == {"notice_invalid"}
    assert not [t for n in admin.nodes() for t in n.taints]
    job.reload()
    assert job.status == "running"
    assert node_a.proc.popen.poll() is None
    # A partial write in place (no rename): the agent reads it only when the writer closes,
    # once (a read of the half-written file would count, and be a notice_invalid).
    read = file_reads(node_a)
    with open(node_a.notice_file, "wb") as f:
        f.write(b'{"id": "after-garbage", "action": ')
        f.flush()
        os.fsync(f.fileno())
        time.sleep(0.3)
        f.write(b'"terminate", "terminate_at": %d}' % (time.time() + 8))
    admin.wait_for("drained", node="node-a")
    assert len(by_kind(admin.events(node="node-a"), "notice_invalid")) == len(MALFORMED)
    assert file_reads(node_a) == read + 1
