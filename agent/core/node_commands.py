"""What the node (agent/core/node.py) asks its shell to do, beside each reclamation's own
commands (agent/core/reclamation_commands.py): plain data, carried out in order. The deadline
file is the node's, so it is asked for here with the reclamation's WriteDeadlineFile, or
removed with RemoveDeadlineFile."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spotdrain.agent.core.reclamation_commands import Command, WriteDeadlineFile


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
    """Delete these finished reclamations' bundles (docs/design.md "Finished bundles")."""

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
