"""The coordinator's inference worker state machine: events and the time in, effects out.

Pure: no asyncio, grpc, sqlite or clock. The shell stores the worker (`to_json`) after every
`handle` and before it carries out the effects, so no drain state lives only in memory
(docs/design.md invariant 8).

States and the only moves between them (`TRANSITIONS`, keyed on (start, finish) as in dask's
worker_state_machine):

    starting -> ready      the agent started the container and its slot gate (Started)
    starting -> draining   drained before it served, or it appeared on a node that takes no work
    ready    -> draining   pause, hard notice or operator drain
    starting -> stopped    the container died before it was ready
    ready    -> stopped
    draining -> stopped    only a stop ends draining (invariant 3)

`stopped` is final. Routers see exactly the `ready` workers: entering ready yields `RouteAdded`,
leaving it yields `RouteRemoved` (coordinator/core/worker_effects.py), both from the table.

Programmer errors against races:
- A malformed event (unknown drain reason, grace deadline after terminate_at, negative slots,
  capacity < 1, empty gate address, unknown claimed state, ttl <= 0) raises ValueError when it
  is built, before it reaches a worker. An object that is not an event raises TypeError.
- Everything else is a race between the agent's stream and the coordinator's own decisions and
  is absorbed without raising: any event for a stopped worker, a second Stopped, a second Drain,
  a Started for a worker already draining, a heartbeat that claims another state. Each (except
  heartbeats and slot counts, which would drown the rest) leaves a line in the story.
- `InvalidTransition` (spotdrain.protocol.machine) therefore means a bug in this module: a
  handler asked for a move the table does not have. The stateful test in
  tests/core/test_worker_machine.py drives random event sequences and checks it is never raised.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from spotdrain.coordinator.core.worker_effects import (
    DrainOnNode,
    Effect,
    Route,
    RouteAdded,
    RouteRemoved,
    WorkerEvent,
)
from spotdrain.protocol.machine import StateMachine, StoryEntry, Table
from spotdrain.protocol.records import refuse_unknown_fields

STARTING = "starting"
READY = "ready"
DRAINING = "draining"
STOPPED = "stopped"
STATES = (STARTING, READY, DRAINING, STOPPED)

DRAIN_REASONS = ("pause", "notice", "operator")
STORY_LIMIT = 50  # the most recent entries are kept; older ones are dropped first


# --- events: what the shell learned -------------------------------------------------------


def _check_deadlines(reason: str, grace_deadline: float, terminate_at: float) -> None:
    if reason not in DRAIN_REASONS:
        raise ValueError(f"drain reason must be one of {DRAIN_REASONS}, got {reason!r}")
    if grace_deadline > terminate_at:
        raise ValueError(f"grace deadline {grace_deadline} is after terminate_at {terminate_at}")


@dataclass(frozen=True)
class NodeDrain:
    """The drain a node is under (paused, tainted by a notice, drained by an operator).

    The shell builds it from the node's stored record; the deadlines are the node's own,
    computed once when the drain began (invariant 2), never recomputed for a late worker.
    """

    reason: str
    grace_deadline: float
    terminate_at: float

    def __post_init__(self) -> None:
        _check_deadlines(self.reason, self.grace_deadline, self.terminate_at)


@dataclass(frozen=True)
class Started:
    """The agent started the container and its slot gate.

    `node_drain` is None when the node accepts work (workload on, no taint). Otherwise the
    worker goes straight to draining under the node's deadlines and never serves (invariant 8:
    a worker that registers on a disabled node is drained the moment it appears).
    """

    now: float
    gate_address: str
    capacity: int
    node_drain: NodeDrain | None = None
    routed: bool = True  # an inference worker behind a gate; batch and render jobs have none

    def __post_init__(self) -> None:
        if self.routed and not self.gate_address:
            raise ValueError("Started needs the slot gate's address")
        if self.capacity < 1:
            raise ValueError(f"capacity must be at least 1 slot, got {self.capacity}")


@dataclass(frozen=True)
class Heartbeat:
    """The agent's periodic report. Refreshes expiry and slots; never moves the state."""

    now: float
    claimed_state: str
    slots_in_use: int
    ttl_s: float

    def __post_init__(self) -> None:
        if self.claimed_state not in STATES:
            raise ValueError(f"claimed state must be one of {STATES}, got {self.claimed_state!r}")
        if self.slots_in_use < 0:
            raise ValueError(f"slots in use cannot be negative, got {self.slots_in_use}")
        if self.ttl_s <= 0:
            raise ValueError(f"heartbeat ttl must be positive, got {self.ttl_s}")


@dataclass(frozen=True)
class Drain:
    """Stop routing to the worker; stop it when its slots reach zero or at the drain's grace
    deadline."""

    now: float
    drain: NodeDrain


@dataclass(frozen=True)
class Stopped:
    """The agent reports the container gone (exited, killed, or never came up)."""

    now: float
    exit_code: int | None = None


@dataclass(frozen=True)
class SlotsChanged:
    now: float
    slots_in_use: int

    def __post_init__(self) -> None:
        if self.slots_in_use < 0:
            raise ValueError(f"slots in use cannot be negative, got {self.slots_in_use}")


Event = Started | Heartbeat | Drain | Stopped | SlotsChanged


def _enter_ready(worker: Worker) -> list[Effect]:
    return [RouteAdded(worker.route())] if worker.routed else []


def _leave_ready(worker: Worker) -> list[Effect]:
    return [RouteRemoved(worker.worker_id)] if worker.routed else []


def _nothing(worker: Worker) -> list[Effect]:
    return []


# (start, finish) -> the routing effects of that move. Lifecycle events and agent commands are
# added by the handlers, which know why the move happened.
TRANSITIONS: Table[str, Callable[[Worker], list[Effect]]] = Table(
    "worker",
    {
        (STARTING, READY): _enter_ready,
        (STARTING, DRAINING): _nothing,
        (READY, DRAINING): _leave_ready,
        (STARTING, STOPPED): _nothing,
        (READY, STOPPED): _leave_ready,
        (DRAINING, STOPPED): _nothing,
    },
)


@dataclass
class Worker(StateMachine[str, Callable[["Worker"], list[Effect]]]):
    """One inference worker as the coordinator sees it."""

    table = TRANSITIONS
    story_limit = STORY_LIMIT

    worker_id: str
    node_id: str
    model: str
    image: str
    port: int
    capacity: int  # slots
    created_at: float
    state: str = STARTING
    gate_address: str = ""  # "" until the agent reports the gate (Started)
    slots_in_use: int = 0
    expires_at: float | None = None  # last heartbeat + ttl; the shell decides what expiry means
    drain_reason: str = ""  # "" | "pause" | "notice" | "operator": why it left service first
    grace_deadline: float | None = None  # absolute; set when draining begins, never later
    terminate_at: float | None = None  # absolute; same rule
    stopped_at: float | None = None
    exit_code: int | None = None
    story: list[StoryEntry[str]] = field(default_factory=list)
    kind: str = "inference"  # or "batch" / "render": a plain container, never routed

    @property
    def routed(self) -> bool:
        return self.kind == "inference"

    @property
    def ident(self) -> str:
        return self.worker_id

    # --- the one mutator -------------------------------------------------------------------

    def handle(self, event: Event) -> list[Effect]:
        match event:
            case Started():
                return self._started(event)
            case Heartbeat():
                return self._heartbeat(event)
            case Drain(now, NodeDrain(reason, grace_deadline, terminate_at)):
                return self._drain(now, "Drain", reason, grace_deadline, terminate_at)
            case Stopped(now, exit_code):
                return self._stopped(now, exit_code)
            case SlotsChanged(now, slots):
                if self.state != STOPPED:
                    self.slots_in_use = slots
                return []
        raise TypeError(event)

    def transition(self, finish: str, now: float, cause: str) -> list[Effect]:
        """Move to `finish` (the base checks the table and tells the story) and return that
        move's routing effects. Handlers call this only for moves they know are in the table."""
        return self.move(finish, now, cause)(self)

    # --- handlers --------------------------------------------------------------------------

    def _started(self, ev: Started) -> list[Effect]:
        if self.state == STOPPED:
            # A late registration for a worker already reported gone: stopped is final.
            self.note(ev.now, "Started(ignored)")
            return []
        address_changed = (ev.gate_address, ev.capacity) != (self.gate_address, self.capacity)
        self.gate_address = ev.gate_address
        self.capacity = ev.capacity
        if ev.node_drain is not None:
            # Invariant 8: the node takes no work, so this worker never serves. The node's own
            # deadlines apply; a worker already draining keeps the earlier of the two.
            d = ev.node_drain
            effects = self._drain(ev.now, "Started", d.reason, d.grace_deadline, d.terminate_at)
            if not any(isinstance(e, DrainOnNode) for e in effects):
                # The drain was decided before the gate existed; tell the agent again now.
                effects.append(self._drain_on_node())
            return effects
        if self.state == STARTING:
            effects = self.transition(READY, ev.now, "Started")
            return [*effects, WorkerEvent("worker_ready", self._details(ev.now))]
        if self.state == READY:
            # A re-registration (agent reconnect): publish the new address if it moved.
            self.note(ev.now, "Started(again)")
            return [RouteAdded(self.route())] if address_changed and self.routed else []
        # Drained while it was starting (the drain won the race): the gate exists now, so ask
        # the agent again to drain it. Never ready (invariant 3).
        self.note(ev.now, "Started(draining)")
        return [self._drain_on_node()]

    def _heartbeat(self, ev: Heartbeat) -> list[Effect]:
        if self.state == STOPPED:
            return []  # heartbeats race with stops
        # Invariant 3: a heartbeat refreshes expiry and slots and never moves the state, whatever
        # it claims. Only Started makes a worker ready; only Stopped ends draining.
        self.expires_at = ev.now + ev.ttl_s
        self.slots_in_use = ev.slots_in_use
        if self.state == DRAINING and ev.claimed_state in (STARTING, READY):
            # The agent has not applied the drain yet (a command lost with a broken stream, or
            # an agent restarted without it): say it again. Idempotent on the agent.
            return [self._drain_on_node()]
        return []

    def _drain(
        self, now: float, cause: str, reason: str, grace_deadline: float, terminate_at: float
    ) -> list[Effect]:
        if self.state == STOPPED:
            self.note(now, f"{cause}(ignored)")
            return []
        if self.state == DRAINING:
            # Invariant 2: never extended. An earlier deadline (a hard notice during a pause)
            # replaces a later one; the reason stays the one the worker first drained for.
            assert self.grace_deadline is not None and self.terminate_at is not None
            earlier_grace = grace_deadline < self.grace_deadline
            earlier_end = terminate_at < self.terminate_at
            if not (earlier_grace or earlier_end):
                self.note(now, f"{cause}(kept deadlines)")
                return []
            self.grace_deadline = min(self.grace_deadline, grace_deadline)
            self.terminate_at = min(self.terminate_at, terminate_at)
            self.note(now, f"{cause}(shortened)")
            details = self._details(now)
            details["shortened_by"] = reason
            return [self._drain_on_node(), WorkerEvent("worker_draining", details)]
        self.drain_reason = reason
        self.grace_deadline = grace_deadline
        self.terminate_at = terminate_at
        effects = self.transition(DRAINING, now, cause)
        return [*effects, self._drain_on_node(), WorkerEvent("worker_draining", self._details(now))]

    def _stopped(self, now: float, exit_code: int | None) -> list[Effect]:
        if self.state == STOPPED:
            self.note(now, "Stopped(ignored)")
            return []
        slots_at_stop = self.slots_in_use
        self.stopped_at = now
        self.exit_code = exit_code
        self.slots_in_use = 0
        effects = self.transition(STOPPED, now, "Stopped")
        details = self._details(now)
        details["exit_code"] = exit_code
        details["slots_in_use_at_stop"] = slots_at_stop
        return [*effects, WorkerEvent("worker_stopped", details)]

    # --- helpers ---------------------------------------------------------------------------

    def route(self) -> Route:
        return Route(self.worker_id, self.node_id, self.model, self.gate_address, self.capacity)

    def expired(self, now: float) -> bool:
        """No heartbeat within its ttl. What to do about it is the shell's decision."""
        return self.expires_at is not None and now >= self.expires_at

    def broken_invariants(self) -> list[str]:
        """The worker's own invariants (dask's validate_state); tests call validate() often."""
        broken = super().broken_invariants()
        if self.state == READY and self.routed and not self.gate_address:
            broken.append("ready without a gate")
        if self.state == DRAINING:
            if self.drain_reason not in DRAIN_REASONS:
                broken.append(f"draining for an unknown reason {self.drain_reason!r}")
            if self.grace_deadline is None or self.terminate_at is None:
                broken.append("draining without its deadlines")
        if self.state == STOPPED and (self.stopped_at is None or self.slots_in_use != 0):
            broken.append("stopped without a stop time, or with slots in use")
        if self.state != STOPPED and self.stopped_at is not None:
            broken.append(f"{self.state} with a stop time")
        return broken

    def _drain_on_node(self) -> DrainOnNode:
        assert self.grace_deadline is not None and self.terminate_at is not None
        return DrainOnNode(
            self.worker_id, self.node_id, self.grace_deadline, self.terminate_at, self.drain_reason
        )

    def _details(self, now: float) -> dict[str, Any]:
        details: dict[str, Any] = {
            "node_id": self.node_id,
            "worker_id": self.worker_id,
            "model": self.model,
            "state": self.state,
            "at": now,
        }
        if self.drain_reason:
            details["reason"] = self.drain_reason
            details["grace_deadline"] = self.grace_deadline
            details["terminate_at"] = self.terminate_at
        return details

    # --- persistence -----------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        # Every field is a plain value but the story (a list of tuples): a shallow copy, where
        # dataclasses.asdict deep-copied each value (a tenth of a Taint's cost at 10,000 nodes).
        doc = {name: getattr(self, name) for name in _FIELD_NAMES}
        doc["story"] = [list(entry) for entry in self.story]
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Worker:
        refuse_unknown_fields(doc, _FIELD_NAMES, "worker record")
        fields = dict(doc)
        if fields.get("state", STARTING) not in STATES:
            raise ValueError(f"worker record has unknown state {fields['state']!r}")
        fields["story"] = [
            (float(t), str(name), str(a), str(b)) for t, name, a, b in fields.get("story", [])
        ]
        return cls(**fields)


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(Worker))
