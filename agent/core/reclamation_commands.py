"""What the reclamation machine (agent/core/reclamation.py) asks its shell to do: each command
is plain data, carried out by agent/drain/executor.py after the machine's state is saved."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spotdrain.protocol import kinds

SIGTERM = "SIGTERM"
SIGKILL = "SIGKILL"


@dataclass(frozen=True)
class RequestTaint:
    reclaim_id: str
    answer_by: float  # absolute; no answer by then is TaintUnanswered


@dataclass(frozen=True)
class ApplyLocalTaint:
    reclaim_id: str


@dataclass(frozen=True)
class RetryRemoteTaint:
    """Keep calling Taint in the background until it answers (then TaintAnswered)."""

    reclaim_id: str


@dataclass(frozen=True)
class LiftTaints:
    reclaim_id: str


@dataclass(frozen=True)
class WriteDeadlineFile:
    reclaim_id: str
    terminate_at: float
    grace_deadline: float
    reason: str


@dataclass(frozen=True)
class SignalContainers:
    """Signal every running container with this node's label, concurrently, except `skip`.

    SIGTERM rounds leave inference workers alone (they drain through their slot gates) and
    rentals (the renter keeps the machine until reclaim_at = G, docs/design.md "Four drain paths");
    the SIGKILL round at G takes every kind."""

    signal: str
    skip: frozenset[str] = frozenset()
    # Announced already, in the step that asked for the round (a listing made ahead): send
    # exactly these, once the bundle is saved, without listing or announcing again.
    announced: tuple[str, ...] | None = None

    @property
    def skip_kinds(self) -> frozenset[str]:
        return kinds.NOT_SIGTERMED if self.signal == SIGTERM else frozenset()


@dataclass(frozen=True)
class DeliverSignals:
    """Send `signal` to exactly these containers, now announced in the bundle (the answer to a
    round's RoundListed; empty when nothing may be signalled). Save the bundle first."""

    signal: str
    containers: tuple[str, ...] = ()


@dataclass(frozen=True)
class DrainWorkers:
    """Mark every inference worker draining at its gate; stop each when its slots reach zero."""

    reclaim_id: str
    grace_deadline: float


@dataclass(frozen=True)
class CutWorkers:
    """The grace deadline: gates end every open stream with an `interrupted` error."""

    reclaim_id: str


@dataclass(frozen=True)
class WatchExits:
    containers: tuple[str, ...]


@dataclass(frozen=True)
class Observe:
    pass


@dataclass(frozen=True)
class Emit:
    kind: str
    details: dict[str, Any] = field(default_factory=dict)
    at: float | None = None  # when the fact happened: the time of the event that caused it


Command = (
    RequestTaint
    | ApplyLocalTaint
    | RetryRemoteTaint
    | LiftTaints
    | WriteDeadlineFile
    | SignalContainers
    | DeliverSignals
    | DrainWorkers
    | CutWorkers
    | WatchExits
    | Observe
    | Emit
)
