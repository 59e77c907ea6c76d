"""What the store hands out: frozen rows, decoded once. No SQL here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spotdrain.protocol.events import EventHead, EventRecord


@dataclass(frozen=True)
class EventRow(EventHead):
    """A stored event; its fields in the order event_tables reads its columns."""

    id: int
    details_json: str
    received_at: float


@dataclass(frozen=True)
class NewEvent(EventRecord):
    """One event to store (from an agent's batch or the coordinator itself)."""

    # The agent's own text of `details`, already checked: stored as it came, not encoded again.
    details_json: str | None = None


@dataclass(frozen=True)
class TaintRow:
    node_id: str
    reclaim_id: str
    key: str
    effect: str
    reason: str
    since: float


@dataclass(frozen=True)
class NodeRow:
    node_id: str
    spot: bool
    node_group: str
    gpus: tuple[dict[str, Any], ...]
    registered_at: float
    last_seen: float
    workload_enabled: bool = True
    provider: str = ""
    spot_pinned: bool = False
    managers: tuple[dict[str, str], ...] = ()  # the work managers it last registered with
    # Its cloud instance (CloudIdentity's fields) as last reported; None: never reported.
    cloud: dict[str, Any] | None = None

    @property
    def owner(self) -> str:
        """The provider its rentals count for: the node itself when the agent names none."""
        return self.provider or self.node_id


@dataclass(frozen=True)
class ModelRow:
    model: str
    replicas: int
    image: str
    slots: int


@dataclass(frozen=True)
class DrainRow:
    node_id: str
    reclaim_id: str
    reason: str
    terminate_at: float
    grace_deadline: float
    started_at: float
    ended_at: float | None


@dataclass(frozen=True)
class StartBackoff:
    """A model whose workers keep failing to start: failures in a row, no new start before."""

    model: str
    failures: int
    retry_at: float


@dataclass(frozen=True)
class ContractRow:
    """How one workload image's (and kind's) reclamations ended
    (coordinator/capacity/contracts.py)."""

    image: str
    kind: str
    exited: int  # exited before the grace deadline G: the contract kept
    killed: int  # still there at G, SIGKILLed
    overrun: int  # still there at O
    flagged_at: float | None = None

    @property
    def reclamations(self) -> int:
        return self.exited + self.killed + self.overrun

    @property
    def failed_share(self) -> float:
        return (self.killed + self.overrun) / self.reclamations if self.reclamations else 0.0
