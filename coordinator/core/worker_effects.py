"""What the worker machine (coordinator/core/worker_machine.py) asks its shell to do: publish or
withdraw a route, tell the node's agent to drain a worker, record a lifecycle event. Plain
values, so the machine's tests compare them and the shell (coordinator/fleet/wiring.py,
`Fleet.apply`) matches on them. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Route:
    """What a router needs to send traffic to a ready worker: a snapshot, not the live worker."""

    worker_id: str
    node_id: str
    model: str
    gate_address: str
    capacity: int


@dataclass(frozen=True)
class RouteAdded:
    """Publish (or replace: same worker_id, new address) the worker's route."""

    route: Route

    @property
    def worker_id(self) -> str:
        return self.route.worker_id


@dataclass(frozen=True)
class RouteRemoved:
    worker_id: str


@dataclass(frozen=True)
class DrainOnNode:
    """Ask the agent to drain this worker's gate and stop it when its slots reach zero, or at
    `grace_deadline` at the latest. Idempotent on the agent: it may be sent again (a shortened
    deadline, a gate that came up after the drain, an agent that still claims the worker
    serves); the agent keeps the earliest deadline it was given."""

    worker_id: str
    node_id: str
    grace_deadline: float
    terminate_at: float
    reason: str


@dataclass(frozen=True)
class WorkerEvent:
    """A lifecycle event for the event log: `worker_ready`, `worker_draining`, `worker_stopped`.

    `details` always carries node_id and worker_id (docs/contributing.md "Words")."""

    kind: str
    details: Mapping[str, Any] = field(default_factory=dict)


Effect = RouteAdded | RouteRemoved | DrainOnNode | WorkerEvent
