"""What can be done to the fleet from outside, as plain async methods: the servicers
(coordinator/api/admin.py, public.py, agent_link.py) and the dashboard call these same ones, so an
action has one set of checks, one set of events and one answer whoever asks for it.

Nothing here knows gRPC or protobuf: the servicers convert and check the request's bounds
(coordinator/api/convert.py) and map the domain errors raised here (coordinator/api/errors.py).
A read changes nothing: neither the store nor the fleet's memory.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spotdrain.coordinator.api.errors import BadRequest, NotFound, Precondition
from spotdrain.coordinator.capacity.contracts import ContractPolicy
from spotdrain.coordinator.core import reputation
from spotdrain.coordinator.core import worker_machine as wm
from spotdrain.coordinator.fleet.drains import TaintAnswer
from spotdrain.coordinator.fleet.eventlog import EventLog
from spotdrain.coordinator.fleet.wiring import Fleet
from spotdrain.coordinator.store import ContractRow, EventRow, ModelRow, NodeRow, Store, TaintRow
from spotdrain.protocol import timing

# A long listing yields to the event loop this often: a Taint is never held behind it.
YIELD_EVERY = 500
# Slots of a model's worker when its first setting names none.
DEFAULT_SLOTS = 4
# Reclamation ids of the operator's pauses (the dashboard's): the operator's resume ends these
# and no other (a pause the host's owner made with `spotctl pause` is the owner's to end).
OPERATOR_PAUSE = "dashboard-pause-"


@dataclass(frozen=True)
class NodeStatus:
    """A node as the operators see it: its record and what the fleet knows of it now."""

    row: NodeRow
    taints: list[TaintRow]
    connected_at: float | None
    live_workers: int
    active_rentals: int
    avoided_until: float


@dataclass(frozen=True)
class ModelStatus:
    row: ModelRow
    ready: int
    starting: int
    draining: int


@dataclass(frozen=True)
class ContractsReport:
    policy: ContractPolicy
    rows: list[ContractRow]


class Operations:
    def __init__(
        self, store: Store, fleet: Fleet, events: EventLog, clock: Callable[[], float]
    ) -> None:
        self.store = store
        self.fleet = fleet
        self.events = events
        self.clock = clock

    # --- nodes ------------------------------------------------------------------------------

    def node_status(self, row: NodeRow, active_rentals: int) -> NodeStatus:
        nodes = self.fleet.nodes
        return NodeStatus(
            row,
            nodes.node_taints(row.node_id),
            nodes.connected.get(row.node_id),
            self.fleet.registry.count(row.node_id),
            active_rentals,
            nodes.avoided_now().get(row.node_group, 0.0),
        )

    async def active_rentals(self) -> dict[str, list[Any]]:
        """The active rentals by node: bounded by the fleet's GPUs, one read."""
        out: dict[str, list[Any]] = {}
        for rental in await self.fleet.rentals.list(active_only=True):
            out.setdefault(rental.node_id, []).append(rental)
        return out

    async def nodes(self) -> list[NodeStatus]:
        rows = await self.store.nodes()
        active = await self.active_rentals()
        out = []
        for i, row in enumerate(rows):
            if i % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)
            out.append(self.node_status(row, len(active.get(row.node_id, []))))
        return out

    def known_node(self, node_id: str) -> NodeRow:
        row = self.fleet.nodes.rows.get(node_id)
        if row is None:
            raise NotFound(f"no node {node_id!r}")
        return row

    async def set_spot(self, node_id: str, spot: bool) -> NodeStatus:
        """The operator's spot flag; refused under a rental (invariant 9) or a render job."""
        row = await self.fleet.drains.set_spot(node_id, spot)
        active = await self.fleet.rentals.list(node_id, active_only=True)
        return self.node_status(row, len(active))

    # --- pauses and taints ------------------------------------------------------------------

    async def taint(
        self, node_id: str, reclaim_id: str, reason: str, terminate_at: float, grace: float
    ) -> TaintAnswer:
        """A node's reclamation taints it (a notice, the owner's pause): answered once stored."""
        return await self.fleet.drains.taint(node_id, reclaim_id, reason, terminate_at, grace)

    async def lift_taint(
        self, node_id: str, reclaim_id: str, reason: str, terminate_at: float, grace: float
    ) -> TaintAnswer:
        """A node's reclamation is over before its deadline (a cancelled notice)."""
        return await self.fleet.drains.lift_taint(node_id, reclaim_id, reason, terminate_at, grace)

    async def end_pause(self, node_id: str, reclaim_id: str) -> bool:
        """The owner's resume; the workload flag as it is now."""
        return await self.fleet.drains.end_pause(node_id, reclaim_id)

    def _operator_pauses(self, node_id: str) -> list[str]:
        return [
            t.reclaim_id
            for t in self.fleet.nodes.node_taints(node_id)
            if t.reclaim_id.startswith(OPERATOR_PAUSE)
        ]

    async def operator_pause(self, node_id: str) -> str:
        """The operator's pause: the node's workload flag off and its workers drained, as a
        host's pause does at the coordinator, with D = now + the owner's promise."""
        self.known_node(node_id)
        held = self._operator_pauses(node_id)
        if held:
            raise Precondition(f"node {node_id} is paused from the dashboard already ({held[0]})")
        reclaim_id = f"{OPERATOR_PAUSE}{uuid.uuid4().hex[:12]}"
        terminate_at = self.clock() + timing.NOTICE_S
        await self.taint(node_id, reclaim_id, "pause", terminate_at, terminate_at - timing.GRACE_S)
        return reclaim_id

    async def operator_resume(self, node_id: str) -> bool:
        """Ends the operator's pauses of the node (never its owner's); the workload flag as it
        is now."""
        self.known_node(node_id)
        ours = self._operator_pauses(node_id)
        if not ours:
            taints = self.fleet.nodes.node_taints(node_id)
            owner = [t.reclaim_id for t in taints if t.reason == "pause"]
            if owner:
                raise Precondition(
                    f"node {node_id} is paused by its owner on the host ({owner[0]}): "
                    "resume it there (spotctl resume)"
                )
            raise Precondition(f"node {node_id} is not paused from the dashboard")
        enabled = False
        for reclaim_id in ours:
            enabled = await self.end_pause(node_id, reclaim_id)
        return enabled

    # --- models -----------------------------------------------------------------------------

    async def model(self, model: str) -> ModelStatus:
        row = await self.store.model(model)
        if row is None:
            raise NotFound(f"no model {model!r}")
        states = [w.state for w in self.fleet.live_workers() if w.model == model]
        return ModelStatus(
            row, states.count(wm.READY), states.count(wm.STARTING), states.count(wm.DRAINING)
        )

    async def models(self) -> list[ModelStatus]:
        return [await self.model(m.model) for m in await self.store.models()]

    async def set_replicas(self, model: str, replicas: int, image: str, slots: int) -> ModelStatus:
        """A model's desired count; its image and slots kept from before when not given (an
        image is needed the first time). Capacity is kept before the answer."""
        known = await self.store.model(model)
        image = image or (known.image if known else "")
        if not model or not image:
            raise BadRequest("a model name is needed, and an image the first time a model is set")
        slots = slots or (known.slots if known else DEFAULT_SLOTS)
        await self.store.set_model(model, replicas, image, slots)
        await self.events.record("model_replicas_set", "", {"model": model, "replicas": replicas})
        await self.fleet.capacity.keep(path="operator")
        return await self.model(model)

    # --- reading what happened --------------------------------------------------------------

    async def timeline(self, reclaim_id: str) -> tuple[dict[str, Any], list[EventRow]]:
        record = await self.store.reclamation(reclaim_id)
        if record is None:
            what = f"reclamation {reclaim_id!r}" if reclaim_id else "reclamation"
            raise NotFound(f"no {what} recorded")
        return record, await self.store.events_of(record["reclaim_id"])

    async def _outcomes(self) -> list[reputation.RentalOutcome]:
        return [
            reputation.RentalOutcome(
                d["rental_id"],
                d["node_id"],
                d["provider"],
                d["started_on_spot"],
                d["ended_by"] or None,
            )
            for d in await self.store.rental_docs()
        ]

    async def node_reputation(self, node_id: str) -> reputation.Score:
        """A node's score over the rentals it ended or kept."""
        outcomes = await self._outcomes()
        self.known_node(node_id)
        return reputation.node_score(outcomes, node_id)

    async def provider_reputation(self, provider: str) -> reputation.Score:
        outcomes = await self._outcomes()
        rows = self.fleet.nodes.rows.values()
        if provider not in {n.owner for n in rows} | {o.provider for o in outcomes}:
            raise NotFound(f"no provider {provider!r}")
        return reputation.provider_score(outcomes, provider)

    async def contracts(self) -> ContractsReport:
        """Every image's contract as stored now. The fleet's own view (the gate's, the
        metrics') is refreshed where the counts change, not here."""
        return ContractsReport(self.fleet.contracts.policy, await self.store.contracts())
