"""The store's contract, one suite for every backend.

Each test below runs once per backend (`store_url` is parametrized over SQLite and PostgreSQL,
tests/conftest.py), through the same `store` fixture: the store is only ever used through its
public interface, so a backend passes exactly when it keeps the same promises. The few tests
that name a backend test what only that backend has (SQLite's old files, PostgreSQL's network).
"""

from __future__ import annotations

import asyncio
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest

from fakes.waiting import eventually
from spotdrain.coordinator.core import timeline
from spotdrain.coordinator.store import (
    SCHEMA_VERSION,
    DrainRow,
    ModelRow,
    NewEvent,
    NodeRow,
    StartBackoff,
    Store,
    StoreError,
    TaintRow,
    backend_for,
    open_store,
    schema,
)
from spotdrain.coordinator.store.backend import PriorityLock
from spotdrain.coordinator.store.postgres import PostgresBackend
from spotdrain.coordinator.store.sqlite import SqliteBackend

T0 = 1_000.0


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


class Stores:
    """Opens stores on one URL and closes whichever are still open at teardown."""

    def __init__(self, url: str, clock: FakeClock) -> None:
        self.url = url
        self.clock = clock
        self.open: list[Store] = []

    async def open_store(self) -> Store:
        store = await open_store(self.url, self.clock)
        self.open.append(store)
        return store

    async def close(self, store: Store) -> None:
        self.open.remove(store)
        await store.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def stores(store_url: str, clock: FakeClock) -> AsyncIterator[Stores]:
    opened = Stores(store_url, clock)
    yield opened
    for store in list(opened.open):
        await opened.close(store)


@pytest.fixture
async def store(stores: Stores) -> Store:
    return await stores.open_store()


def backend_name(store_url: str) -> str:
    return "postgresql" if store_url.startswith("postgresql://") else "sqlite"


def ev(
    uid: str,
    kind: str = "tainted",
    node_id: str = "node-a",
    reclaim_id: str = "rcl-1",
    wall_time: float = 100.0,
    **details: Any,
) -> NewEvent:
    return NewEvent(uid, kind, node_id, reclaim_id, wall_time, wall_time - 100.0, details)


def folded(reclaim_id: str, node_id: str, *events: NewEvent) -> dict[str, Any]:
    """The record timeline.fold makes of these events, as the store should hold it."""
    record = timeline.new_record(reclaim_id, node_id)
    for e in events:
        timeline.fold(record, e.kind, e.wall_time, e.details)
    return record


def notice(uid: str, t0: float, **kw: Any) -> NewEvent:
    return ev(
        uid,
        "notice_received",
        wall_time=t0,
        notice_id="i-1",
        reason="notice",
        source="aws",
        t0=t0,
        terminate_at=t0 + 30.0,
        grace_deadline=t0 + 20.0,
        overrun_at=t0 + 28.0,
        **kw,
    )


def waiting_writers(store: Store) -> int:
    """Transactions queued for the write path."""
    return store.stats().waiting_writers


async def schema_version(store: Store) -> str:
    rows = (await store.backend.read("SELECT value FROM meta WHERE key='schema_version'")).rows
    assert len(rows) == 1
    return rows[0][0]


GPUS = [{"index": 0, "uuid": "GPU-0", "name": "H100"}]


# --- nodes ------------------------------------------------------------------------------------


async def test_a_node_registers_and_reregisters_with_new_claims(store, clock):
    """A node registers, then comes back with another group, GPUs and provider: every claim is
    taken, its registration time kept and its last_seen moved."""
    assert await store.upsert_node("node-a", True, "g1", GPUS, provider="acme") == {}
    assert await store.node("node-a") == NodeRow(
        "node-a", True, "g1", tuple(GPUS), T0, T0, True, "acme", False
    )
    later = clock.advance(60)
    gpus2 = [{"index": 0}, {"index": 1}]
    assert await store.upsert_node("node-a", False, "g2", gpus2, provider="other") == {}
    assert await store.node("node-a") == NodeRow(
        "node-a", False, "g2", tuple(gpus2), T0, later, True, "other", False
    )
    assert await store.node("node-z") is None


SLURM = {"name": "slurm", "node_name": "sd-n1", "cluster": "spotdrain"}
DOCKER = {"name": "docker", "node_name": "", "cluster": ""}


async def test_a_registration_stores_its_work_managers_and_the_next_one_replaces_them(store):
    """A node registers with Docker and Slurm: both are stored and listed with it, Slurm's
    node name and cluster as sent. It comes back with Slurm alone: Docker is gone from it."""
    await store.upsert_node("node-a", True, "g1", GPUS, managers=[DOCKER, SLURM])
    assert (await store.node("node-a")).managers == (DOCKER, SLURM)
    assert [n.managers for n in await store.nodes()] == [(DOCKER, SLURM)]

    await store.upsert_node("node-a", True, "g1", GPUS, managers=[SLURM])
    assert (await store.node("node-a")).managers == (SLURM,)
    await store.upsert_node("node-a", True, "g1", GPUS)
    assert (await store.node("node-a")).managers == ()


AWS = {
    "provider": "aws",
    "instance_id": "i-0123456789abcdef0",
    "region": "us-east-1",
    "zone": "us-east-1a",
    "instance_type": "g5.xlarge",
    "spot": True,
}


async def test_a_nodes_cloud_identity_is_kept_until_another_is_reported(store):
    """A node registers before its metadata service answered: no identity. It registers again
    with one: stored and listed. Its agent restarts and registers before the service answers
    again: the identity read before stays. A new one (the host moved to on-demand) replaces it."""
    await store.upsert_node("node-a", True, "g1", GPUS)
    assert (await store.node("node-a")).cloud is None
    await store.upsert_node("node-a", True, "g1", GPUS, cloud=AWS)
    assert (await store.node("node-a")).cloud == AWS
    assert [n.cloud for n in await store.nodes()] == [AWS]

    await store.upsert_node("node-a", True, "g1", GPUS)
    assert (await store.node("node-a")).cloud == AWS
    on_demand = {**AWS, "spot": False, "instance_type": "p5.48xlarge"}
    await store.upsert_node("node-a", False, "g1", GPUS, cloud=on_demand)
    assert (await store.node("node-a")).cloud == on_demand


async def test_an_operator_pinned_spot_flag_beats_the_agents_claim(store):
    """An operator marks a node on-demand; the agent keeps registering as spot: its claim is
    refused and reported, its other claims are taken."""
    await store.upsert_node("node-a", True, "g1", GPUS)
    await store.set_spot("node-a", False)
    refused = await store.upsert_node("node-a", True, "g2", GPUS, provider="acme")
    assert refused == {"spot": True}
    node = await store.node("node-a")
    assert (node.spot, node.spot_pinned, node.node_group, node.provider) == (
        False,
        True,
        "g2",
        "acme",
    )
    assert await store.upsert_node("node-a", False, "g2", GPUS, provider="acme") == {}


async def test_a_rental_holds_the_nodes_spot_flag_and_provider(store, clock):
    """While a renter holds the node, its spot flag and provider cannot change (the rental's
    terms and reputation depend on them); once the rental lets go, the claims are taken."""
    await store.upsert_node("node-a", False, "g1", GPUS, provider="acme")
    await store.save_rental("r-1", "node-a", None, {"rental_id": "r-1", "started_at": T0})
    refused = await store.upsert_node("node-a", True, "g1", GPUS, provider="other")
    assert refused == {"spot": True, "provider": "other"}
    node = await store.node("node-a")
    assert (node.spot, node.provider) == (False, "acme")

    await store.save_rental("r-1", "node-a", clock.advance(10), {"rental_id": "r-1"})
    assert await store.upsert_node("node-a", True, "g1", GPUS, provider="other") == {}
    node = await store.node("node-a")
    assert (node.spot, node.provider, node.spot_pinned) == (True, "other", False)


async def test_render_jobs_lock_the_spot_flag_but_not_the_provider(store):
    """Render jobs on the node lock its spot flag (spot_locked); its provider can still change."""
    await store.upsert_node("node-a", False, "g1", GPUS, provider="acme")
    refused = await store.upsert_node("node-a", True, "g1", GPUS, "other", spot_locked=True)
    assert refused == {"spot": True}
    node = await store.node("node-a")
    assert (node.spot, node.provider) == (False, "other")


async def test_a_new_node_takes_its_claims_even_when_locked(store):
    """A node seen for the first time has nothing to hold its claims against."""
    assert await store.upsert_node("node-a", True, "g1", GPUS, "acme", spot_locked=True) == {}
    assert (await store.node("node-a")).spot is True


async def test_the_workload_flag_reports_whether_it_changed(store):
    """The coordinator pauses and resumes a node's workload; each call says if it changed."""
    await store.upsert_node("node-a", True, "g1", GPUS)
    assert await store.set_workload("node-a", False) is True
    assert await store.set_workload("node-a", False) is False
    assert (await store.node("node-a")).workload_enabled is False
    assert await store.set_workload("node-a", True) is True
    assert await store.set_workload("node-a", True) is False
    assert (await store.node("node-a")).workload_enabled is True


async def test_a_pause_from_an_unknown_node_creates_it_disabled(store):
    """A node that lost the coordinator at boot pauses before it ever registered: the flag is
    stored anyway, on a placeholder node that its registration fills in later."""
    assert await store.set_workload("node-x", False) is True
    assert await store.nodes() == [NodeRow("node-x", True, "default", (), T0, T0, False, "", False)]
    assert await store.nodes_needing_recovery() == ["node-x"]
    await store.upsert_node("node-x", False, "g1", GPUS)
    assert await store.node("node-x") == NodeRow(
        "node-x", False, "g1", tuple(GPUS), T0, T0, False, "", False
    )


async def test_nodes_are_listed_by_id(store):
    """The fleet listing is in node id order, whatever order nodes registered in."""
    ids = ["node-c", "node-a", "node-b10", "node-b2", "gpu-1"]
    for node_id in ids:
        await store.upsert_node(node_id, True, "g1", GPUS)
    assert [n.node_id for n in await store.nodes()] == sorted(ids)


async def test_a_heartbeat_touches_only_last_seen(store, clock):
    """A heartbeat moves last_seen and nothing else; one from an unknown node creates nothing."""
    await store.upsert_node("node-a", True, "g1", GPUS, provider="acme")
    before = await store.node("node-a")
    later = clock.advance(30)
    await store.touch_node("node-a")
    await store.touch_node("node-unknown")
    after = await store.node("node-a")
    assert after == NodeRow(**{**before.__dict__, "last_seen": later})
    assert [n.node_id for n in await store.nodes()] == ["node-a"]


async def test_nodes_needing_recovery_are_paused_or_draining(store):
    """After a restart the coordinator recovers every node that is paused or still draining,
    and no other."""
    for node_id in ("node-a", "node-b", "node-c", "node-d"):
        await store.upsert_node(node_id, True, "g1", GPUS)
    await store.set_workload("node-c", False)
    await store.start_drain("node-b", "rcl-b", "notice", T0 + 30, T0 + 20)
    await store.start_drain("node-d", "rcl-d", "notice", T0 + 30, T0 + 20)
    await store.end_drain("node-d", "rcl-d")
    assert await store.nodes_needing_recovery() == ["node-b", "node-c"]


# --- drains -----------------------------------------------------------------------------------


async def test_a_drain_keeps_its_first_deadlines(store, clock):
    """The agent repeats its drain after a reconnect with later deadlines: the first ones stay
    (deadlines are never extended), and so does the first start time."""
    first = await store.start_drain("node-a", "rcl-1", "notice", T0 + 30, T0 + 20)
    assert first == DrainRow("node-a", "rcl-1", "notice", T0 + 30, T0 + 20, T0, None)
    clock.advance(5)
    again = await store.start_drain("node-a", "rcl-1", "pause", T0 + 90, T0 + 80)
    assert again == first
    assert await store.drain("node-a", "rcl-1") == first
    assert await store.active_drains() == [first]


async def test_deadlines_come_back_from_the_store_bit_for_bit(store_url, stores):
    """A database whose administrator set extra_float_digits = 0 (PostgreSQL 11's default, or a
    postgresql.conf carried over) prints doubles with 15 significant digits: microseconds off
    at today's epoch. A drain's deadlines, its G equal to its D and a G 2.6 µs before it, still
    read back exactly, in every read and after a restart: they compare as they did before."""
    if backend_name(store_url) == "postgresql":
        with psycopg.connect(store_url, autocommit=True) as db:
            name = db.info.dbname
            db.execute(f'ALTER DATABASE "{name}" SET extra_float_digits = 0')
            probe = db.execute("SELECT 1796237897.9496896::float8").fetchone()[0]
        with psycopg.connect(store_url) as db:  # the setting bites a plain session
            assert db.execute("SELECT 1796237897.9496896::float8").fetchone()[0] != probe
    d = 1796237897.9496896
    store = await stores.open_store()
    even = await store.start_drain("node-a", "rcl-even", "notice", d, d)
    close = await store.start_drain("node-b", "rcl-close", "notice", d, d - 2.6e-6)
    assert (even.grace_deadline, even.terminate_at) == (d, d)
    assert (close.grace_deadline, close.terminate_at) == (d - 2.6e-6, d)
    await stores.close(store)
    again = await stores.open_store()
    assert await again.active_drains() == [even, close]
    assert await again.drain("node-b", "rcl-close") == close


async def test_an_ended_drain_is_no_longer_active(store, clock):
    """A node finishes its drain: it leaves the active list, its end time is the first one, and
    a late repeat of its start does not reopen it."""
    a = await store.start_drain("node-a", "rcl-a", "notice", T0 + 30, T0 + 20)
    clock.advance(1)
    b = await store.start_drain("node-b", "rcl-b", "pause", T0 + 40, T0 + 30)
    clock.advance(1)
    a2 = await store.start_drain("node-a", "rcl-a2", "notice", T0 + 50, T0 + 40)
    assert await store.active_drains() == [a, b, a2]
    assert await store.active_drains("node-a") == [a, a2]
    assert await store.active_drains("node-z") == []

    ended_at = clock.advance(10)
    await store.end_drain("node-a", "rcl-a")
    clock.advance(10)
    await store.end_drain("node-a", "rcl-a")
    ended = DrainRow(*[*a.__dict__.values()][:-1], ended_at)
    assert await store.drain("node-a", "rcl-a") == ended
    assert await store.start_drain("node-a", "rcl-a", "notice", T0 + 99, T0 + 98) == ended
    assert await store.active_drains() == [b, a2]
    assert await store.active_drains("node-a") == [a2]


# --- workers ----------------------------------------------------------------------------------


async def test_workers_are_listed_in_creation_order_and_filtered(store):
    """Workers are listed oldest first (a state change does not move one), by node, by model,
    and without the stopped ones when asked."""
    await store.save_worker("w-3", "node-a", "llama", "running", 30.0, {"id": "w-3", "v": 1})
    await store.save_worker("w-1", "node-b", "llama", "running", 10.0, {"id": "w-1"})
    await store.save_worker("w-2", "node-a", "qwen", "stopped", 10.0, {"id": "w-2"})
    await store.save_worker("w-0", "node-a", "llama", "starting", 20.0, {"id": "w-0"})
    # An update: new state and doc; its creation time stays the first one.
    await store.save_worker("w-3", "node-a", "llama", "stopped", 1.0, {"id": "w-3", "v": 2})

    def ids(docs: list[dict[str, Any]]) -> list[str]:
        return [d["id"] for d in docs]

    docs = await store.worker_docs()
    assert ids(docs) == ["w-1", "w-2", "w-0", "w-3"]
    assert docs[-1] == {"id": "w-3", "v": 2}
    assert ids(await store.worker_docs(node_id="node-a")) == ["w-2", "w-0", "w-3"]
    assert ids(await store.worker_docs(model="llama")) == ["w-1", "w-0", "w-3"]
    assert ids(await store.worker_docs(live_only=True)) == ["w-1", "w-0"]
    assert ids(await store.worker_docs("node-a", "llama", live_only=True)) == ["w-0"]
    assert await store.worker_docs(node_id="node-z") == []


# --- drain state that outlives the process ------------------------------------------------------


async def test_a_paused_worker_is_replaced_once_when_it_stops(store):
    """A paused worker is marked for replacement; its stop takes the mark once (a second stop
    report finds none), and the first doc stored is the one kept."""
    await store.add_replace_on_stop("w-1", {"model": "llama", "v": 1})
    await store.add_replace_on_stop("w-1", {"model": "llama", "v": 2})
    await store.add_replace_on_stop("w-2", {"model": "qwen"})
    assert await store.replace_on_stop() == {
        "w-1": {"model": "llama", "v": 1},
        "w-2": {"model": "qwen"},
    }
    assert await store.pop_replace_on_stop("w-1") == {"model": "llama", "v": 1}
    assert await store.pop_replace_on_stop("w-1") is None
    assert await store.pop_replace_on_stop("w-unknown") is None
    assert await store.replace_on_stop() == {"w-2": {"model": "qwen"}}


async def test_a_models_start_backoff_is_set_replaced_and_cleared(store):
    """A model whose workers keep failing to start backs off; a later failure replaces the
    backoff, a successful start clears it."""
    await store.set_start_backoff("llama", 1, 110.0)
    await store.set_start_backoff("llama", 2, 130.0)
    await store.set_start_backoff("qwen", 1, 120.0)
    assert await store.start_backoffs() == {
        "llama": StartBackoff("llama", 2, 130.0),
        "qwen": StartBackoff("qwen", 1, 120.0),
    }
    await store.clear_start_backoff("llama")
    await store.clear_start_backoff("never-failed")
    assert await store.start_backoffs() == {"qwen": StartBackoff("qwen", 1, 120.0)}


async def test_a_missing_rentals_grace_counts_from_the_first_miss(store):
    """A node comes back without listing a rental, again and again: the grace is counted from
    the first time it was missed; once the rental is accounted for it is dropped."""
    await store.add_missing_rental("r-1", 100.0)
    await store.add_missing_rental("r-1", 160.0)
    await store.add_missing_rental("r-2", 150.0)
    assert await store.missing_rentals() == {"r-1": 100.0, "r-2": 150.0}
    await store.drop_missing_rental("r-1")
    await store.drop_missing_rental("r-unknown")
    assert await store.missing_rentals() == {"r-2": 150.0}


# --- rentals ----------------------------------------------------------------------------------


async def test_rentals_are_listed_oldest_first_and_by_what_they_hold(store, clock):
    """Rentals list by start time; those still holding their node's GPUs count against it;
    an ended rental keeps its place and its latest doc."""
    await store.save_rental("r-b", "node-a", None, {"id": "r-b", "started_at": 200.0})
    await store.save_rental("r-a", "node-a", None, {"id": "r-a", "started_at": 300.0})
    await store.save_rental("r-c", "node-b", None, {"id": "r-c", "started_at": 100.0})
    await store.save_rental("r-d", "node-a", None, {"id": "r-d", "started_at": 200.0})
    assert await store.active_rental_count("node-a") == 3

    ended = {"id": "r-b", "started_at": 200.0, "ended_at": clock.advance(5), "state": "ended"}
    await store.save_rental("r-b", "node-a", ended["ended_at"], ended)

    def ids(docs: list[dict[str, Any]]) -> list[str]:
        return [d["id"] for d in docs]

    assert ids(await store.rental_docs()) == ["r-c", "r-b", "r-d", "r-a"]
    assert ids(await store.rental_docs(node_id="node-a")) == ["r-b", "r-d", "r-a"]
    assert ids(await store.rental_docs(holding_only=True)) == ["r-c", "r-d", "r-a"]
    assert ids(await store.rental_docs("node-a", holding_only=True)) == ["r-d", "r-a"]
    assert await store.rental_doc("r-b") == ended
    assert await store.rental_doc("r-unknown") is None
    assert await store.active_rental_count("node-a") == 2
    assert await store.active_rental_count("node-z") == 0


# --- desired capacity, avoided groups, taints ------------------------------------------------


async def test_desired_capacity_is_set_per_model(store):
    """An operator sets each model's replicas; a second setting replaces the first."""
    assert await store.set_model("qwen", 2, "img/qwen:1", 1) == ModelRow("qwen", 2, "img/qwen:1", 1)
    await store.set_model("llama", 1, "img/llama:1", 2)
    await store.set_model("qwen", 4, "img/qwen:2", 1)
    assert await store.models() == [
        ModelRow("llama", 1, "img/llama:1", 2),
        ModelRow("qwen", 4, "img/qwen:2", 1),
    ]
    assert await store.model("qwen") == ModelRow("qwen", 4, "img/qwen:2", 1)
    assert await store.model("mistral") is None


async def test_an_avoided_group_is_never_shortened(store):
    """Two reclamations in one group: the later window wins, a shorter one never cuts it."""
    assert await store.avoid_group("g1", 500.0) == 500.0
    assert await store.avoid_group("g1", 300.0) == 500.0
    assert await store.avoid_group("g1", 700.0) == 700.0
    assert await store.avoid_group("g2", 400.0) == 400.0
    assert await store.avoided_groups(350.0) == {"g1": 700.0, "g2": 400.0}
    assert await store.avoided_groups(400.0) == {"g1": 700.0}
    assert await store.avoided_groups(700.0) == {}


async def test_a_taint_is_stored_once_with_its_first_time(store, clock):
    """The agent and the coordinator both taint for one reclamation: one taint, its first time;
    lifting it removes only that reclamation's taint."""
    await store.add_taint("node-a", "rcl-1", "notice")
    clock.advance(5)
    await store.add_taint("node-a", "rcl-1", "again")
    t2 = clock.advance(5)
    await store.add_taint("node-b", "rcl-2", "pause")
    t3 = clock.advance(5)
    await store.add_taint("node-a", "rcl-3", "notice")
    key, effect = "spotdrain.io/reclaim", "NoSchedule"
    first = TaintRow("node-a", "rcl-1", key, effect, "notice", T0)
    third = TaintRow("node-a", "rcl-3", key, effect, "notice", t3)
    other = TaintRow("node-b", "rcl-2", key, effect, "pause", t2)
    assert await store.taints("node-a") == [first, third]
    assert await store.all_taints() == {"node-a": [first, third], "node-b": [other]}

    await store.remove_taint("node-a", "rcl-1")
    await store.remove_taint("node-a", "rcl-1")
    assert await store.taints("node-a") == [third]
    assert await store.taints("node-z") == []
    assert await store.all_taints() == {"node-a": [third], "node-b": [other]}


# --- events and reclamations -------------------------------------------------------------------


async def test_an_event_is_stored_once_per_uid_with_growing_ids(store):
    """The agent resends an event after a lost reply: stored once, the repeat says so, ids only
    grow and a consumer resumes after any id."""
    assert await store.last_event_id() == 0
    [first] = await store.add_events(
        [NewEvent("u1", "notice_received", "node-a", "rcl-1", 1.0, 0.0, {})]
    )
    assert await store.add_events(
        [NewEvent("u1", "notice_received", "node-a", "rcl-1", 1.0, 0.0, {})]
    ) == [None]
    [second] = await store.add_events(
        [NewEvent("u2", "tainted", "node-a", "rcl-1", 2.0, 1.0, {"mode": "x"})]
    )
    assert first is not None and second is not None and second > first
    assert [e.uid for e in await store.events_after(0)] == ["u1", "u2"]
    assert [e.uid for e in await store.events_after(first)] == ["u2"]
    assert await store.events_after(second) == []
    assert await store.last_event_id() == second


async def test_a_batch_is_stored_in_order_and_folded_into_its_reclamation(store, clock):
    """An agent's outbox flushes a batch, repeats included, then resends part of it: each new
    event gets the next id, each repeat None, and the reclamation record is the fold of the
    events stored once each."""
    events = [
        notice("e1", 100.0),
        ev("e2", "tainted", wall_time=100.01, mode="local"),
        ev("e1", "notice_received", wall_time=100.0),  # a repeat within the batch
        ev("e3", "sigterm_sent", wall_time=100.02, name="a"),
        ev("e4", "sigterm_sent", wall_time=100.03, name="b"),
    ]
    ids = await store.add_events(events)
    assert ids[2] is None and None not in ids[:2] + ids[3:]
    assert ids[0] < ids[1] < ids[3] < ids[4]
    received = clock.advance(1)
    more = [events[3], ev("e5", "drained", wall_time=104.0, spare_s=26.0)]
    ids2 = await store.add_events(more)
    assert ids2[0] is None and ids2[1] > ids[4]
    assert await store.add_events([]) == []

    stored = [events[0], events[1], events[3], events[4], more[1]]
    rows = await store.events_after(0)
    assert [(r.id, r.uid, r.kind, r.node_id, r.reclaim_id) for r in rows] == [
        (i, e.uid, e.kind, e.node_id, e.reclaim_id)
        for i, e in zip([*ids[:2], *ids[3:], ids2[1]], stored, strict=True)
    ]
    assert [r.received_at for r in rows] == [T0] * 4 + [received]
    assert rows[0].wall_time == 100.0 and rows[0].t_offset_s == 0.0
    assert await store.reclamation("rcl-1") == folded("rcl-1", "node-a", *stored)
    assert (await store.reclamation("rcl-1"))["outcome"] == "drained"
    assert await store.last_event_id() == ids2[1]
    assert [r.uid for r in await store.events_after(0, limit=2)] == ["e1", "e2"]
    assert [r.uid for r in await store.events_after(ids[1], limit=2)] == ["e3", "e4"]


async def test_lost_nodes_not_back_are_read_back_from_their_records(store):
    """Lost records (node_lost, then maybe node_returned) fold into records of kind `lost`; the
    nodes still lost are those whose latest lost record has no node_returned."""

    def lost(uid: str, kind: str, node: str, rid: str, at: float) -> NewEvent:
        return NewEvent(uid, kind, node, rid, at, None, {"since": at - 60})

    await store.add_events(
        [
            lost("a1", "node_lost", "node-a", "lost-node-a-1", 100.0),
            lost("a2", "node_returned", "node-a", "lost-node-a-1", 200.0),
            lost("a3", "node_lost", "node-a", "lost-node-a-2", 300.0),
            lost("b1", "node_lost", "node-b", "lost-node-b-1", 100.0),
            lost("b2", "node_returned", "node-b", "lost-node-b-1", 150.0),
            notice("c1", 100.0),
        ],
        fresh=True,
    )
    assert await store.open_lost_nodes("lost-") == {"node-a": "lost-node-a-2"}
    record = await store.reclamation("lost-node-b-1")
    assert (record["reason"], record["outcome"], record["t0"]) == ("lost", "lost", 40.0)
    assert "node_returned" in record["steps"]


async def test_events_of_a_reclamation_are_in_the_agents_time_order(store):
    """The timeline of one reclamation is in wall-clock order even when its events arrived out
    of order, and leaves out other reclamations."""
    await store.add_events([ev("late", "drained", wall_time=104.0)])
    await store.add_events([notice("early", 100.0), ev("other", reclaim_id="rcl-2")])
    assert [e.uid for e in await store.events_of("rcl-1")] == ["early", "late"]
    assert [e.uid for e in await store.events_of("rcl-2")] == ["other"]
    assert await store.events_of("rcl-none") == []


async def test_a_node_cannot_change_another_nodes_reclamation(store):
    """A node sends an event carrying another node's reclaim id (a bug or a forgery): the event
    is kept, but the other node's record does not change, in a later batch or the same one."""
    own = [notice("a1", 100.0), ev("a2", "tainted", wall_time=101.0, mode="local")]
    await store.add_events(own)
    before = await store.reclamation("rcl-1")
    assert before == folded("rcl-1", "node-a", *own)
    foreign = [
        ev("b1", "drained", node_id="node-b", wall_time=102.0, spare_s=1.0),
        ev("b2", "notice_received", node_id="node-b", wall_time=90.0, t0=90.0, reason="x"),
    ]
    ids = await store.add_events(foreign)
    assert None not in ids
    assert await store.reclamation("rcl-1") == before

    same_batch = [
        notice("c1", 200.0, reclaim_id="rcl-9"),
        ev("c2", "overrun", node_id="node-b", reclaim_id="rcl-9", wall_time=201.0),
    ]
    await store.add_events(same_batch)
    assert await store.reclamation("rcl-9") == folded("rcl-9", "node-a", same_batch[0])


async def test_events_of_many_reclamations_read_their_records_in_one_trip(store):
    """A mass reclamation's coordinator events (a replacement request for each of a thousand
    notices) fold into a hundred records a transaction: each record is read once, all in one
    statement, not one trip each while the transaction holds the writer ahead of the Taints.
    The records come out as if folded one by one, the fresh and the agent's path alike."""
    ids = [f"rcl-{i:03d}" for i in range(60)]
    await store.add_events([notice(f"n-{r}", 100.0, reclaim_id=r) for r in ids[:30]])
    # add_events reads nothing but the records it folds into: each read is one statement.
    reads = store.stats().reads
    fresh = [ev(f"f-{r}", "replacement_requested", reclaim_id=r, wall_time=101.0) for r in ids]
    await store.add_events(fresh, fresh=True)
    assert store.stats().reads == reads + 1
    reads = store.stats().reads
    agent = [ev(f"a-{r}", "tainted", reclaim_id=r, wall_time=100.5, mode="remote") for r in ids]
    await store.add_events(agent)
    assert store.stats().reads == reads + 1
    for i, r in enumerate(ids):
        first = [notice(f"n-{r}", 100.0, reclaim_id=r)] if i < 30 else []
        stored = [*first, *(e for e in (*fresh, *agent) if e.reclaim_id == r)]
        assert await store.reclamation(r) == folded(r, "node-a", *stored)
    found = await store.reclamations([*ids[28:32], "rcl-none"])
    assert sorted(found) == ids[28:32]
    assert found[ids[28]] == await store.reclamation(ids[28])


async def test_the_empty_reclaim_id_means_the_latest_reclamation(store):
    """`spotctl reclamation` without an id shows the reclamation that started last, whatever
    order the events arrived in."""
    assert await store.reclamation("") is None
    new = notice("n1", 200.0, reclaim_id="rcl-new")
    old = notice("o1", 100.0, reclaim_id="rcl-old")
    await store.add_events([new])
    await store.add_events([old])
    assert await store.reclamation("") == folded("rcl-new", "node-a", new)
    assert await store.reclamation("rcl-old") == folded("rcl-old", "node-a", old)
    assert await store.reclamation("rcl-unknown") is None


# --- transactions -------------------------------------------------------------------------------


async def test_a_transaction_that_fails_halfway_leaves_nothing(store):
    """A handler registers a node and stores an event, then fails: neither is kept, and inside
    the transaction its own writes were visible."""
    with pytest.raises(RuntimeError, match="handler failed"):
        async with store.transaction():
            await store.upsert_node("node-a", True, "g1", GPUS)
            await store.add_events([notice("e1", 100.0)])
            assert (await store.node("node-a")).node_id == "node-a"
            assert [e.uid for e in await store.events_after(0)] == ["e1"]
            raise RuntimeError("handler failed")
    assert await store.nodes() == []
    assert await store.events_after(0) == []
    assert await store.last_event_id() == 0
    assert await store.reclamation("rcl-1") is None


async def test_nested_transactions_join_the_outer_one(store):
    """A query that opens its own transaction, called inside a handler's, is part of the
    handler's: the outer failure undoes it; the outer success commits both."""
    with pytest.raises(RuntimeError):
        async with store.transaction():
            await store.upsert_node("node-a", True, "g1", GPUS)  # its own transaction() inside
            async with store.transaction(priority=True):
                await store.add_taint("node-a", "rcl-1", "notice")
            raise RuntimeError("outer fails after the inner block ended")
    assert await store.nodes() == []
    assert await store.all_taints() == {}

    async with store.transaction():
        await store.upsert_node("node-a", True, "g1", GPUS)
        async with store.transaction():
            await store.add_taint("node-a", "rcl-1", "notice")
    assert [n.node_id for n in await store.nodes()] == ["node-a"]
    assert list(await store.all_taints()) == ["node-a"]


async def test_a_task_spawned_in_a_transaction_writes_on_its_own(store):
    """A handler spawns a background task inside its transaction and then fails: the task's
    write is its own transaction and survives the handler's rollback."""
    started = asyncio.Event()

    async def background() -> None:
        started.set()
        await store.upsert_node("node-bg", True, "g1", GPUS)

    with pytest.raises(RuntimeError):
        async with store.transaction():
            await store.upsert_node("node-a", True, "g1", GPUS)
            task = asyncio.create_task(background())
            await started.wait()
            for _ in range(5):
                await asyncio.sleep(0)  # let the task get to its write
            raise RuntimeError("handler failed")
    async with asyncio.timeout(10):
        await task
    assert [n.node_id for n in await store.nodes()] == ["node-bg"]


class EventReader:
    """A consumer of the event log as WatchEvents is one: it resumes after the last id it saw,
    one read at a time."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.seen: list[int] = []
        self._cursor = asyncio.Lock()

    async def catch_up(self) -> None:
        async with self._cursor:
            after = self.seen[-1] if self.seen else 0
            while rows := await self.store.events_after(after):
                self.seen.extend(r.id for r in rows)
                after = rows[-1].id


async def test_concurrent_writers_all_land_and_a_consumer_never_skips(store):
    """Twenty agents flush event batches and re-register at once: every event lands once, ids
    are unique, and a consumer resuming after the last id it saw misses none."""
    reader = EventReader(store)
    seen, consume = reader.seen, reader.catch_up

    async def agent(n: int) -> list[int | None]:
        node_id, ids = f"node-{n:02d}", []
        for b in range(5):
            batch = [
                ev(f"{node_id}-{b}-{i}", "sigterm_sent", node_id, f"rcl-{n:02d}", 100.0 + b + i)
                for i in range(10)
            ]
            ids += await store.add_events(batch)
            await store.upsert_node(node_id, True, "g1", [{"index": b}])
            await consume()
        return ids

    results = await asyncio.gather(*(agent(n) for n in range(20)))
    await consume()
    all_ids = [i for ids in results for i in ids]
    assert None not in all_ids and len(set(all_ids)) == 1000
    for ids in results:
        assert ids == sorted(ids)
    assert seen == sorted(all_ids)
    assert await store.last_event_id() == max(all_ids)
    nodes = await store.nodes()
    assert [(n.node_id, n.gpus) for n in nodes] == [
        (f"node-{n:02d}", ({"index": 4},)) for n in range(20)
    ]
    record = await store.reclamation("rcl-07")
    assert record["steps"] == {"sigterm_sent": 100.0, "last_sigterm_sent": 113.0}


async def test_a_taint_overtakes_queued_event_batches(store):
    """An event storm holds every write slot and has more batches queued: a Taint that comes
    now is stored before every batch that was waiting when it came."""
    gate = asyncio.Event()
    entered: list[str] = []
    committed: list[str] = []
    names = [f"batch-{i}" for i in range(12)]

    async def batch(name: str) -> None:
        async with store.transaction():
            await store.node("node-a")  # a read in the transaction: it holds the write path
            entered.append(name)
            await gate.wait()
        committed.append(name)

    async def taint() -> None:
        async with store.transaction(priority=True):
            await store.add_taint("node-a", "rcl-1", "notice")
        committed.append("taint")

    batches = [asyncio.create_task(batch(name)) for name in names]
    await eventually(lambda: len(entered) + waiting_writers(store) == len(names))
    queued = set(names) - set(entered)
    assert queued
    task = asyncio.create_task(taint())
    await eventually(lambda: "taint" in committed or waiting_writers(store) == len(queued) + 1)
    gate.set()
    async with asyncio.timeout(20):
        await asyncio.gather(task, *batches)
    assert sorted(committed) == sorted([*names, "taint"])
    assert committed.index("taint") < min(committed.index(name) for name in queued)
    assert [t.reclaim_id for t in await store.taints("node-a")] == ["rcl-1"]


def group_trips(store: Store) -> int:
    """Commits made for blind transactions."""
    return sum(store.stats().group_commits.values())


def refuse_taints_for(store_url: str, node_id: str) -> None:
    """The database itself refuses every taint of one node (a trigger, as a damaged or
    hand-edited database might): a write the store only learns of at commit."""
    if backend_name(store_url) == "sqlite":
        db = sqlite3.connect(store_url)
        db.execute(
            f"CREATE TRIGGER refuse_{node_id.replace('-', '_')} BEFORE INSERT ON taints "
            f"WHEN NEW.node_id = '{node_id}' BEGIN SELECT RAISE(ABORT, 'refused'); END"
        )
        db.commit()
        db.close()
        return
    with psycopg.connect(store_url, autocommit=True) as db:
        db.execute(
            "CREATE FUNCTION refuse_taint() RETURNS trigger LANGUAGE plpgsql AS "
            f"$$BEGIN IF NEW.node_id = '{node_id}' THEN RAISE EXCEPTION 'refused'; END IF; "
            "RETURN NEW; END$$"
        )
        db.execute(
            "CREATE TRIGGER refuse_taint BEFORE INSERT ON taints "
            "FOR EACH ROW EXECUTE FUNCTION refuse_taint()"
        )


async def test_blind_transactions_commit_together_and_a_refused_one_alone(store, store_url):
    """Thirty handlers that only write (a Taint's kind of transaction) end at the same moment,
    one of them with a write the database refuses: that one alone is told and leaves nothing,
    the others are all stored, in fewer commits than transactions."""
    refuse_taints_for(store_url, "node-17")

    async def handler(n: int) -> None:
        async with store.transaction(priority=n % 2 == 0):
            await store.add_taint(f"node-{n:02d}", f"rcl-{n}", "notice")

    trips = group_trips(store)
    results = await asyncio.gather(*(handler(n) for n in range(30)), return_exceptions=True)
    assert [n for n, r in enumerate(results) if r is not None] == [17]
    assert isinstance(results[17], StoreError)
    assert sorted(await store.all_taints()) == [f"node-{n:02d}" for n in range(30) if n != 17]
    assert await schema_version(store) == str(SCHEMA_VERSION)
    assert group_trips(store) - trips < 30


async def test_the_coordinators_own_events_committed_together_keep_their_order(store):
    """The coordinator's own events (no id awaited: committed in groups) and agents' batches
    (ids returned) stored at once: every id is unique and a consumer that resumes after the
    last id it saw misses none."""
    reader = EventReader(store)
    seen, consume = reader.seen, reader.catch_up

    async def own(n: int) -> None:
        for i in range(5):
            await store.add_events([ev(f"own-{n}-{i}", "worker_ready", reclaim_id="")], fresh=True)
            await consume()

    async def agent(n: int) -> None:
        for i in range(5):
            await store.add_events([ev(f"agent-{n}-{i}", "sigterm_sent", reclaim_id=f"r{n}")])
            await consume()

    await asyncio.gather(*(own(n) for n in range(10)), *(agent(n) for n in range(10)))
    await consume()
    assert len(seen) == len(set(seen)) == 100
    assert seen == sorted(seen)
    stored = {e.uid for e in await store.events_after(0, limit=1000)}
    assert stored == {
        f"{who}-{n}-{i}" for who in ("own", "agent") for n in range(10) for i in range(5)
    }


# --- PriorityLock itself --------------------------------------------------------------------


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_priority_waiters_go_first_each_class_in_order():
    """With the lock held, two bulk writers then two critical ones queue: the critical ones
    get it first, each class in arrival order."""
    lock, order = PriorityLock(), []
    await lock.acquire()

    async def take(name: str, priority: bool) -> None:
        await lock.acquire(priority)
        order.append(name)
        lock.release()

    tasks = [
        asyncio.create_task(take(name, prio))
        for name, prio in [("n1", False), ("p1", True), ("n2", False), ("p2", True)]
    ]
    await settle()
    assert order == []
    lock.release()
    async with asyncio.timeout(5):
        await asyncio.gather(*tasks)
    assert order == ["p1", "p2", "n1", "n2"]
    async with asyncio.timeout(1):
        await lock.acquire()  # free again
    lock.release()


async def test_a_cancelled_waiter_leaves_the_queue():
    """A writer gives up while waiting (its RPC was cancelled): the lock goes to the next."""
    lock, order = PriorityLock(), []
    await lock.acquire()

    async def take(name: str, priority: bool = False) -> None:
        await lock.acquire(priority)
        order.append(name)
        lock.release()

    gone, critical, bulk = (
        asyncio.create_task(take("gone", True)),
        asyncio.create_task(take("critical", True)),
        asyncio.create_task(take("bulk")),
    )
    await settle()
    gone.cancel()
    await settle()
    lock.release()
    async with asyncio.timeout(5):
        results = await asyncio.gather(gone, critical, bulk, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert order == ["critical", "bulk"]


async def test_a_waiter_cancelled_as_it_is_handed_the_lock_passes_it_on():
    """The lock is handed to a waiter whose task is cancelled before it runs: it passes the
    lock on instead of keeping it forever."""
    lock, order = PriorityLock(), []
    await lock.acquire()

    async def take(name: str) -> None:
        await lock.acquire()
        order.append(name)
        lock.release()

    first, second = asyncio.create_task(take("first")), asyncio.create_task(take("second"))
    await settle()
    lock.release()  # hands the lock to `first`...
    first.cancel()  # ...whose task is cancelled before it resumes
    async with asyncio.timeout(5):
        results = await asyncio.gather(first, second, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert order == ["second"]
    async with asyncio.timeout(1):
        await lock.acquire()
    lock.release()


# --- schema -------------------------------------------------------------------------------------


async def test_a_new_database_is_at_the_current_schema_version(store):
    """A coordinator's first start creates the schema at this code's version."""
    assert await schema_version(store) == str(SCHEMA_VERSION)


async def test_reopening_a_database_keeps_its_data(stores, store, clock):
    """The coordinator restarts: the same database opens at the same version with its data."""
    await store.upsert_node("node-a", True, "g1", GPUS)
    [event_id] = await store.add_events(
        [NewEvent("u1", "notice_received", "node-a", "rcl-1", 1.0, 0.0, {})]
    )
    await store.save_worker("w-1", "node-a", "llama", "running", 1.0, {"id": "w-1"})
    await stores.close(store)

    again = await stores.open_store()
    assert await schema_version(again) == str(SCHEMA_VERSION)
    assert [n.node_id for n in await again.nodes()] == ["node-a"]
    assert [e.id for e in await again.events_after(0)] == [event_id]
    assert await again.worker_docs() == [{"id": "w-1"}]
    [later] = await again.add_events([NewEvent("u2", "tainted", "node-a", "rcl-1", 2.0, 1.0, {})])
    assert later > event_id


async def test_a_database_from_newer_code_is_refused(stores, store):
    """After a rollback of the coordinator, the database written by the newer version is
    refused with one line naming its version, and nothing is touched."""
    newer = SCHEMA_VERSION + 1
    async with store.backend.transaction() as conn:
        await conn.execute(f"UPDATE meta SET value='{newer}' WHERE key='schema_version'")
    await stores.close(store)
    with pytest.raises(StoreError) as refused:
        await stores.open_store()
    message = str(refused.value)
    assert "\n" not in message
    assert f"schema version {newer}" in message and str(SCHEMA_VERSION) in message


async def test_a_refused_database_leaves_nothing_running(stores, store):
    """A refused open leaves no thread or connection behind (a supervisor may retry it)."""
    async with store.backend.transaction() as conn:
        await conn.execute(
            f"UPDATE meta SET value='{SCHEMA_VERSION + 1}' WHERE key='schema_version'"
        )
    await stores.close(store)

    def store_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("store-")]

    before = store_threads()
    with pytest.raises(StoreError):
        await stores.open_store()
    assert store_threads() == before


def run_statements(store_url: str, statements: list[str]) -> None:
    """Runs SQL with the plain driver, as the old code's migrations did."""
    if backend_name(store_url) == "sqlite":
        db = sqlite3.connect(store_url, isolation_level=None)
        try:
            for sql in statements:
                db.execute(sql)
        finally:
            db.close()
    else:
        with psycopg.connect(store_url, autocommit=True) as conn:
            for sql in statements:
                conn.execute(sql)


async def test_a_version_3_database_migrates_with_its_order_backfilled(store_url, stores):
    """A database written by the previous release (schema 3) opens at 4: its workers and
    rentals are listed in the order they were created and started, read from their docs."""
    words = schema.SQLITE_WORDS if backend_name(store_url) == "sqlite" else schema.POSTGRES_WORDS
    old = [sql for reached, step in schema.steps_from(0, words) if reached <= 3 for sql in step]
    old += [
        "INSERT INTO workers (worker_id, node_id, model, state, doc_json) VALUES "
        """('w-1', 'node-a', 'llama', 'running', '{"id": "w-1", "created_at": 20.0}')""",
        "INSERT INTO workers (worker_id, node_id, model, state, doc_json) VALUES "
        """('w-2', 'node-a', 'llama', 'running', '{"id": "w-2", "created_at": 10.0}')""",
        "INSERT INTO workers (worker_id, node_id, model, state, doc_json) VALUES "
        """('w-3', 'node-a', 'llama', 'running', '{"id": "w-3"}')""",
        "INSERT INTO rentals (rental_id, node_id, ended_at, doc_json) VALUES "
        """('r-1', 'node-a', NULL, '{"id": "r-1", "started_at": 300.0}')""",
        "INSERT INTO rentals (rental_id, node_id, ended_at, doc_json) VALUES "
        """('r-2', 'node-a', NULL, '{"id": "r-2", "started_at": 200.0}')""",
    ]
    run_statements(store_url, old)

    store = await stores.open_store()
    assert await schema_version(store) == str(SCHEMA_VERSION)
    assert [d["id"] for d in await store.worker_docs()] == ["w-3", "w-2", "w-1"]
    assert [d["id"] for d in await store.rental_docs()] == ["r-2", "r-1"]
    assert await store.active_rental_count("node-a") == 2
    # The new tables are there too.
    await store.add_replace_on_stop("w-1", {"id": "w-1"})
    assert await store.replace_on_stop() == {"w-1": {"id": "w-1"}}


async def test_a_version_7_database_migrates_its_nodes_with_no_work_managers(store_url, stores):
    """A database written by the release before work managers (schema 7): its nodes open with
    an empty list, and their next registration stores one."""
    words = schema.SQLITE_WORDS if backend_name(store_url) == "sqlite" else schema.POSTGRES_WORDS
    old = [sql for reached, step in schema.steps_from(0, words) if reached <= 7 for sql in step]
    old.append(
        "INSERT INTO nodes (node_id, spot, node_group, gpus_json, registered_at, last_seen, "
        "provider) VALUES ('node-a', 1, 'g1', '[]', 10.0, 20.0, 'acme')"
    )
    run_statements(store_url, old)

    store = await stores.open_store()
    assert await schema_version(store) == str(SCHEMA_VERSION)
    assert await store.nodes() == [
        NodeRow("node-a", True, "g1", (), 10.0, 20.0, True, "acme", False, ())
    ]
    await store.upsert_node("node-a", True, "g1", [], provider="acme", managers=[SLURM])
    assert (await store.node("node-a")).managers == (SLURM,)


async def test_a_version_8_database_migrates_its_nodes_with_no_cloud_identity(store_url, stores):
    """A database written by the release before cloud identities (schema 8): its node opens at 9
    with none (and its work managers as they were), and its next registration carrying one
    stores it."""
    words = schema.SQLITE_WORDS if backend_name(store_url) == "sqlite" else schema.POSTGRES_WORDS
    old = [sql for reached, step in schema.steps_from(0, words) if reached <= 8 for sql in step]
    old.append(
        "INSERT INTO nodes (node_id, spot, node_group, gpus_json, registered_at, last_seen, "
        """provider, managers_json) VALUES ('node-a', 1, 'g1', '[]', 10.0, 20.0, 'acme', """
        """'[{"name": "slurm", "node_name": "sd-n1", "cluster": "spotdrain"}]')"""
    )
    run_statements(store_url, old)

    store = await stores.open_store()
    assert await schema_version(store) == str(SCHEMA_VERSION) == "9"
    assert await store.nodes() == [
        NodeRow("node-a", True, "g1", (), 10.0, 20.0, True, "acme", False, (SLURM,), None)
    ]
    await store.upsert_node("node-a", True, "g1", [], provider="acme", managers=[SLURM], cloud=AWS)
    assert (await store.node("node-a")).cloud == AWS


async def test_backend_for_reads_the_db_flag(tmp_path):
    """`--db` takes a file path, sqlite:///PATH or a PostgreSQL URL, and refuses the rest."""
    path = str(tmp_path / "c.sqlite")
    plain, prefixed = backend_for(path), backend_for(f"sqlite://{path}")
    pg = backend_for("postgresql://spot:pw@db.example:5432/spotdrain")
    pg_short = backend_for("postgres://db.example/spotdrain")
    try:
        assert (type(plain), plain.path) == (SqliteBackend, path)
        assert (type(prefixed), prefixed.path) == (SqliteBackend, path)
        assert type(pg) is PostgresBackend and type(pg_short) is PostgresBackend
        assert "pw" not in pg.where
    finally:
        for backend in (plain, prefixed, pg, pg_short):
            await backend.close()
    for bad in ("mysql://db/spotdrain", "sqlite://relative.db", ""):
        with pytest.raises(StoreError):
            backend_for(bad)


# --- SQLite only --------------------------------------------------------------------------------


async def test_sqlite_a_taints_blind_writes_go_before_queued_bulk_ones(tmp_path, clock):
    """The writer is busy; forty blind bulk transactions (workers' new states) wait for it in
    one trip; a Taint's blind transaction comes after them. It commits first, in a trip of its
    own: the critical path's writes never ride in, or wait for, a trip of bulk ones."""
    store = await open_store(str(tmp_path / "c.sqlite"), clock)
    gate, holding = asyncio.Event(), asyncio.Event()
    committed: list[str] = []

    async def busy_writer() -> None:
        async with store.transaction():
            await store.node("node-a")  # a read in the transaction: it holds the writer
            holding.set()
            await gate.wait()

    async def bulk(n: int) -> None:
        worker = f"w-{n:02d}"
        await store.save_worker(worker, "node-b", "m", "ready", 1.0, {"worker_id": worker})
        committed.append(f"bulk-{n}")

    async def taint() -> None:
        async with store.transaction(priority=True):
            await store.add_taint("node-a", "rcl-1", "notice")
        committed.append("taint")

    try:
        holder = asyncio.create_task(busy_writer())
        await holding.wait()
        bulks = [asyncio.create_task(bulk(n)) for n in range(40)]
        await eventually(lambda: waiting_writers(store) == 1)  # the bulk groups' trip, queued
        critical = asyncio.create_task(taint())
        await eventually(lambda: waiting_writers(store) == 2)
        gate.set()
        async with asyncio.timeout(20):
            await asyncio.gather(holder, critical, *bulks)
        assert committed[0] == "taint" and len(committed) == 41
        assert store.stats().group_commits["critical"] == 1
    finally:
        await store.close()


async def test_sqlite_a_write_cancelled_while_the_file_is_locked_leaves_the_store_usable(
    tmp_path, clock
):
    """Another process (a backup, the sqlite3 shell) holds the file's write lock while a Taint
    RPC's transaction is cancelled by its client: once the lock is free, the store still takes
    writes, and the cancelled transaction landed whole or not at all (its trip to the writer
    thread was already on its way; nothing is left half done or open)."""
    path = str(tmp_path / "c.sqlite")
    store = await open_store(path, clock)
    other = sqlite3.connect(path, isolation_level=None)

    async def taint_and_drain() -> None:
        async with store.transaction(priority=True):
            await store.add_taint("node-a", "rcl-1", "notice")
            await store.start_drain("node-a", "rcl-1", "notice", 1120.0, 1110.0)

    try:
        other.execute("BEGIN IMMEDIATE")
        task = asyncio.create_task(taint_and_drain())
        # A later writer queues behind the Taint's transaction, which took the writer in its
        # first step (tasks start in order) and handed BEGIN to the writer thread (there it
        # waits up to busy_timeout, 5 s): once it is seen waiting, the cancel comes after.
        later = asyncio.create_task(
            store.save_worker("w-1", "node-b", "m", "ready", 1.0, {"worker_id": "w-1"})
        )
        await eventually(lambda: waiting_writers(store) == 1, "the later writer queued")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        other.execute("COMMIT")
        async with asyncio.timeout(10):
            await later
            await store.add_taint("node-a", "rcl-2", "notice")
            taints = [t.reclaim_id for t in await store.taints("node-a")]
            drains = [d.reclaim_id for d in await store.active_drains("node-a")]
        assert taints in (["rcl-2"], ["rcl-1", "rcl-2"])
        assert drains == (["rcl-1"] if "rcl-1" in taints else [])
    finally:
        other.close()
        await store.close()


# --- PostgreSQL only ----------------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_postgres_unreachable_fails_open_in_bounded_time(clock):
    """The coordinator starts while its database is down: open fails with a StoreError naming
    the database, without its password, within seconds instead of hanging."""
    url = f"postgresql://spot:s3cret@127.0.0.1:{closed_port()}/spotdrain"
    started = time.monotonic()
    with pytest.raises(StoreError) as failed:
        async with asyncio.timeout(30):
            await open_store(url, clock)
    assert time.monotonic() - started < 20
    message = str(failed.value)
    assert "127.0.0.1" in message and "s3cret" not in message


async def test_postgres_critical_path_fails_fast_until_its_own_pool_is_back(postgres, clock):
    """The primary died (Patroni is promoting the standby). Every call found no database, so
    each waits only DOWN_WAIT_S for a connection. Then the bulk pool reconnects first (an
    agent's outbox flushes): a Taint must still fail fast, not wait the critical pool's whole
    connect timeout past the agent's 800 ms, until a call on the critical pool gets through."""
    from psycopg_pool import PoolTimeout

    from spotdrain.coordinator.store.postgres import DOWN_WAIT_S

    name = f"down_{uuid.uuid4().hex[:8]}"
    store = await open_store(postgres.create_database(name), clock)
    backend = store.backend
    assert isinstance(backend, PostgresBackend)
    waits: list[tuple[str, float | None]] = []
    pools = {backend._bulk: "bulk", backend._critical: "critical"}
    real = {pool: pool.connection for pool in pools}
    gone = set(pools)

    def watched(pool):
        def connection(timeout=None):
            waits.append((pools[pool], timeout))
            if pool in gone:
                raise PoolTimeout("no database")
            return real[pool](timeout)

        return connection

    try:
        for pool in pools:
            pool.connection = watched(pool)
        with pytest.raises(StoreError):
            await store.add_taint("node-a", "rcl-1", "notice")  # the critical path
        with pytest.raises(StoreError):
            await store.nodes()
        gone.discard(backend._bulk)  # the bulk pool is back first
        assert await store.nodes() == []
        waits.clear()
        with pytest.raises(StoreError):
            async with store.transaction(priority=True):
                await store.add_taint("node-a", "rcl-1", "notice")
        assert waits == [("critical", DOWN_WAIT_S)]
        gone.clear()  # and now the critical pool too
        async with store.transaction(priority=True):
            await store.add_taint("node-a", "rcl-1", "notice")
        waits.clear()
        async with store.transaction(priority=True):
            await store.add_taint("node-a", "rcl-2", "notice")
        assert waits == [("critical", None)]  # back to the pool's own timeout
        assert [t.reclaim_id for t in await store.taints("node-a")] == ["rcl-1", "rcl-2"]
    finally:
        for pool, connection in real.items():
            pool.connection = connection
        await store.close()
        postgres.drop_database(name)


@pytest.fixture
def en_us_database(postgres) -> Iterator[str]:
    """A database as a fleet's cluster usually has it: a natural-language collation (en-US),
    not the C locale the test server was initialised with."""
    name = f"en_us_{uuid.uuid4().hex[:8]}"
    with postgres.connect(autocommit=True) as conn:
        conn.execute(
            f"CREATE DATABASE {name} TEMPLATE template0 LOCALE_PROVIDER icu "
            "ICU_LOCALE 'en-US' LOCALE 'C'"
        )
    yield postgres.url(name)
    postgres.drop_database(name)


async def test_postgres_listings_keep_their_order_under_a_natural_collation(en_us_database, clock):
    """On a cluster created with an en-US locale, node and model listings come in the same
    order as on SQLite (and as nodes_needing_recovery's): by the ids' characters."""
    store = await open_store(en_us_database, clock)
    try:
        ids = ["node-b", "Node-a", "node_c", "node-10", "node-9", "nodeA"]
        for node_id in ids:
            await store.upsert_node(node_id, True, "g1", GPUS)
            await store.set_model(node_id, 1, "img", 1)
            await store.set_workload(node_id, False)
        assert [n.node_id for n in await store.nodes()] == sorted(ids)
        assert [m.model for m in await store.models()] == sorted(ids)
        assert await store.nodes_needing_recovery() == sorted(ids)
    finally:
        await store.close()


async def test_what_waits_for_the_commit_runs_after_it_and_never_after_a_rollback(store):
    """A command to an agent (start this worker) is sent only once what led to it is stored:
    after the commit, and not at all when the transaction rolls back."""
    ran: list[str] = []
    async with store.transaction():
        await store.add_taint("node-a", "rcl-1", "notice")
        store.after_commit(lambda: ran.append("sent"))
        assert ran == []
    assert ran == ["sent"]
    with pytest.raises(RuntimeError):
        async with store.transaction():
            store.after_commit(lambda: ran.append("never"))
            raise RuntimeError("halfway")
    store.after_commit(lambda: ran.append("now"))  # outside a transaction: at once
    assert ran == ["sent", "now"]


async def test_what_a_rollback_undoes_runs_on_it_in_reverse_and_never_after_a_commit(
    store, store_url
):
    """Memory a transaction changed before its commit (a drain it started) is put back when it
    rolls back, the last change first, whether the body or the commit failed; a commit keeps
    it, and outside a transaction there is nothing to undo."""
    undone: list[str] = []
    async with store.transaction():
        await store.add_taint("node-a", "rcl-1", "notice")
        store.on_rollback(lambda: undone.append("kept"))
    with pytest.raises(RuntimeError):
        async with store.transaction():
            await store.add_taint("node-a", "rcl-2", "notice")
            store.on_rollback(lambda: undone.append("first"))
            store.on_rollback(lambda: undone.append("second"))
            raise RuntimeError("halfway")
    refuse_taints_for(store_url, "node-refused")
    with pytest.raises(StoreError):
        async with store.transaction():
            await store.add_taint("node-refused", "rcl-3", "notice")  # refused at commit
            store.on_rollback(lambda: undone.append("refused at commit"))
    store.on_rollback(lambda: undone.append("never"))
    assert undone == ["second", "first", "refused at commit"]
    assert [t.reclaim_id for t in await store.taints("node-a")] == ["rcl-1"]


async def test_a_blind_transactions_commands_wait_for_its_group_commit(store):
    """A transaction that only wrote is committed in a group after its block ends: what waits
    for its commit (a command to an agent) runs only once that group's trip is done."""
    seen: list[int] = []
    trips = group_trips(store)
    async with store.transaction(priority=True):
        await store.add_taint("node-a", "rcl-1", "notice")
        store.after_commit(lambda: seen.append(group_trips(store)))
    assert seen == [trips + 1]
    assert [t.reclaim_id for t in await store.taints("node-a")] == ["rcl-1"]


async def test_sqlite_close_lets_the_reads_already_running_answer(tmp_path):
    """Dashboard reads are still running on their reader threads when the coordinator stops.
    Closing the store lets each finish with its answer: closing a connection under a running
    statement crashed the whole process (sqlite3 frees the statement under it) or cut the read
    with "closed database". Several rounds: the race is lost in one of the first few."""
    count = (
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2000) "
        "SELECT count(*) FROM n"
    )
    for round_ in range(10):
        backend = SqliteBackend(str(tmp_path / f"c{round_}.sqlite"))
        await backend.open()
        reads = [asyncio.create_task(backend.read(count)) for _ in range(20)]
        await asyncio.sleep(0)  # every read is handed to a reader thread
        await backend.close()
        answers = await asyncio.gather(*reads)
        assert [a.rows for a in answers] == [[(2000,)]] * 20
