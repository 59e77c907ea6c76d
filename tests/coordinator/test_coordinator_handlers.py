"""The coordinator's handlers over a real store (each backend), with a fake clock; and what
only SQLite has (WAL, a file that is not a database, migration of an old file)."""

from __future__ import annotations

import sqlite3

import grpc
import pytest

from spotdrain.coordinator.api.agent_link import AgentLinkServicer, Coordinator
from spotdrain.coordinator.core.timeline import fold, new_record
from spotdrain.coordinator.fleet.drains import LIFTED_KEEP_S, LIFTED_PER_NODE
from spotdrain.coordinator.store import SCHEMA_VERSION, StoreError, StoreUnavailable, open_store
from spotdrain.coordinator.store.schema import SQLITE_WORDS, steps_from
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
async def store(store_url, clock):
    s = await open_store(store_url, clock=clock)
    yield s
    await s.close()


async def test_the_sqlite_store_is_wal_and_versioned(tmp_path):
    path = tmp_path / "c.sqlite"
    store = await open_store(str(path))
    await store.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(
        SCHEMA_VERSION
    )
    db.close()


async def test_a_file_that_is_not_sqlite_is_refused(tmp_path):
    path = tmp_path / "junk.sqlite"
    path.write_bytes(b"not a database at all" * 100)
    with pytest.raises(StoreError, match="junk.sqlite"):
        await open_store(str(path))


async def test_a_version_1_database_is_migrated_in_place(tmp_path):
    """A coordinator upgraded over an existing database keeps every node and event, and nodes
    start with their workload enabled."""
    path = tmp_path / "v1.sqlite"
    db = sqlite3.connect(path)
    version, statements = steps_from(0, SQLITE_WORDS)[0]
    assert version == 1
    for sql in statements:
        db.execute(sql)
    db.execute("INSERT INTO nodes VALUES ('node-a', 1, 'g', '[]', 1.0, 2.0)")
    db.commit()
    db.close()
    store = await open_store(str(path))
    assert [(n.node_id, n.workload_enabled) for n in await store.nodes()] == [("node-a", True)]
    await store.close()
    db = sqlite3.connect(path)
    assert db.execute("SELECT value FROM meta").fetchone()[0] == str(SCHEMA_VERSION)
    db.close()


def test_fold_ignores_non_numeric_deadlines():
    rec = new_record("rcl-1", "node-a")
    fold(rec, "notice_received", 5.0, {"t0": "soon", "terminate_at": 35.0})
    assert rec["t0"] == 0.0 and rec["terminate_at"] == 35.0


def test_the_record_keeps_the_earliest_d_the_agent_heard():
    """An update that moved D earlier moves the record's deadlines; one that did not, not."""
    rec = new_record("rcl-1", "node-a")
    fold(rec, "notice_received", 5.0, {"terminate_at": 305.0, "grace_deadline": 295.0})
    fold(rec, "notice_updated", 6.0, {"terminate_at": 305.0, "moved": False})
    assert rec["terminate_at"] == 305.0
    fold(rec, "notice_updated", 7.0, {"terminate_at": 65.0, "grace_deadline": 55.0, "moved": True})
    assert (rec["terminate_at"], rec["grace_deadline"]) == (65.0, 55.0)


class FakeContext:
    """Enough of grpc.aio.ServicerContext for the handlers: a peer and the status they set
    (`ended`: the code and message a refusal set; never an abort's exception)."""

    def __init__(self, common_name: str | None) -> None:
        self.common_name = common_name
        self.ended: tuple[grpc.StatusCode, str] | None = None
        self._code: grpc.StatusCode | None = None

    def auth_context(self) -> dict:
        return {"x509_common_name": [self.common_name.encode()]} if self.common_name else {}

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        assert self._code is not None, "the code comes first"
        self.ended = (self._code, details)

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AssertionError(f"aborted ({code}: {details}): a refusal sets the status instead")


async def test_taint_handler_checks_the_certificate(store, clock):
    servicer = AgentLinkServicer(Coordinator(store, insecure=False, clock=clock))
    ok = FakeContext("node:node-a")
    reply = await servicer.Taint(pb.TaintRequest(node_id="node-a", reclaim_id="rcl-9"), ok)
    assert [t.reclaim_id for t in reply.taints] == ["rcl-9"] and reply.taints[0].since == 1000.0
    for cn, code in [
        ("node:node-b", grpc.StatusCode.PERMISSION_DENIED),
        ("operator:alice", grpc.StatusCode.PERMISSION_DENIED),
        ("gibberish", grpc.StatusCode.UNAUTHENTICATED),
    ]:
        ctx = FakeContext(cn)
        assert (
            await servicer.Taint(pb.TaintRequest(node_id="node-a", reclaim_id="rcl-8"), ctx) is None
        )
        assert ctx.ended[0] == code, cn
    assert [t.reclaim_id for t in await store.taints("node-a")] == ["rcl-9"]
    refused = [e for e in await store.events_after(0) if e.kind == "identity_refused"]
    assert len(refused) == 2  # gibberish has no identity to record


async def test_taint_without_reclaim_id_is_invalid(store, clock):
    servicer = AgentLinkServicer(Coordinator(store, insecure=False, clock=clock))
    ctx = FakeContext("node:node-a")
    assert await servicer.Taint(pb.TaintRequest(node_id="node-a"), ctx) is None
    assert ctx.ended[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert await store.taints("node-a") == []


async def test_a_taint_with_deadlines_that_are_not_numbers_changes_nothing(store, clock):
    """NaN or infinity from the wire is refused before anything is stored."""
    servicer = AgentLinkServicer(Coordinator(store, insecure=False, clock=clock))
    for bad in (float("nan"), float("inf")):
        ctx = FakeContext("node:node-a")
        assert (
            await servicer.Taint(
                pb.TaintRequest(node_id="node-a", reclaim_id="rcl-1", terminate_at=bad), ctx
            )
            is None
        )
        assert ctx.ended[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert await store.taints("node-a") == [] and await store.active_drains() == []


async def test_a_taint_is_answered_only_once_it_is_stored(store, clock):
    """The reply's taint and the drain's deadlines are in the store when the agent hears back,
    and a retry of the same reclamation keeps the first deadlines (invariant 2)."""
    coord = Coordinator(store, insecure=False, clock=clock)
    servicer = AgentLinkServicer(coord)
    request = pb.TaintRequest(
        node_id="node-a",
        reclaim_id="rcl-1",
        reason="notice",
        terminate_at=1120.0,
        grace_deadline=1110.0,
    )
    await servicer.Taint(request, FakeContext("node:node-a"))
    [drain] = await store.active_drains("node-a")
    assert (drain.terminate_at, drain.grace_deadline) == (1120.0, 1110.0)
    clock.now += 5
    request.terminate_at, request.grace_deadline = 1200.0, 1190.0
    reply = await servicer.Taint(request, FakeContext("node:node-a"))
    [again] = await store.active_drains("node-a")
    assert (again.terminate_at, again.grace_deadline) == (1120.0, 1110.0)
    assert [t.since for t in reply.taints] == [1000.0]
    await coord.fleet.close()


async def test_a_taint_whose_transaction_rolled_back_is_stored_by_its_retry(store, clock):
    """The store fails a Taint's transaction after its drain was started: the agent hears
    UNAVAILABLE and retries, and the retry stores the drain. (Remembered as started although
    rolled back, the drain looked stored to the retry, which then stored nothing.)"""
    coord = Coordinator(store, insecure=False, clock=clock)
    servicer = AgentLinkServicer(coord)
    rentals = coord.fleet.rentals
    reclaim = rentals.reclaim

    async def failing_once(*args, **kwargs):
        rentals.reclaim = reclaim
        raise StoreUnavailable("database gone mid-transaction")

    rentals.reclaim = failing_once
    request = pb.TaintRequest(
        node_id="node-a",
        reclaim_id="rcl-1",
        reason="notice",
        terminate_at=1120.0,
        grace_deadline=1110.0,
    )
    ctx = FakeContext("node:node-a")
    assert await servicer.Taint(request, ctx) is None
    assert ctx.ended[0] == grpc.StatusCode.UNAVAILABLE
    assert await store.active_drains("node-a") == [] and coord.fleet.drains.active == {}
    reply = await servicer.Taint(request, FakeContext("node:node-a"))
    assert [t.reclaim_id for t in reply.taints] == ["rcl-1"]
    [drain] = await store.active_drains("node-a")
    assert (drain.reclaim_id, drain.terminate_at) == ("rcl-1", 1120.0)
    await coord.fleet.close()


async def test_a_command_reaches_its_agent_only_once_what_led_to_it_is_stored(store, clock):
    """Fleet.send inside a transaction: nothing on the node's stream until the commit, and a
    transaction that fails sends nothing (an agent must never run a worker the store lacks)."""
    import asyncio

    from spotdrain.coordinator.core import messages as msg

    fleet = Coordinator(store, insecure=True, clock=clock).fleet
    stream: asyncio.Queue = asyncio.Queue()
    fleet.nodes.streams["node-a"] = stream
    start = msg.StartWorker(
        worker_id="w-1", model="m", image="img", port=9000, capacity=1, kind="inference"
    )
    with pytest.raises(RuntimeError, match="the write failed"):
        async with store.transaction():
            fleet.send("node-a", start)
            assert stream.empty()
            raise RuntimeError("the write failed")
    assert stream.empty()
    async with store.transaction():
        fleet.send("node-a", start)
        await store.add_taint("node-a", "rcl-1", "notice")
        assert stream.empty()
    assert stream.get_nowait() == start
    fleet.send("node-a", start)  # outside a transaction: at once
    assert stream.get_nowait() == start


async def test_a_failing_reaction_still_acknowledges_the_stored_batch(store, clock):
    """An advisory's reaction that fails (a store error) is logged; the agent's batch, already
    stored, is acknowledged all the same, so its stream is not ended over it."""
    from spotdrain.coordinator.fleet.eventlog import EventLog
    from spotdrain.coordinator.store import NewEvent

    log = EventLog(store, clock)
    seen = []

    async def broken(ev):
        seen.append(ev.uid)
        raise RuntimeError("the risk table is gone")

    log.react({"advisory_received": broken})
    batch = [
        NewEvent(
            uid=f"u-{i}",
            kind=kind,
            node_id="node-a",
            reclaim_id="",
            wall_time=1.0,
            t_offset_s=None,
            details={},
        )
        for i, kind in enumerate(("advisory_received", "notice_source_down"))
    ]
    assert await log.accept(batch) == ["u-0", "u-1"]
    assert seen == ["u-0"]
    assert [e.uid for e in await store.events_after(0)] == ["u-0", "u-1"]


async def test_a_node_reconnecting_unchanged_costs_one_blind_write(store, clock):
    """A node that registers again with the claims its row already holds (every node after a
    coordinator restart) gets its last_seen moved by a blind write that commits with the
    others, not a read-modify-write transaction of its own; a node whose claims changed still
    takes the full registration, and what it claims is stored."""
    import asyncio

    from spotdrain.coordinator.core import messages as msg

    fleet = Coordinator(store, insecure=True, clock=clock).fleet
    gpus = ({"index": 0, "uuid": "GPU-1", "name": "H200", "memory_mib": 143771},)
    reg = msg.Registration("node-a", True, "group-a", "aws", gpus)
    await fleet.reports.register(reg, asyncio.Queue())
    first = await store.node("node-a")
    assert first is not None and first.node_group == "group-a"

    upserts = []
    full = store.upsert_node

    async def counted(*args, **kwargs):
        upserts.append(args)
        return await full(*args, **kwargs)

    store.upsert_node = counted  # type: ignore[method-assign]
    clock.now += 30
    await fleet.reports.register(reg, asyncio.Queue())
    assert upserts == []
    again = await store.node("node-a")
    assert again is not None and again.last_seen == clock.now
    assert fleet.nodes.rows["node-a"].last_seen == clock.now

    moved = msg.Registration("node-a", True, "group-b", "aws", gpus)
    await fleet.reports.register(moved, asyncio.Queue())
    assert len(upserts) == 1
    stored = await store.node("node-a")
    assert stored is not None and stored.node_group == "group-b"
    assert fleet.nodes.rows["node-a"].node_group == "group-b"


async def test_a_node_reconnecting_with_no_rental_reads_no_rentals(store, clock):
    """After a coordinator restart every node registers again at once: one with no rental
    booked and none running costs no read of the rentals table (10,000 of those queued on the
    store's threads in the reconnect storm); a node holding a rental is still reconciled."""
    import asyncio

    from spotdrain.coordinator.core import messages as msg

    fleet = Coordinator(store, insecure=True, clock=clock).fleet
    gpus = ({"index": 0, "uuid": "GPU-1", "name": "H200", "memory_mib": 143771},)

    def reg(node: str) -> msg.Registration:
        return msg.Registration(node, False, "g", "aws", gpus)

    for node in ("node-a", "node-b"):
        await fleet.reports.register(reg(node), asyncio.Queue())
    rental = await fleet.rentals.create("node-b", "alice", "img", 1)

    reads = []
    real = store.rental_docs

    async def counted(node_id=None, holding_only=False):
        reads.append(node_id)
        return await real(node_id, holding_only)

    store.rental_docs = counted  # type: ignore[method-assign]
    clock.now += 30
    await fleet.reports.register(reg("node-a"), asyncio.Queue())
    assert reads == []
    queue: asyncio.Queue = asyncio.Queue()
    await fleet.reports.register(reg("node-b"), queue)
    assert reads == ["node-b"]
    sent = [queue.get_nowait() for _ in range(queue.qsize())]
    # Still starting and not running there: its start is sent again.
    assert [c.rental_id for c in sent if isinstance(c, msg.StartRental)] == [rental.rental_id]


# --- a Taint answered from memory ------------------------------------------------------------
# The coordinator knows every drain in progress and every drain lifted lately, so a first
# notice's Taint asks the store nothing before it writes, and a Taint retried after its
# reclamation was lifted (a cancelled notice, a resumed pause) is still recognised as late,
# after a restart too. Only a retry whose deadline is long past, or a node that lifted more
# than memory keeps, reads the store, and gets the same answer.


def counted_reads(store) -> list[tuple[str, str]]:
    """Every `store.drain` lookup the coordinator makes from now on."""
    reads: list[tuple[str, str]] = []
    real = store.drain

    async def drain(node_id, reclaim_id):
        reads.append((node_id, reclaim_id))
        return await real(node_id, reclaim_id)

    store.drain = drain
    return reads


async def started(store, clock) -> Coordinator:
    coord = Coordinator(store, insecure=True, clock=clock)
    await coord.fleet.recovery.rebuild()
    return coord


async def taint(coord, node, reclaim, d, remove=False):
    drains = coord.fleet.drains
    call = drains.lift_taint if remove else drains.taint
    return await call(node, reclaim, "notice", d, d - 10)


async def test_a_first_notice_is_stored_without_a_read_before_it(store, clock):
    """1,000 notices in a second must not queue a thousand reads ahead of their answers: a
    reclamation the coordinator neither drains nor lifted lately is new."""
    coord = await started(store, clock)
    reads = counted_reads(store)
    answer = await taint(coord, "node-a", "r-1", clock.now + 120)
    assert [t.reclaim_id for t in answer.taints] == ["r-1"] and not answer.late
    assert reads == []
    [drain] = await store.active_drains("node-a")
    assert (drain.reclaim_id, drain.terminate_at) == ("r-1", clock.now + 120)
    again = await taint(coord, "node-a", "r-1", clock.now + 120)  # the agent's retry
    assert [t.reclaim_id for t in again.taints] == ["r-1"] and reads == []
    await coord.fleet.close()


async def test_a_taint_retried_after_its_cancel_is_late_from_memory_and_after_a_restart(
    store, clock
):
    """The agent's Taint call was still in flight when the notice was cancelled (or it retries
    after): taking it would taint the node behind the cancel. Known from memory, and from the
    store once the coordinator has restarted; no lookup either way."""
    d = clock.now + 120
    coord = await started(store, clock)
    reads = counted_reads(store)
    await taint(coord, "node-a", "r-1", d)
    await taint(coord, "node-a", "r-1", d, remove=True)
    # A cancel that lands before its own Taint: remembered all the same.
    await taint(coord, "node-a", "r-2", d, remove=True)
    reads.clear()  # a lift reads what it stored; the Taints below must not read
    clock.now += 3
    for reclaim in ("r-1", "r-2"):
        answer = await taint(coord, "node-a", reclaim, d)
        assert answer.late and answer.taints == []
    assert await store.taints("node-a") == [] and await store.active_drains("node-a") == []
    await coord.fleet.close()

    restarted = await started(store, clock)
    answer = await taint(restarted, "node-a", "r-1", d)
    assert answer.late and answer.taints == []
    assert reads == []
    fresh = await taint(restarted, "node-a", "r-3", d)  # a new notice still taints
    assert [t.reclaim_id for t in fresh.taints] == ["r-3"] and reads == []
    await restarted.fleet.close()


async def test_a_retry_older_than_memory_reads_the_store_and_is_still_late(store, clock):
    """Memory keeps a lifted drain until LIFTED_KEEP_S after its deadline; a retry carrying a
    deadline older than that is looked up, and the store still says lifted."""
    d = clock.now + 120
    coord = await started(store, clock)
    reads = counted_reads(store)
    await taint(coord, "node-a", "r-1", d)
    await taint(coord, "node-a", "r-1", d, remove=True)
    reads.clear()
    clock.now = d + LIFTED_KEEP_S + 1
    answer = await taint(coord, "node-a", "r-1", d)
    assert answer.late and answer.taints == []
    assert reads == [("node-a", "r-1")]
    assert coord.fleet.drains.lifted == {}  # forgotten: memory does not grow with history
    await coord.fleet.close()


async def test_a_node_lifting_more_than_memory_keeps_reads_the_store(store, clock):
    """A node that lifts reclamations in a loop cannot grow the coordinator's memory: past
    LIFTED_PER_NODE its Taints are looked up, with the same answers."""
    d = clock.now + 120
    coord = await started(store, clock)
    reads = counted_reads(store)
    for i in range(LIFTED_PER_NODE + 1):
        await taint(coord, "node-a", f"r-{i}", d, remove=True)
    assert len(coord.fleet.drains.lifted["node-a"]) == LIFTED_PER_NODE
    reads.clear()
    late = await taint(coord, "node-a", f"r-{LIFTED_PER_NODE}", d)  # the one not remembered
    assert late.late and reads == [("node-a", f"r-{LIFTED_PER_NODE}")]
    other = await taint(coord, "node-b", "r-0", d)  # other nodes keep their memory
    assert not other.late and len(reads) == 1
    await coord.fleet.close()
