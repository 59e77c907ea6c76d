"""The coordinator's store and handlers, with a fake clock and a real SQLite file."""

from __future__ import annotations

import sqlite3

import grpc
import pytest

from spotdrain.coordinator.service import AgentLinkServicer, Coordinator
from spotdrain.coordinator.store import SCHEMA_VERSION, Store, StoreError
from spotdrain.coordinator.timeline import fold, new_record
from spotdrain.v1 import spotdrain_pb2 as pb


class FakeClock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path, clock) -> Store:
    s = Store(tmp_path / "c.sqlite", clock=clock)
    yield s
    s.close()


def add(store: Store, uid: str, kind: str, t: float, **details) -> int | None:
    return store.add_event(uid, kind, "node-a", "rcl-1", t, t - 100.0, details)


def test_a_reclamation_record_is_folded_from_its_events(store, clock):
    """The agent's events arrive one by one; the record holds the deadlines the agent computed,
    each step's first time, and the outcome with its spare seconds."""
    add(store, "1", "notice_received", 100.0, notice_id="i-1", reason="notice", source="aws",
        t0=100.0, terminate_at=130.0, grace_deadline=120.0, overrun_at=128.0)
    add(store, "2", "tainted", 100.01, mode="local")
    add(store, "3", "sigterm_sent", 100.02, name="a")
    add(store, "4", "sigterm_sent", 100.03, name="b")
    add(store, "5", "tainted", 101.0, mode="remote", after_local=True)
    add(store, "6", "container_exited", 103.0, exit_code=0)
    add(store, "7", "drained", 104.0, spare_s=26.0)
    add(store, "8", "overrun", 128.0)  # cannot happen from a correct agent; first outcome wins
    rec = store.reclamation("rcl-1")
    assert (rec["t0"], rec["terminate_at"], rec["grace_deadline"], rec["overrun_at"]) == (
        100.0, 130.0, 120.0, 128.0)
    assert rec["outcome"] == "drained" and rec["spare_s"] == 26.0
    steps = rec["steps"]
    assert steps["tainted_local"] == 100.01 and steps["tainted_remote"] == 101.0
    assert steps["sigterm_sent"] == 100.02 and steps["last_sigterm_sent"] == 100.03
    assert store.reclamation("") == rec  # the latest


def test_events_are_stored_once_per_uid_with_growing_ids(store):
    first = add(store, "u1", "notice_received", 1.0, t0=1.0)
    assert add(store, "u1", "notice_received", 1.0, t0=1.0) is None
    second = add(store, "u2", "tainted", 2.0, mode="remote")
    assert first is not None and second is not None and second > first
    assert [e.uid for e in store.events_after(0)] == ["u1", "u2"]
    assert [e.uid for e in store.events_after(first)] == ["u2"]
    assert store.reclamation("rcl-1")["steps"] == {"notice_received": 1.0, "tainted_remote": 2.0}


def test_store_is_wal_and_versioned(tmp_path, store):
    mode = store.db.execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    db = sqlite3.connect(tmp_path / "c.sqlite")
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(
        SCHEMA_VERSION)
    db.close()


def test_a_database_from_another_schema_version_is_refused(tmp_path):
    path = tmp_path / "old.sqlite"
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="schema version 99"):
        Store(path)


def test_a_file_that_is_not_sqlite_is_refused(tmp_path):
    path = tmp_path / "junk.sqlite"
    path.write_bytes(b"not a database at all" * 100)
    with pytest.raises(StoreError, match="junk.sqlite"):
        Store(path)


def test_taints_are_idempotent_and_keep_their_first_time(store, clock):
    store.add_taint("node-a", "rcl-1", "notice")
    clock.now += 5
    store.add_taint("node-a", "rcl-1", "notice")
    assert [(t.reclaim_id, t.since) for t in store.taints("node-a")] == [("rcl-1", 1000.0)]
    store.remove_taint("node-a", "rcl-1")
    assert store.taints("node-a") == []


def test_fold_ignores_non_numeric_deadlines():
    rec = new_record("rcl-1", "node-a")
    fold(rec, "notice_received", 5.0, {"t0": "soon", "terminate_at": 35.0})
    assert rec["t0"] == 0.0 and rec["terminate_at"] == 35.0


class FakeContext:
    """Enough of grpc.aio.ServicerContext for the handlers: a peer and an abort that raises."""

    def __init__(self, common_name: str | None) -> None:
        self.common_name = common_name
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def auth_context(self) -> dict:
        return {"x509_common_name": [self.common_name.encode()]} if self.common_name else {}

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise grpc.RpcError(details)


async def test_taint_handler_checks_the_certificate(store, clock):
    servicer = AgentLinkServicer(Coordinator(store, insecure=False, clock=clock))
    ok = FakeContext("node:node-a")
    reply = await servicer.Taint(pb.TaintRequest(node_id="node-a", reclaim_id="rcl-9"), ok)
    assert [t.reclaim_id for t in reply.taints] == ["rcl-9"] and reply.taints[0].since == 1000.0
    for cn, code in [("node:node-b", grpc.StatusCode.PERMISSION_DENIED),
                     ("operator:alice", grpc.StatusCode.PERMISSION_DENIED),
                     ("gibberish", grpc.StatusCode.UNAUTHENTICATED)]:
        ctx = FakeContext(cn)
        with pytest.raises(grpc.RpcError):
            await servicer.Taint(pb.TaintRequest(node_id="node-a", reclaim_id="rcl-8"), ctx)
        assert ctx.aborted[0] == code, cn
    assert [t.reclaim_id for t in store.taints("node-a")] == ["rcl-9"]
    refused = [e for e in store.events_after(0) if e.kind == "identity_refused"]
    assert len(refused) == 2  # gibberish has no identity to record


async def test_taint_without_reclaim_id_is_invalid(store, clock):
    servicer = AgentLinkServicer(Coordinator(store, insecure=False, clock=clock))
    ctx = FakeContext("node:node-a")
    with pytest.raises(grpc.RpcError):
        await servicer.Taint(pb.TaintRequest(node_id="node-a"), ctx)
    assert ctx.aborted[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert store.taints("node-a") == []


def test_a_version_1_database_is_migrated_in_place(tmp_path):
    """A coordinator upgraded over an existing database keeps every node and event, and nodes
    start with their workload enabled."""
    from spotdrain.coordinator.store import SCHEMA

    path = tmp_path / "v1.sqlite"
    db = sqlite3.connect(path)
    db.executescript(SCHEMA + "INSERT INTO meta VALUES ('schema_version', '1');"
                     "INSERT INTO nodes VALUES ('node-a', 1, 'g', '[]', 1.0, 2.0);")
    db.commit()
    db.close()
    store = Store(path)
    assert store.db.execute("SELECT value FROM meta").fetchone()[0] == str(SCHEMA_VERSION)
    assert [(n.node_id, n.workload_enabled) for n in store.nodes()] == [("node-a", True)]
    store.close()


def test_a_drain_keeps_its_first_deadlines(store, clock):
    """The agent retries its pause after a timeout: the coordinator keeps the first deadlines."""
    first = store.start_drain("node-a", "rcl-1", "pause", 1120.0, 1110.0)
    clock.now += 3
    again = store.start_drain("node-a", "rcl-1", "pause", 1123.0, 1113.0)
    assert (again.terminate_at, again.grace_deadline) == (first.terminate_at, 1110.0)
    assert [d.reclaim_id for d in store.active_drains("node-a")] == ["rcl-1"]
    store.end_drain("node-a", "rcl-1")
    assert store.active_drains() == []


def test_the_workload_flag_is_stored_even_for_an_unknown_node(store):
    assert store.set_workload("node-z", False) is True
    assert store.node("node-z").workload_enabled is False
    assert store.set_workload("node-z", False) is False
    assert store.set_workload("node-z", True) is True
