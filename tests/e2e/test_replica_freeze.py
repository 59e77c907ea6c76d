"""A leader frozen (SIGSTOP, a paused VM) in the middle of a write: two replica processes on the
real PostgreSQL (as tests/e2e/test_replicas.py runs them). The frozen leader's open transaction
holds a share lock on the lease row; the takeover ends its sessions (coordinator/store/
postgres.py, END_EXPIRED) instead of waiting for it for as long as it stays frozen."""

from __future__ import annotations

import asyncio
import signal

import psycopg
from test_replicas import (  # noqa: F401 (fixtures)
    FAILOVER_S,
    db,
    leading,
    lease_row,
    replicas,
    store_rows,
)

from fakes.fakenode import FakeNode
from fakes.waiting import wait_until
from spotdrain.coordinator.store.pg_conn import EVENTS_LOCK

# The leader's event batch waits for the events lock the test holds: its transaction has passed
# the fence (the share lock on the lease row) and is mid-flight.
WAITING_FOR_EVENTS_LOCK = (
    "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'spotdrain %' "
    "AND wait_event_type = 'Lock' AND wait_event = 'advisory'"
)


async def test_a_leader_frozen_inside_a_write_is_replaced_and_changes_nothing(replicas, db, pki):
    """An agent's event batch reaches the leader A, whose transaction passes the fence and
    waits for the events lock (held by the test), so it is mid-flight when A is SIGSTOPped.
    The lock is let go: A's transaction is left open, idle, holding its share lock on the lease
    row for as long as A stays frozen. Replica B still leads, within a bound, at term 2, having
    ended A's sessions; the event is not stored. SIGCONT: A finds its connections gone, writes
    nothing, steps down and exits non-zero, and its agent stream ends without a second abort."""
    a, b = replicas
    node = FakeNode(a, pki, "node-a")
    holder = psycopg.connect(db, autocommit=True)
    try:
        await node.connect()
        holder.execute("SELECT pg_advisory_lock(%s)", (EVENTS_LOCK,))
        uid = await node.event("notice_received", {"note": "sent as the leader froze"})
        await asyncio.to_thread(  # the loop must run meanwhile: it sends the batch
            wait_until,
            lambda: holder.execute(WAITING_FOR_EVENTS_LOCK).fetchone()[0] > 0,
            10,
            "the leader's event batch to wait inside its transaction",
        )
        a.proc.signal(signal.SIGSTOP)
        holder.execute("SELECT pg_advisory_unlock(%s)", (EVENTS_LOCK,))

        # Without the takeover ending A's sessions, B never leads while A is frozen.
        wait_until(lambda: leading(b), 4 * FAILOVER_S, "replica B to lead", every=0.05)
        assert lease_row(db) == (2, b.address)
        assert "let term 1 run out inside a transaction" in b.proc.log(), b.proc.log()[-3000:]
        before = store_rows(db)
        assert uid not in {row[1] for row in before["events"]}

        a.proc.signal(signal.SIGCONT)
        assert a.proc.popen.wait(30) != 0
        log = a.proc.log()
        assert "stepping down from term 1" in log, log[-3000:]
        assert "Abort already called" not in log, log[-3000:]
        assert store_rows(db) == before
        assert lease_row(db) == (2, b.address)
        assert leading(b)
    finally:
        holder.close()
        await node.close()
