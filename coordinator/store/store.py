"""The coordinator's store: nodes, taints, lifecycle events, reclamation records, workers,
rentals, desired capacity, avoided node groups, and the drain state rebuild() reads back.

Every query is written once, for both backends. All of it is async and none of it runs on the
event loop. `async with store.transaction():` makes the calls inside it (in the same task) one
transaction, committed or rolled back whole; a call outside one is its own transaction.

Events are idempotent by the agent's uid (docs/design.md invariant 10): storing the same uid twice
stores it once and says so. Ids only grow, so consumers resume with `events_after(id)`.
"""

from __future__ import annotations

from spotdrain.coordinator.store.event_tables import EventTables
from spotdrain.coordinator.store.fleet_tables import FleetTables
from spotdrain.coordinator.store.workload_tables import WorkloadTables


class Store(FleetTables, WorkloadTables, EventTables):
    """Every table, one object: each concern's queries live in its own module; transactions,
    shared by all, in transactions.py."""
