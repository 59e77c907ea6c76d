"""What the agent's shell learned, as events for the reclamation machine
(agent/core/reclamation.py): each carries the time it happened and only plain values, so a test
can write a whole story as a list of them. Below them, the node's own events (agent/core/node.py):
notices, the owner's switch, workload reports, and each reclamation's events routed by its id."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from spotdrain.agent.core.notice import Notice, NoticeInvalid


@dataclass(frozen=True)
class RoundTarget:
    """A container a signal round found running, as the engine listed it."""

    container: str
    name: str
    kind: str = ""
    image: str = ""


@dataclass(frozen=True)
class TaintAnswered:
    """The coordinator stored the taint (the 800 ms call, or a later background retry).

    `listed`: the node's containers as the shell listed them while the call was in flight
    (None: that listing is not back yet). The first SIGTERM round then announces them in this
    same step, one bundle save, instead of listing again and saving once more."""

    now: float
    listed: tuple[RoundTarget, ...] | None = None


@dataclass(frozen=True)
class TaintUnanswered:
    """The Taint call did not answer by its deadline, or failed (`listed` as TaintAnswered's)."""

    now: float
    error: str
    listed: tuple[RoundTarget, ...] | None = None


@dataclass(frozen=True)
class ContainerSignalled:
    now: float
    container: str
    name: str
    signal: str
    via: str  # "api" or "pid" (the engine hung; docs/design.md step 4)
    error: str = ""  # non-empty: neither route delivered it
    # What the coordinator tracks the workload's contract by (coordinator/capacity/contracts.py).
    image: str = ""
    kind: str = ""


@dataclass(frozen=True)
class RoundListed:
    """A signal round has listed its targets and sends nothing until the machine has recorded
    them (answered with DeliverSignals, after the shell saved the bundle)."""

    now: float
    signal: str
    targets: tuple[RoundTarget, ...] = ()


@dataclass(frozen=True)
class SignalRoundDone:
    """Every container the round found has been tried (results came as ContainerSignalled)."""

    now: float
    signal: str


@dataclass(frozen=True)
class ContainerExited:
    """A unit left the node: a container exited, a Slurm job ended or was requeued."""

    now: float
    container: str
    name: str
    exit_code: int
    state: str = ""  # the manager's word for how it ended, where it has one (Slurm's)


@dataclass(frozen=True)
class Observed:
    """One verification observation. `error` set: the observation failed, which is not empty."""

    now: float
    running: tuple[str, ...] = ()  # ids of running containers labelled with this node
    gpu_processes: tuple[int, ...] = ()  # pids NVML lists on any GPU
    error: str = ""
    # The rentals among `running`: they run until G (reclaim_at), so before the SIGKILL round
    # they are work still there, not strays to signal.
    rentals: tuple[str, ...] = ()


@dataclass(frozen=True)
class WorkersDraining:
    """The node's inference workers now refuse new requests at their slot gates; each is
    stopped when its last slot is released, or at G."""

    now: float
    containers: tuple[str, ...] = ()
    names: tuple[str, ...] = ()


@dataclass(frozen=True)
class Resumed:
    """The owner resumed the node (a pause only): the machine is theirs no longer."""

    now: float


@dataclass(frozen=True)
class TaintsLifted:
    """The coordinator acknowledged the lift of a cancel or a resume."""

    now: float


@dataclass(frozen=True)
class Tick:
    now: float
    # The listing made during the Taint call, for a tick that may pass its deadline (the local
    # fallback then announces it, as TaintUnanswered.listed).
    listed: tuple[RoundTarget, ...] | None = None


@dataclass(frozen=True)
class Cancelled:
    now: float


@dataclass(frozen=True)
class NoticeHeard:
    """The provider's notice for this reclamation, heard again: re-read, re-stamped or
    rewritten. D is the earliest ever heard (DESIGN "one interruption is one reclamation"):
    an earlier D moves D, G and O earlier; a later one is recorded and moves nothing."""

    now: float
    action: str
    terminate_at: float | None  # None: the notice names no time, so it says nothing of D


@dataclass(frozen=True)
class WorkloadReported:
    """A report a container wrote into its status directory (spotdrain.workload), as the agent
    read it at `now`. Information only: it never moves a deadline and never counts towards
    verification (docs/design.md "Workload status directory")."""

    now: float
    name: str  # the container's name (its status directory's)
    report: str  # "checkpoint_started" or "checkpoint_committed"
    generation: int
    nbytes: int | None = None
    reported_at: float = 0.0  # the workload's own clock


# What a work manager (agent/workloads/managers.py) tells a reclamation's record beside its
# signals and exits: these kinds only, recorded as they come.
MANAGER_NOTES = frozenset(
    {
        "manager_cordoned",
        "manager_cordon_failed",
        "manager_uncordoned",
        "requeued",
        "kill_wait_warning",
    }
)


@dataclass(frozen=True)
class ManagerNoted:
    """A work manager's note for the record: its cordon (Slurm's DRAIN) landed or failed, a
    requeue landed, a warning about its own deadlines. Information only: never a deadline,
    never verification."""

    now: float
    kind: str  # one of MANAGER_NOTES
    details: Mapping[str, object] = field(default_factory=dict)


Event = (
    TaintAnswered
    | TaintUnanswered
    | ContainerSignalled
    | RoundListed
    | SignalRoundDone
    | ContainerExited
    | Observed
    | WorkersDraining
    | Resumed
    | TaintsLifted
    | Tick
    | Cancelled
    | WorkloadReported
    | NoticeHeard
    | ManagerNoted
)


# --- the node's own events (agent/core/node.py): the time comes beside each, in handle() ------


@dataclass(frozen=True)
class Restarted:
    """The agent started, its node made from the bundles read once: forget the finished ones
    Retention lets go, and carry on with every unfinished one. `delivered`: of the SIGTERMs the
    previous process announced, those the engine says it was asked to send (None: it cannot
    tell)."""

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
    Restarted
    | NoticeArrived
    | PauseAsked
    | ResumeAsked
    | ForReclamation
    | DeadlinesDue
    | ReportLanded
    | ReportInvalid
)
