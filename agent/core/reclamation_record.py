"""One reclamation's record: the fields the agent stores in its bundle (agent/drain/state.py),
the phase table it moves along, and the invariants every step keeps.

The rules that change it are the machine's (agent/core/reclamation.py) and its helpers' (the
signal ledger, the reports, the deadlines); this module holds the state and its checks only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Self

from spotdrain.agent.core.reclamation_commands import SIGKILL, SIGTERM
from spotdrain.protocol.machine import StateMachine, StoryEntry, Table
from spotdrain.protocol.records import refuse_unknown_fields

# The reclamation's own phase: tainting until a taint is in force, then draining; done once
# verified empty, cancelled or resumed.
PHASE_TRANSITIONS: Table[str, str] = Table(
    "reclamation",
    {
        ("tainting", "draining"): "a taint (remote, or local after no answer) is in force",
        ("tainting", "done"): "cancelled or resumed before any taint was in force",
        ("draining", "done"): "verified empty, or cancelled or resumed",
    },
)
OUTCOMES = ("", "drained", "overrun", "cancelled", "resumed")


@dataclass
class ReclamationRecord(StateMachine[str, str]):
    """One reclamation: its absolute deadlines (computed once; only the provider naming an
    earlier D moves them, and only earlier: NoticeHeard) and its progress.

    Its state is `phase` (PHASE_TRANSITIONS). Its story (phase moves and signal-ledger moves) is
    kept in memory only, outside the dataclass fields, so the bundle's stored form is unchanged.
    """

    table = PHASE_TRANSITIONS
    story_limit = 64

    reclaim_id: str
    node_id: str
    notice_key: str
    notice_id: str
    source: str
    reason: str  # "notice" or "pause"
    t0: float
    terminate_at: float  # D
    grace_deadline: float  # G
    overrun_at: float  # O
    observe_every_s: float
    taint_answer_by: float
    taint_answer_s: float = 0.8
    # progress
    phase: str = "tainting"  # tainting -> draining -> done (verified empty, or cancelled)
    taint_mode: str = ""  # "", "local", "remote"
    remote_taint: bool = False
    sigterm_round: bool = False  # the SIGTERM round has been issued (never issued twice)
    sigterm_round_done: bool = False
    sigkill_round: bool = False
    rounds_in_flight: int = 0  # signal rounds asked for and not yet reported done
    signalled: dict[str, str] = field(default_factory=dict)  # container id -> last signal
    names: dict[str, str] = field(default_factory=dict)
    gated: list[str] = field(default_factory=list)  # inference workers draining at their gates
    exited: dict[str, int] = field(default_factory=dict)
    observing: bool = False
    observe_again: bool = False
    next_observe_at: float | None = None
    last_failure: str = ""
    verified_at: float | None = None
    outcome: str = ""  # "", "drained", "overrun", "cancelled", "resumed"
    resumed: bool = False  # a pause the owner has ended
    lift_acknowledged: bool = False  # the coordinator lifted the taints of a cancel or resume
    sigterm_at: dict[str, float] = field(default_factory=dict)  # container id -> its SIGTERM
    # What the provider said last (NoticeHeard), and when a later D was last recorded.
    heard_action: str = ""
    heard_terminate_at: float | None = None
    later_recorded_at: float | None = None
    later_unrecorded: int = 0  # later Ds heard since then, not recorded one by one
    # Workload reports by container name, held until the container is signalled or exits.
    pending_reports: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # Containers a round is about to signal: id -> {signal, name, kind, image, at}. In the bundle
    # before any of them is sent (write before act), so a restart knows who may have had it.
    announced: dict[str, dict[str, Any]] = field(default_factory=dict)
    # SIGTERMs the previous agent process announced and may have sent (never sent again).
    sigterm_by_previous_run: list[str] = field(default_factory=list)
    # The notice's cancel has been recorded: the same cancel read again (an agent restarted
    # while the cancel is still the notice file's content) records nothing more.
    cancel_recorded: bool = False
    # The cancel lifted the taints (nothing was stopped); the outcome it had, if any, stands.
    lifted_by_cancel: bool = False
    # A signal was announced under this notice, so it may have reached a container even if it
    # was withdrawn since (a SIGKILL announced before a restart): a cancel then lifts nothing.
    signal_announced: bool = False

    def __post_init__(self) -> None:
        self.story: list[StoryEntry[str]] = []

    @property
    def state(self) -> str:
        return self.phase

    @state.setter
    def state(self, phase: str) -> None:
        self.phase = phase

    @property
    def ident(self) -> str:
        return self.reclaim_id

    @property
    def lifted(self) -> bool:
        """Cancelled or resumed: nothing more may be signalled, and the taints must go."""
        return self.resumed or self.lifted_by_cancel or self.outcome in ("cancelled", "resumed")

    @property
    def finished(self) -> bool:
        """Nothing more to do. A local taint keeps it open until the coordinator has the taint;
        a lift (cancel, resume) keeps it open until the coordinator has lifted it."""
        if self.lifted:
            return self.lift_acknowledged
        if self.taint_mode == "local" and not self.remote_taint:
            return False
        return self.phase == "done"

    def broken_invariants(self) -> list[str]:
        """The reclamation's own invariants (dask's validate_state); tests call validate() after
        every step, which raises InvalidState naming each one broken."""
        broken = super().broken_invariants()
        if not self.t0 <= self.taint_answer_by or not (
            self.grace_deadline <= self.overrun_at <= self.terminate_at
        ):
            broken.append("deadlines out of order")
        if self.outcome not in OUTCOMES:
            broken.append(f"unknown outcome {self.outcome!r}")
        if self.phase == "tainting" and (self.signalled or self.announced or self.sigterm_round):
            broken.append("signalled before a taint was in force (invariant 1)")
        if self.sigkill_round and not self.sigterm_round:
            broken.append("a SIGKILL round without the SIGTERM round")
        if self.rounds_in_flight < 0:
            broken.append("negative rounds in flight")
        if self.announced and not self.rounds_in_flight:
            broken.append(f"announced without a round in flight: {sorted(self.announced)}")
        for container, entry in self.announced.items():
            if entry.get("signal") not in (SIGTERM, SIGKILL):
                broken.append(f"{container} announced for {entry.get('signal')!r}")
            elif entry["signal"] == SIGTERM and container in self.signalled:
                broken.append(f"{container} announced for a second SIGTERM")
        for container in self.sigterm_by_previous_run:
            if container not in self.signalled:
                broken.append(f"{container} signalled by the previous run but not recorded")
        if self.outcome == "drained" and (
            self.verified_at is None or self.verified_at >= self.overrun_at
        ):
            broken.append("drained without an empty look before O (invariants 5, 6)")
        if self.verified_at is not None and self.phase != "done":
            broken.append("verified empty but not done")
        return broken

    # --- persistence -----------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Self:
        refuse_unknown_fields(doc, (f.name for f in dataclasses.fields(cls)), "reclamation bundle")
        return cls(**doc)
