"""The coordinator's web dashboard: the fleet, the reclamations and each one drawn, a few
operator actions. Served only when `--dashboard-listen` is given (docs/operations.md
"Dashboard").

It holds no state of its own: every page reads what the gRPC API reads (the store, the fleet's
in-memory indexes, the same operations), and every action calls the operation the gRPC
servicers call (coordinator/api/operations.py), with its checks. Nothing here is on the
critical path: pages are bounded (paginated), store reads are one at a time, and live pages
share one reader of the event log.
"""

from spotdrain.coordinator.dashboard.app import Dashboard, DashboardConfig

__all__ = ["Dashboard", "DashboardConfig"]
