"""What the agent's shell tells the node (agent/core/node.py): notices, the owner's switch,
workload reports, and each reclamation's own events routed by its id. Plain values only; the
time comes beside the event, in `Node.handle(event, now)`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from spotdrain.agent.core.notice import Notice, NoticeInvalid
from spotdrain.agent.core.reclamation import Reclamation
from spotdrain.agent.core.reclamation_events import Event, RoundTarget


@dataclass(frozen=True)
class BundlesLoaded:
    """The agent started: every bundle in its state directory, read once. The node holds them
    from now on; nothing asks the disk again (a start is never refused by a disk read)."""

    bundles: tuple[Reclamation, ...]


@dataclass(frozen=True)
class Restarted:
    """Carry on with every unfinished bundle. `delivered`: of the SIGTERMs the previous process
    announced, those the engine says it was asked to send (None: it cannot tell)."""

    delivered: frozenset[str] | None = None


@dataclass(frozen=True)
class NoticeArrived:
    parsed: Notice | NoticeInvalid


@dataclass(frozen=True)
class PauseAsked:
    """The owner's pause (spotctl pause)."""


@dataclass(frozen=True)
class ResumeAsked:
    """The owner's resume (spotctl resume)."""


@dataclass(frozen=True)
class ForReclamation:
    """An event of one reclamation (an adapter's answer), by its id."""

    reclaim_id: str
    event: Event


@dataclass(frozen=True)
class DeadlinesDue:
    """The earliest wakeup has come: every live reclamation is ticked. `listed`: the listings
    made while a Taint call was in flight and back by now, by reclamation."""

    listed: Mapping[str, tuple[RoundTarget, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class ReportLanded:
    """A workload's checkpoint report, read from its status directory."""

    name: str
    report: str
    generation: int
    nbytes: int | None
    reported_at: float


@dataclass(frozen=True)
class ReportInvalid:
    name: str
    entry: str
    why: str


NodeEvent = (
    BundlesLoaded
    | Restarted
    | NoticeArrived
    | PauseAsked
    | ResumeAsked
    | ForReclamation
    | DeadlinesDue
    | ReportLanded
    | ReportInvalid
)
