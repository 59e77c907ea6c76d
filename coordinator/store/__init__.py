"""The coordinator's store, one async interface over two backends: SQLite, embedded (one file,
the default), and PostgreSQL for fleets. `open_store(url)` picks the backend from `--db`.

It holds nodes, taints, lifecycle events, reclamation records, workers, rentals, desired
capacity, avoided node groups, and the drain state rebuild() reads back. Every query is written
once, for both backends. All of it is async and none of it runs on the event loop. `async with
store.transaction():` makes the calls inside it (in the same task) one transaction, committed
or rolled back whole; a call outside one is its own transaction.

Events are idempotent by the agent's uid (docs/design.md invariant 10): storing the same uid twice
stores it once and says so. Ids only grow, so consumers resume with `events_after(id)`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from spotdrain.coordinator.store.backend import StoreError, StoreUnavailable
from spotdrain.coordinator.store.event_tables import EventTables
from spotdrain.coordinator.store.fleet_tables import FleetTables
from spotdrain.coordinator.store.rows import (
    ContractRow,
    DrainRow,
    EventRow,
    ModelRow,
    NewEvent,
    NodeRow,
    StartBackoff,
    TaintRow,
)
from spotdrain.coordinator.store.schema import SCHEMA_VERSION
from spotdrain.coordinator.store.transactions import StoreStats
from spotdrain.coordinator.store.workload_tables import WorkloadTables

__all__ = [
    "SCHEMA_VERSION",
    "ContractRow",
    "DrainRow",
    "EventRow",
    "ModelRow",
    "NewEvent",
    "NodeRow",
    "StartBackoff",
    "Store",
    "StoreError",
    "StoreStats",
    "StoreUnavailable",
    "TaintRow",
    "backend_for",
    "open_store",
]


class Store(FleetTables, WorkloadTables, EventTables):
    """Every table, one object: each concern's queries live in its own module; transactions,
    shared by all, in transactions.py."""


def backend_for(url: str):  # noqa: ANN201 (a Backend; imported lazily, psycopg is heavy)
    """`postgresql://...` or `postgres://...`: PostgreSQL; `sqlite:///PATH` or a plain path:
    SQLite."""
    if url.startswith(("postgresql://", "postgres://")):
        from spotdrain.coordinator.store.postgres import PostgresBackend

        return PostgresBackend(url)
    from spotdrain.coordinator.store.sqlite import SqliteBackend

    if url.startswith("sqlite:///"):
        url = url[len("sqlite://") :]
    elif "://" in url:
        raise StoreError(f"--db {url!r}: give a file path, sqlite:///PATH or postgresql://...")
    if not url:
        raise StoreError("--db: empty path")
    return SqliteBackend(url)


async def open_store(url: str, clock: Callable[[], float] = time.time) -> Store:
    backend = backend_for(url)
    await backend.open()
    return Store(backend, clock)
