"""The leader lease and the fence on a real PostgreSQL (coordinator/store/postgres.py): two
replicas' stores on one database, the lease's expiry on the database's clock."""

from __future__ import annotations

import asyncio
import time

import pytest

from fakes.pgserver import fresh_database
from spotdrain.coordinator.store import NewEvent, StoreError, open_store
from spotdrain.coordinator.store.backend import Fenced

TTL = 0.5


@pytest.fixture
async def two_stores(postgres, request):
    url = fresh_database(postgres, request.node.name)
    a, b = await open_store(url), await open_store(url)
    yield a, b
    await a.close()
    await b.close()


async def rows(store) -> dict[str, int]:
    out = {}
    for table in ("nodes", "taints", "events", "node_drains", "reclamations"):
        [(n,)] = (await store.backend.read(f"SELECT COUNT(*) FROM {table}")).rows
        out[table] = n
    return out


async def take(store, holder: str, ttl: float = TTL) -> int:
    """The lease for `holder`, waiting out whoever holds it now."""
    deadline = time.monotonic() + 10
    while True:
        taken, term, _, left = await store.backend.acquire_lease(holder, ttl, 2.0)
        if taken:
            store.backend.fence_to(term, holder, ttl)
            return term
        assert time.monotonic() < deadline, "the lease never ran out"
        await asyncio.sleep(max(left, 0.01))


def event(uid: str) -> NewEvent:
    return NewEvent(uid, "notice_received", "node-a", "r-1", time.time(), 0.0, {})


async def test_a_deposed_leaders_every_write_is_refused_by_its_term(two_stores):
    """Replica A leads at term 1 and writes. It stops renewing (hung); its lease runs out by the
    database's clock and B takes term 2. Every kind of write A still attempts (a taint, the
    workload flag, a drain, a batch of events, a single statement) is refused, A is told it was
    deposed, and the store holds exactly what it held before."""
    a, b = two_stores
    deposed: list[str] = []
    a.backend.on_fenced = deposed.append
    term_a = await take(a, "a:1 x")
    await a.set_workload("node-a", True)
    await a.add_events([event("u-1")])
    assert (await rows(a))["events"] == 1

    term_b = await take(b, "b:1 y")
    assert term_b == term_a + 1
    before = await rows(b)
    with pytest.raises(Fenced, match=f"term {term_a} no longer holds the leader lease"):
        await a.add_taint("node-a", "r-1", "notice")
    assert len(deposed) == 1
    attempts = [
        a.set_workload("node-a", False),
        a.start_drain("node-a", "r-1", "notice", time.time() + 100, time.time() + 90),
        a.add_events([event("u-2")]),
        a.add_events([event("u-3")], fresh=True),
        a.touch_node("node-a"),
    ]
    for attempt in attempts:
        with pytest.raises(Fenced):
            await attempt
    assert await rows(b) == before
    assert (await b.node("node-a")).workload_enabled


async def test_a_takeover_waits_for_the_write_in_flight(two_stores):
    """A's transaction has passed the fence when its lease runs out: B's takeover waits for it
    to commit (B's lease session is seen waiting on the lease row's lock), so B's rebuild then
    reads the write A was told succeeded (and nothing of A's lands after B has read the
    store). Ordered by events and the database's own view, never by sleeps."""
    a, b = two_stores
    ttl = 1.0
    term = await take(a, "a:1 x", ttl)
    # PostgreSQL's idle limit (the lease's TTL, for a stopped leader) out of this scenario.
    a.backend.fence_to(term, "a:1 x", 60.0)
    inside, commit = asyncio.Event(), asyncio.Event()

    async def write_in_flight() -> None:
        async with a.transaction():
            await a.set_workload("node-a", False)  # the fence and this, one trip
            inside.set()
            await commit.wait()

    writer = asyncio.create_task(write_in_flight())
    await asyncio.wait_for(inside.wait(), 10)
    deadline = time.monotonic() + 10
    while (await a.backend.lease_holder(2.0))[2] > 0:  # A's lease runs out, by the database
        assert time.monotonic() < deadline, "A's lease never ran out"
        await asyncio.sleep(0.05)
    takeover = asyncio.create_task(b.backend.acquire_lease("b:1 y", ttl, 5.0))
    while not await lock_waiters(a, b.backend.session_name):
        assert time.monotonic() < deadline, "B's takeover never waited for A's transaction"
        assert not takeover.done(), f"B took over with A's write in flight: {takeover.result()}"
        await asyncio.sleep(0.02)
    # Still waiting with A's transaction open. (Which of the two answers the client reads
    # first once A commits is the client's race, not the database's order.)
    assert not takeover.done() and not writer.done()
    commit.set()
    taken, term_b, _, _ = await takeover
    await writer  # committed: a takeover that had ended A's session would have failed it
    assert taken and term_b == term + 1
    assert not (await b.node("node-a")).workload_enabled


async def lock_waiters(store, name: str) -> int:
    """How many database sessions named `name` are waiting for a lock."""
    [(n,)] = (
        await store.backend.read(
            "SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = ? "
            "AND wait_event_type = 'Lock'",
            (name,),
        )
    ).rows
    return n


async def sessions(store, name: str) -> list[tuple[int, str]]:
    """(pid, state) of the database sessions whose application_name is `name`."""
    return (
        await store.backend.read(
            "SELECT pid, state FROM pg_stat_activity WHERE application_name = ? ORDER BY pid",
            (name,),
        )
    ).rows


async def test_a_leader_stopped_inside_a_write_is_ended_by_the_takeover(two_stores):
    """A is stopped (SIGSTOP, a paused VM) inside a pause's transaction: the fence and the
    workload flag went in one pipeline (so PostgreSQL's idle limit is not armed), and the share
    lock it holds on the lease row would hold every takeover for as long as A's sockets live.
    A's lease runs out: B's takeover ends A's session and takes term 2 within a few tries; A's
    transaction never commits, and B, leading, writes."""
    a, b = two_stores
    holder_a, holder_b = a.backend.holder_for("a:1"), b.backend.holder_for("b:1")
    await take(a, holder_a)
    await a.upsert_node("node-a", True, "default", [])
    inside, resume = asyncio.Event(), asyncio.Event()

    async def stopped_write() -> None:
        async with a.transaction():
            assert await a.set_workload("node-a", False)
            inside.set()
            await resume.wait()  # "stopped"

    writer = asyncio.create_task(stopped_write())
    await asyncio.wait_for(inside.wait(), 10)
    [stopped] = [
        pid
        for pid, state in await sessions(b, a.backend.session_name)
        if state == "idle in transaction"
    ]

    tries: list[object] = []
    taken = False
    while not taken and len(tries) < 5:
        try:
            taken, term, _, left = await b.backend.acquire_lease(holder_b, TTL, 1.0)
            tries.append(left)
        except StoreError as e:  # the row stayed locked: no takeover this try
            tries.append(e)
            left = 0.0
        await asyncio.sleep(max(left, 0.05))
    assert taken and term == 2, tries
    assert stopped not in [pid for pid, _ in await sessions(b, a.backend.session_name)]
    resume.set()
    with pytest.raises(StoreError):
        await writer  # its commit: the session is gone, the transaction rolled back
    assert (await b.node("node-a")).workload_enabled

    b.backend.fence_to(term, holder_b, TTL)
    assert await b.set_workload("node-a", False)
    assert not (await b.node("node-a")).workload_enabled


async def test_a_takeover_never_ends_a_live_leaders_sessions(two_stores):
    """A leads with a transaction open; B tries to take the lease while A's is still running:
    B is told A holds it, and A's transaction commits."""
    a, b = two_stores
    await take(a, a.backend.holder_for("a:1"), 5.0)
    async with a.transaction():
        await a.add_events([event("u-1")])
        taken, term, _, left = await b.backend.acquire_lease(b.backend.holder_for("b:1"), 5.0, 1.0)
        assert (taken, term) == (False, 1) and left > 0
    assert [e.uid for e in await b.events_after(0)] == ["u-1"]


async def test_a_follower_refuses_writes_without_asking_the_database_and_still_reads(two_stores):
    a, b = two_stores
    await take(a, "a:1 x")
    await a.add_events([event("u-1")])
    b.backend.fence_off("a follower: not the leader")
    with pytest.raises(Fenced, match="a follower"):
        await b.add_events([event("u-2")])
    with pytest.raises(Fenced):
        await b.set_workload("node-a", False)
    assert [e.uid for e in await b.events_after(0)] == ["u-1"]


async def test_the_lease_is_renewed_only_by_its_holder_at_its_term_and_never_revived(two_stores):
    a, b = two_stores
    term = await take(a, "a:1 x")
    assert await a.backend.renew_lease("a:1 x", term, TTL, 1.0)
    assert not await b.backend.renew_lease("b:1 y", term, TTL, 1.0)  # not its holder
    assert not await a.backend.renew_lease("a:1 x", term + 1, TTL, 1.0)  # not its term
    taken, held_term, holder, left = await b.backend.acquire_lease("b:1 y", TTL, 1.0)
    assert (taken, held_term, holder) == (False, term, "a:1 x") and 0 < left <= TTL
    await asyncio.sleep(TTL + 0.1)
    assert not await a.backend.renew_lease("a:1 x", term, TTL, 1.0)  # ran out: not revived


async def test_the_leaders_own_writes_never_hold_up_its_renewal(two_stores):
    """A fenced write transaction of the leader is open (a long event batch): the renewal of the
    same lease goes through at once, so a busy leader does not depose itself waiting on its
    own writes."""
    a, _b = two_stores
    term = await take(a, "a:1 x", 5.0)
    renewed_while_open = asyncio.Event()
    async with a.transaction():
        await a.set_workload("node-a", False)  # the fence is in this transaction's first trip
        renewed = await asyncio.wait_for(a.backend.renew_lease("a:1 x", term, 5.0, 2.0), 3.0)
        if renewed:
            renewed_while_open.set()
    assert renewed_while_open.is_set()
