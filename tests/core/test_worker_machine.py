"""The coordinator's inference worker state machine and its placement gate, told as stories.

A fake clock: time is the `now` of each event. The node's drain deadlines follow the owner pause
timeline of docs/design.md: the owner pauses at P = 1000, so D = P + 120 and G = D - 10.
Nothing here sleeps or does I/O.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from spotdrain.coordinator.core.admission import (
    GROUP_AVOIDED,
    NOT_CONNECTED,
    NOT_ENOUGH_GPUS,
    PATHS,
    RENDER_ON_SPOT,
    TAINTED,
    WORKLOAD_DISABLED,
    NodeView,
    PlacementRequest,
    admit,
)
from spotdrain.coordinator.core.worker_effects import (
    DrainOnNode,
    Effect,
    Route,
    RouteAdded,
    RouteRemoved,
    WorkerEvent,
)
from spotdrain.coordinator.core.worker_machine import (
    DRAINING,
    READY,
    STARTING,
    STATES,
    STOPPED,
    STORY_LIMIT,
    TRANSITIONS,
    Drain,
    Heartbeat,
    NodeDrain,
    SlotsChanged,
    Started,
    Stopped,
    Worker,
)
from spotdrain.protocol.kinds import ALL as KINDS
from spotdrain.protocol.machine import InvalidTransition

P = 1000.0  # the owner pauses
D = P + 120  # terminate_at for a pause
G = D - 10  # grace deadline
GATE = "10.0.0.7:9100"
PAUSE = NodeDrain("pause", G, D)


def new_worker(worker_id: str = "w-1", node_id: str = "gpu-7", now: float = 900.0) -> Worker:
    return Worker(
        worker_id=worker_id,
        node_id=node_id,
        model="llama-3-8b",
        image="registry.local/vllm:0.6",
        port=9100,
        capacity=8,
        created_at=now,
    )


def ready_worker(**kwargs: Any) -> Worker:
    worker = new_worker(**kwargs)
    worker.handle(Started(950.0, GATE, capacity=8))
    assert worker.state == READY
    return worker


class Like:
    """Equal to a WorkerEvent of this kind whose details include these values."""

    def __init__(self, kind: str, **details: Any) -> None:
        self.kind = kind
        self.details = details

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, WorkerEvent)
            and other.kind == self.kind
            and all(k in other.details and other.details[k] == v for k, v in self.details.items())
        )

    def __repr__(self) -> str:
        return f"Like({self.kind!r}, {self.details!r})"


def drain_on_node(worker: Worker, grace: float = G, end: float = D, reason: str = "pause"):
    return DrainOnNode(worker.worker_id, worker.node_id, grace, end, reason)


# --- stories -------------------------------------------------------------------------------


def test_a_worker_starts_serves_and_is_drained_when_the_owner_pauses() -> None:
    """The agent brings up a worker; routers get it. The owner pauses: routers drop it at once,
    the agent is told to drain its gate under the pause deadlines, and the stop ends it."""
    worker = new_worker()
    assert worker.handle(Started(950.0, GATE, capacity=8)) == [
        RouteAdded(Route("w-1", "gpu-7", "llama-3-8b", GATE, 8)),
        Like("worker_ready", node_id="gpu-7", worker_id="w-1", at=950.0),
    ]
    assert worker.handle(Heartbeat(955.0, "ready", slots_in_use=3, ttl_s=15)) == []
    assert (worker.slots_in_use, worker.expires_at) == (3, 970.0)

    assert worker.handle(Drain(P, NodeDrain("pause", G, D))) == [
        RouteRemoved("w-1"),
        drain_on_node(worker),
        Like("worker_draining", reason="pause", grace_deadline=G, terminate_at=D, at=P),
    ]
    assert worker.handle(SlotsChanged(P + 4, 0)) == []
    assert worker.handle(Stopped(P + 5, exit_code=0)) == [
        Like("worker_stopped", node_id="gpu-7", exit_code=0, slots_in_use_at_stop=0),
    ]
    assert (worker.state, worker.stopped_at, worker.exit_code) == (STOPPED, P + 5, 0)
    assert [(a, b) for _, _, a, b in worker.story] == [
        (STARTING, READY),
        (READY, DRAINING),
        (DRAINING, STOPPED),
    ]
    worker.validate()


def test_a_heartbeat_storm_claiming_ready_during_a_drain_changes_nothing() -> None:
    """An agent that has not heard of the drain keeps saying "ready", a thousand times. The
    worker stays draining (invariant 3), its expiry is refreshed, routers never get it back;
    the only thing the coordinator does is tell the agent about the drain again."""
    worker = ready_worker()
    worker.handle(Drain(P, NodeDrain("pause", G, D)))
    story_before = list(worker.story)
    for i in range(1000):
        now = P + i * 0.01
        effects = worker.handle(Heartbeat(now, "ready", slots_in_use=2, ttl_s=15))
        assert effects == [drain_on_node(worker)]
        assert worker.state == DRAINING
        assert worker.expires_at == now + 15
        assert (worker.grace_deadline, worker.terminate_at) == (G, D)
    assert worker.story == story_before  # heartbeats leave no trace in the story
    worker.validate()


def test_a_heartbeat_never_makes_a_starting_worker_ready() -> None:
    """The agent's heartbeat says "ready" before its Started arrives (the outbox is behind).
    Only Started makes a worker ready: routers must not see a worker whose gate is unknown."""
    worker = new_worker()
    assert worker.handle(Heartbeat(901.0, "ready", slots_in_use=0, ttl_s=15)) == []
    assert worker.state == STARTING and worker.expires_at == 916.0
    assert worker.handle(Heartbeat(902.0, "draining", slots_in_use=0, ttl_s=15)) == []
    assert worker.state == STARTING


def test_a_worker_that_starts_on_a_paused_node_is_drained_the_moment_it_appears() -> None:
    """The owner paused the node while a worker was being created. When the agent reports it
    started, it goes straight to draining under the node's own deadlines and is never routed
    (invariant 8), however loudly its heartbeats claim it is ready."""
    worker = new_worker()
    effects = worker.handle(Started(P + 3, GATE, capacity=8, node_drain=PAUSE))
    assert effects == [
        drain_on_node(worker),
        Like("worker_draining", reason="pause", grace_deadline=G, terminate_at=D, at=P + 3),
    ]
    assert worker.state == DRAINING and worker.gate_address == GATE
    for i in range(20):
        effects += worker.handle(Heartbeat(P + 4 + i, "ready", slots_in_use=0, ttl_s=15))
    effects += worker.handle(Stopped(P + 30, exit_code=0))
    assert not any(isinstance(e, RouteAdded) for e in effects)
    assert worker.state == STOPPED
    worker.validate()


def test_a_worker_on_a_tainted_node_is_drained_under_the_notice_deadlines() -> None:
    """A hard notice tainted the node; a worker that registers afterwards takes the notice's
    deadlines, not fresh ones of its own (invariant 2)."""
    worker = new_worker()
    notice = NodeDrain("notice", grace_deadline=1050.0, terminate_at=1060.0)
    worker.handle(Started(1001.0, GATE, capacity=8, node_drain=notice))
    assert (worker.state, worker.drain_reason) == (DRAINING, "notice")
    assert (worker.grace_deadline, worker.terminate_at) == (1050.0, 1060.0)


def test_a_second_drain_never_extends_the_deadlines() -> None:
    """The operator drains a node the owner already paused, with later deadlines. The pause's
    deadlines stand (invariant 2: never extended), and draining twice is not an error."""
    worker = ready_worker()
    worker.handle(Drain(P, NodeDrain("pause", G, D)))
    assert worker.handle(Drain(P + 30, NodeDrain("operator", G + 300, D + 300))) == []
    assert (worker.grace_deadline, worker.terminate_at, worker.drain_reason) == (G, D, "pause")
    assert worker.handle(Drain(P + 31, NodeDrain("pause", G, D))) == []  # the same drain again
    assert worker.story[-1] == (P + 31, "Drain(kept deadlines)", DRAINING, DRAINING)


def test_a_hard_notice_during_a_pause_shortens_the_drain() -> None:
    """The owner paused; 20 s later the provider sends a hard notice ending sooner than the
    pause's deadline. The earlier deadline replaces the later one and the agent is told; the
    worker still drains for the reason it first drained for (the pause)."""
    worker = ready_worker()
    worker.handle(Drain(P, NodeDrain("pause", G, D)))
    effects = worker.handle(Drain(P + 20, NodeDrain("notice", P + 50, P + 60)))
    assert effects == [
        DrainOnNode("w-1", "gpu-7", P + 50, P + 60, "pause"),
        Like("worker_draining", shortened_by="notice", grace_deadline=P + 50),
    ]
    assert (worker.grace_deadline, worker.terminate_at) == (P + 50, P + 60)
    # Only the earlier of each deadline is kept, even when a drain brings one earlier, one later.
    worker.handle(Drain(P + 21, NodeDrain("operator", P + 40, P + 90)))
    assert (worker.grace_deadline, worker.terminate_at) == (P + 40, P + 60)
    worker.validate()


def test_a_drain_that_beats_the_start_keeps_the_worker_out_of_the_routes() -> None:
    """The owner pauses while the container is still pulling its model. When Started arrives
    the worker stays draining, and the agent, whose gate only now exists, is told again."""
    worker = new_worker()
    assert worker.handle(Drain(P, NodeDrain("pause", G, D))) == [
        drain_on_node(worker),
        Like("worker_draining", reason="pause"),
    ]
    assert worker.handle(Started(P + 10, GATE, capacity=8)) == [drain_on_node(worker)]
    assert (worker.state, worker.gate_address) == (DRAINING, GATE)
    worker.validate()


def test_a_container_that_dies_while_starting_is_stopped_without_a_route() -> None:
    """The model server crashes on load. The worker never served, so no route is withdrawn."""
    worker = new_worker()
    assert worker.handle(Stopped(905.0, exit_code=137)) == [
        Like("worker_stopped", exit_code=137, worker_id="w-1"),
    ]
    assert worker.state == STOPPED and worker.grace_deadline is None


def test_a_ready_worker_that_crashes_is_withdrawn_from_the_routers() -> None:
    """A ready worker dies mid-stream: routers drop it, the event says how many slots it had."""
    worker = ready_worker()
    worker.handle(SlotsChanged(960.0, 5))
    assert worker.handle(Stopped(961.0, exit_code=139)) == [
        RouteRemoved("w-1"),
        Like("worker_stopped", exit_code=139, slots_in_use_at_stop=5),
    ]
    assert worker.slots_in_use == 0


def test_everything_that_arrives_after_the_stop_is_ignored() -> None:
    """Heartbeats, slot counts, drains and a late registration race with the stop; stopped is
    final and none of them raises."""
    worker = ready_worker()
    worker.handle(Drain(P, NodeDrain("pause", G, D)))
    worker.handle(Stopped(P + 5, exit_code=0))
    snapshot = worker.to_json()
    late: list[Any] = [
        Heartbeat(P + 6, "ready", slots_in_use=4, ttl_s=15),
        SlotsChanged(P + 6, 3),
        Drain(P + 7, NodeDrain("notice", P + 8, P + 9)),
        Started(P + 8, "10.0.0.8:9100", capacity=4),
        Started(P + 8, GATE, capacity=8, node_drain=PAUSE),
        Stopped(P + 9, exit_code=1),
    ]
    for event in late:
        assert worker.handle(event) == []
    assert worker.state == STOPPED and worker.exit_code == 0 and worker.stopped_at == P + 5
    assert (worker.grace_deadline, worker.terminate_at) == (G, D)
    assert worker.expires_at == snapshot["expires_at"] and worker.slots_in_use == 0
    # The races are on record; heartbeats and slot counts are not (they would drown the rest).
    assert worker.story[-5:] == [
        (P + 5, "Stopped", DRAINING, STOPPED),
        (P + 7, "Drain(ignored)", STOPPED, STOPPED),
        (P + 8, "Started(ignored)", STOPPED, STOPPED),
        (P + 8, "Started(ignored)", STOPPED, STOPPED),
        (P + 9, "Stopped(ignored)", STOPPED, STOPPED),
    ]


def test_an_agent_that_reconnects_with_a_new_gate_address_moves_the_route() -> None:
    """After an agent restart the worker's gate listens on a new port. The route is replaced;
    a re-registration with nothing new publishes nothing."""
    worker = ready_worker()
    assert worker.handle(Started(960.0, GATE, capacity=8)) == []
    assert worker.handle(Started(970.0, "10.0.0.7:9200", capacity=8)) == [
        RouteAdded(Route("w-1", "gpu-7", "llama-3-8b", "10.0.0.7:9200", 8)),
    ]
    assert worker.state == READY


def test_a_ready_worker_that_reregisters_on_a_paused_node_is_drained() -> None:
    """The coordinator restarted while the node was paused and the agent registers its worker
    again: it is drained the moment it appears (invariant 8)."""
    worker = ready_worker()
    assert worker.handle(Started(P + 2, GATE, capacity=8, node_drain=PAUSE)) == [
        RouteRemoved("w-1"),
        drain_on_node(worker),
        Like("worker_draining", reason="pause"),
    ]
    assert worker.state == DRAINING


def test_the_worker_survives_a_round_trip_through_the_store_mid_drain() -> None:
    """The coordinator stores the worker after every event; a restarted coordinator carries on
    with the same deadlines and the same story (invariant 8)."""
    worker = ready_worker()
    worker.handle(Heartbeat(960.0, "ready", slots_in_use=2, ttl_s=15))
    worker.handle(Drain(P, NodeDrain("pause", G, D)))
    reloaded = Worker.from_json(json.loads(json.dumps(worker.to_json())))
    assert reloaded == worker
    # Carries on: a later drain still cannot extend the reloaded deadlines.
    reloaded.handle(Drain(P + 1, NodeDrain("operator", G + 100, D + 100)))
    assert (reloaded.grace_deadline, reloaded.terminate_at) == (G, D)
    with pytest.raises(ValueError, match="unknown fields"):
        Worker.from_json({**worker.to_json(), "colour": "blue"})
    with pytest.raises(ValueError, match="unknown state"):
        Worker.from_json({**worker.to_json(), "state": "resting"})


def test_the_story_keeps_only_the_most_recent_entries() -> None:
    """Repeated drains on a long-draining worker must not grow its record without bound."""
    worker = ready_worker()
    worker.handle(Drain(P, NodeDrain("pause", G, D)))
    for i in range(200):
        worker.handle(Drain(P + i, NodeDrain("operator", G + 1, D + 1)))
    assert len(worker.story) == STORY_LIMIT
    assert worker.story[-1] == (P + 199, "Drain(kept deadlines)", DRAINING, DRAINING)


def test_an_expired_worker_is_told_by_its_heartbeat_ttl() -> None:
    worker = ready_worker()
    assert not worker.expired(960.0)  # never heartbeated: no expiry yet
    worker.handle(Heartbeat(960.0, "ready", slots_in_use=0, ttl_s=15))
    assert not worker.expired(974.9) and worker.expired(975.0)


@pytest.mark.parametrize(
    "build",
    [
        lambda: Drain(P, NodeDrain("vacation", G, D)),
        lambda: Drain(P, NodeDrain("pause", D + 1, D)),
        lambda: NodeDrain("pause", D + 1, D),
        lambda: Started(P, "", capacity=8),
        lambda: Started(P, GATE, capacity=0),
        lambda: Heartbeat(P, "serving", slots_in_use=0, ttl_s=15),
        lambda: Heartbeat(P, "ready", slots_in_use=-1, ttl_s=15),
        lambda: Heartbeat(P, "ready", slots_in_use=0, ttl_s=0),
        lambda: SlotsChanged(P, -1),
    ],
    ids=[
        "unknown drain reason",
        "grace after terminate",
        "node drain grace after terminate",
        "no gate address",
        "no slots",
        "unknown claimed state",
        "negative slots",
        "zero ttl",
        "negative slot change",
    ],
)
def test_a_malformed_event_is_a_programmer_error_caught_when_it_is_built(build: Any) -> None:
    """The shell converts wire messages into events; a bad one fails there, with the reason,
    never deep inside a worker's transition."""
    with pytest.raises(ValueError):
        build()


def test_something_that_is_not_an_event_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        new_worker().handle("drain please")  # type: ignore[arg-type]


# --- the transition table ------------------------------------------------------------------


def worker_in(state: str) -> Worker:
    worker = new_worker()
    worker.state = state
    worker.gate_address = GATE
    worker.story.append((901.0, "Seeded", STARTING, state))
    if state in (DRAINING, STOPPED):
        worker.drain_reason, worker.grace_deadline, worker.terminate_at = "pause", G, D
    return worker


ALLOWED = {
    (STARTING, READY): [RouteAdded(Route("w-1", "gpu-7", "llama-3-8b", GATE, 8))],
    (STARTING, DRAINING): [],
    (READY, DRAINING): [RouteRemoved("w-1")],
    (STARTING, STOPPED): [],
    (READY, STOPPED): [RouteRemoved("w-1")],
    (DRAINING, STOPPED): [],
}


def test_the_table_is_exactly_the_documented_one() -> None:
    assert set(TRANSITIONS) == set(ALLOWED)


@pytest.mark.parametrize(
    ("start", "finish"), [(a, b) for a in STATES for b in STATES], ids=lambda s: s
)
def test_every_start_finish_pair(start: str, finish: str) -> None:
    """Allowed moves change the state and carry their routing effects; every other move (a
    self-move, anything out of stopped, draining back to ready) raises InvalidTransition whose
    message tells the worker's story."""
    worker = worker_in(start)
    if (start, finish) in ALLOWED:
        assert worker.transition(finish, 1001.0, "Test") == ALLOWED[start, finish]
        assert worker.state == finish
        assert worker.story[-1] == (1001.0, "Test", start, finish)
        return
    with pytest.raises(InvalidTransition) as caught:
        worker.transition(finish, 1001.0, "Test")
    assert worker.state == start
    message = str(caught.value)
    assert f"{start} -> {finish}" in message and "w-1" in message
    assert "Seeded" in message and "Test(invalid)" in message
    assert caught.value.story == worker.story


# --- the stateful test ---------------------------------------------------------------------

WORKER_IDS = ("w-a", "w-b", "w-c")
times = st.floats(min_value=0, max_value=30, allow_nan=False)
offsets = st.floats(min_value=0, max_value=200, allow_nan=False)
reasons = st.sampled_from(("pause", "notice", "operator"))
slots = st.integers(min_value=0, max_value=8)


class WorkerRegistry(RuleBasedStateMachine):
    """A few workers, any sequence of events at non-decreasing times.

    The model keeps the routing table as the effects build it and what each worker has been,
    and checks after every step: routes exist for exactly the ready workers, a worker that has
    drained is never ready again, stopped is final, deadlines never move later, and no event
    raises (InvalidTransition included)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 900.0
        self.workers = {w: new_worker(w, node_id=f"node-{w}", now=self.now) for w in WORKER_IDS}
        self.routes: dict[str, Route] = {}
        self.has_drained: set[str] = set()
        self.has_stopped: set[str] = set()
        self.deadlines: dict[str, tuple[float, float]] = {}

    def apply(self, worker_id: str, dt: float, event_for: Any) -> list[Effect]:
        self.now += dt
        worker = self.workers[worker_id]
        effects = worker.handle(event_for(self.now))
        for effect in effects:
            match effect:
                case RouteAdded(route):
                    assert route.worker_id == worker_id
                    self.routes[worker_id] = route
                case RouteRemoved(removed):
                    assert removed in self.routes, f"{removed} removed but never routed"
                    del self.routes[removed]
                case DrainOnNode():
                    # The agent is always told the deadlines the coordinator holds now.
                    assert effect.worker_id == worker_id
                    assert (effect.grace_deadline, effect.terminate_at) == (
                        worker.grace_deadline,
                        worker.terminate_at,
                    )
                case WorkerEvent():
                    assert effect.details["worker_id"] == worker_id
                case _:
                    raise TypeError(effect)
        if worker.state == DRAINING:
            self.has_drained.add(worker_id)
        if worker.state == STOPPED:
            self.has_stopped.add(worker_id)
        if worker.grace_deadline is not None:
            assert worker.terminate_at is not None
            before = self.deadlines.get(worker_id)
            if before is not None:
                assert worker.grace_deadline <= before[0] and worker.terminate_at <= before[1]
            self.deadlines[worker_id] = (worker.grace_deadline, worker.terminate_at)
        return effects

    @rule(
        worker_id=st.sampled_from(WORKER_IDS),
        dt=times,
        port=st.sampled_from((9100, 9200)),
        capacity=st.integers(min_value=1, max_value=8),
        node_drain=st.none() | st.tuples(reasons, offsets, offsets),
    )
    def started(
        self,
        worker_id: str,
        dt: float,
        port: int,
        capacity: int,
        node_drain: tuple[str, float, float] | None,
    ) -> None:
        def event(now: float) -> Started:
            drain = None
            if node_drain is not None:
                reason, grace_in, gap = node_drain
                drain = NodeDrain(reason, now + grace_in, now + grace_in + gap)
            return Started(now, f"10.0.0.1:{port}", capacity, node_drain=drain)

        self.apply(worker_id, dt, event)
        if node_drain is not None:  # invariant 8: drained the moment it appears
            assert self.workers[worker_id].state in (DRAINING, STOPPED)

    @rule(
        worker_id=st.sampled_from(WORKER_IDS),
        dt=times,
        claimed=st.sampled_from(STATES),
        slots_in_use=slots,
        ttl=st.floats(min_value=1, max_value=60),
    )
    def heartbeat(
        self, worker_id: str, dt: float, claimed: str, slots_in_use: int, ttl: float
    ) -> None:
        state = self.workers[worker_id].state
        effects = self.apply(worker_id, dt, lambda now: Heartbeat(now, claimed, slots_in_use, ttl))
        assert self.workers[worker_id].state == state  # invariant 3
        assert all(isinstance(e, DrainOnNode) for e in effects)

    @rule(
        worker_id=st.sampled_from(WORKER_IDS),
        dt=times,
        reason=reasons,
        grace_in=offsets,
        gap=offsets,
    )
    def drain(self, worker_id: str, dt: float, reason: str, grace_in: float, gap: float) -> None:
        self.apply(
            worker_id,
            dt,
            lambda now: Drain(now, NodeDrain(reason, now + grace_in, now + grace_in + gap)),
        )
        assert self.workers[worker_id].state in (DRAINING, STOPPED)

    @rule(
        worker_id=st.sampled_from(WORKER_IDS),
        dt=times,
        exit_code=st.none() | st.integers(min_value=0, max_value=255),
    )
    def stopped(self, worker_id: str, dt: float, exit_code: int | None) -> None:
        self.apply(worker_id, dt, lambda now: Stopped(now, exit_code))

    @rule(worker_id=st.sampled_from(WORKER_IDS), dt=times, slots_in_use=slots)
    def slots_changed(self, worker_id: str, dt: float, slots_in_use: int) -> None:
        state = self.workers[worker_id].state
        assert self.apply(worker_id, dt, lambda now: SlotsChanged(now, slots_in_use)) == []
        assert self.workers[worker_id].state == state

    @rule(worker_id=st.sampled_from(WORKER_IDS))
    def coordinator_restarts(self, worker_id: str) -> None:
        """The worker is read back from the store: nothing about it may change."""
        worker = self.workers[worker_id]
        reloaded = Worker.from_json(json.loads(json.dumps(worker.to_json())))
        assert reloaded == worker
        self.workers[worker_id] = reloaded

    @invariant()
    def routes_are_exactly_the_ready_workers(self) -> None:
        ready = {w for w, worker in self.workers.items() if worker.state == READY}
        assert set(self.routes) == ready
        for worker_id in ready:
            assert self.routes[worker_id] == self.workers[worker_id].route()

    @invariant()
    def a_drained_worker_is_never_ready_and_stopped_is_final(self) -> None:
        for worker_id in self.has_drained:
            assert self.workers[worker_id].state in (DRAINING, STOPPED)
        for worker_id in self.has_stopped:
            assert self.workers[worker_id].state == STOPPED

    @invariant()
    def each_worker_is_consistent(self) -> None:
        for worker in self.workers.values():
            worker.validate()


WorkerRegistry.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_worker_registry = WorkerRegistry.TestCase


# --- the placement gate --------------------------------------------------------------------


def node(**overrides: Any) -> NodeView:
    fields: dict[str, Any] = {
        "node_id": "gpu-7",
        "workload_enabled": True,
        "tainted": False,
        "spot": True,
        "connected": True,
        "gpus_total": 8,
        "gpus_in_use": 6,
    }
    fields.update(overrides)
    return NodeView(**fields)


ADMIT_CASES = [
    # (story, node, kind, gpus, expected)
    ("a healthy spot node takes inference", node(), "inference", 1, None),
    ("it fills up to the last free GPU", node(), "batch", 2, None),
    ("a rental may go on spot (invariant 9)", node(), "rental", 1, None),
    ("the owner paused the node", node(workload_enabled=False), "inference", 1, WORKLOAD_DISABLED),
    ("a notice tainted the node", node(tainted=True), "batch", 1, TAINTED),
    ("render is never placed on spot", node(), "render", 1, RENDER_ON_SPOT),
    ("render goes on on-demand", node(spot=False), "render", 1, None),
    ("the node's agent is not connected", node(connected=False), "inference", 1, NOT_CONNECTED),
    ("its group was reclaimed a moment ago", node(group_avoided=True), "rental", 1, GROUP_AVOIDED),
    ("render on spot says why first", node(group_avoided=True), "render", 1, RENDER_ON_SPOT),
    ("no double booking", node(), "inference", 3, NOT_ENOUGH_GPUS),
    ("a full node", node(gpus_in_use=8), "rental", 1, NOT_ENOUGH_GPUS),
    ("an over-booked node is full, not negative", node(gpus_in_use=9), "batch", 1, NOT_ENOUGH_GPUS),
    ("a CPU-only request fits a full node", node(gpus_in_use=8), "inference", 0, None),
    (
        "the pause wins over everything else",
        node(workload_enabled=False, tainted=True, connected=False, gpus_in_use=8),
        "render",
        1,
        WORKLOAD_DISABLED,
    ),
    (
        "a taint wins over policy and capacity",
        node(tainted=True, connected=False, gpus_in_use=8),
        "render",
        1,
        TAINTED,
    ),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("story", "view", "kind", "gpus", "expected"), ADMIT_CASES, ids=[c[0] for c in ADMIT_CASES]
)
def test_admit(story: str, view: NodeView, kind: str, gpus: int, expected: str | None, path: str):
    """One gate for every path (invariant 4): an operator's request, a worker restarted after a
    rental, the recovery loop, a node re-registering after a reboot all get the same answer."""
    assert admit(view, PlacementRequest(kind, gpus=gpus, path=path)) == expected


def test_every_kind_is_refused_on_a_paused_node() -> None:
    for kind in KINDS:
        assert admit(node(workload_enabled=False), PlacementRequest(kind)) == WORKLOAD_DISABLED


@pytest.mark.parametrize(
    "fields",
    [{"kind": "mining"}, {"kind": "batch", "path": "backdoor"}, {"kind": "batch", "gpus": -1}],
    ids=["unknown kind", "unknown path", "negative gpus"],
)
def test_a_malformed_placement_request_is_refused_when_built(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        PlacementRequest(**fields)
