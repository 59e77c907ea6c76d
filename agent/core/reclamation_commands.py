"""What the reclamation machine (agent/core/reclamation.py), and the node over all its
reclamations (agent/core/node.py, below), ask their shell to do: each command is plain data,
carried out by agent/drain/executor.py after the machine's state is saved."""

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


# --- the node's own commands (agent/core/node.py), carried out in order beside the ones above.
# The deadline file is the node's: a reclamation's WriteDeadlineFile reaches the shell only as
# the node decided it, or as RemoveDeadlineFile.


@dataclass(frozen=True)
class Stepped:
    """A reclamation moved: save its bundle (with the events of `commands`), then carry the
    commands out. Never holds a WriteDeadlineFile: the node decides the file."""

    reclaim_id: str
    commands: tuple[Command, ...] = ()


@dataclass(frozen=True)
class RemoveDeadlineFile:
    """No drain is in force on the node any more."""


@dataclass(frozen=True)
class Record:
    """An event of the node's that no bundle holds (an invalid notice, a cancel of a notice
    never had, an invalid report): to the outbox only."""

    kind: str
    reclaim_id: str = ""
    t_offset_s: float | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ResumeCoordinator:
    """Turn the coordinator's flag on with no pause behind it (a pause made while this agent's
    state was lost)."""


@dataclass(frozen=True)
class StopResumingCoordinator:
    """A new pause: an earlier ResumeCoordinator still retrying must not end it."""


@dataclass(frozen=True)
class ReleaseEvents:
    """The reclamation's notice path is over (lifted, or done): its held events may go."""

    reclaim_id: str


@dataclass(frozen=True)
class Settled:
    """The reclamation has an outcome: whoever waits on it may go on."""

    reclaim_id: str
    outcome: str


@dataclass(frozen=True)
class ForgetBundles:
    """Delete these finished reclamations' bundles (which: docs/design.md "How the agent
    carries it out")."""

    reclaim_ids: tuple[str, ...]


NodeCommand = (
    Stepped
    | WriteDeadlineFile
    | RemoveDeadlineFile
    | Record
    | ResumeCoordinator
    | StopResumingCoordinator
    | ReleaseEvents
    | Settled
    | ForgetBundles
)
