"""What agents tell the coordinator and what it tells them, as domain values.

The servicers convert protobuf to these in one place (servicers/convert.py) and back; nothing
below the servicers imports protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# --- from the agent ------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerReport:
    worker_id: str
    state: str  # started, stopped, refused
    gate_address: str = ""
    capacity: int = 0
    exit_code: int | None = None
    reason: str = ""


@dataclass(frozen=True)
class WorkerSlots:
    worker_id: str
    slots_in_use: int
    capacity: int = 0
    claimed_state: str = ""


@dataclass(frozen=True)
class RentalReport:
    rental_id: str
    state: str  # started, stopped
    container: str = ""
    exit_code: int | None = None
    reason: str = ""
    reclaim_id: str = ""
    reclaim_reason: str = ""
    reclaim_at: float = 0.0


@dataclass(frozen=True)
class Registration:
    node_id: str
    spot: bool
    node_group: str
    provider: str
    gpus: tuple[dict[str, Any], ...]
    workers: tuple[WorkerReport, ...] = ()
    rentals: tuple[RentalReport, ...] = ()
    inventory_complete: bool = True
    # The node's work managers: {"name", "node_name", "cluster"} each, checked and bounded.
    managers: tuple[dict[str, str], ...] = ()
    # The node's cloud instance (CloudIdentity's fields), checked; None: this registration
    # carried none (its agent has not read it yet), so the stored one stays.
    cloud: dict[str, Any] | None = None


# --- to the agent --------------------------------------------------------------------------


@dataclass(frozen=True)
class StartWorker:
    worker_id: str
    model: str
    image: str
    port: int
    capacity: int
    kind: str


@dataclass(frozen=True)
class DrainWorker:
    worker_id: str
    reason: str
    reclaim_id: str
    grace_deadline: float
    terminate_at: float


@dataclass(frozen=True)
class StartRental:
    rental_id: str
    image: str
    gpus: int
    renter: str


@dataclass(frozen=True)
class StopRental:
    rental_id: str
    reason: str


@dataclass(frozen=True)
class Registered:
    node_id: str
    taints: tuple[Any, ...] = field(default=())  # TaintRow


@dataclass(frozen=True)
class EventAck:
    uids: tuple[str, ...]


Command = StartWorker | DrainWorker | StartRental | StopRental | Registered | EventAck
