"""The one placement gate (docs/design.md invariant 4), as the fleet runs it.

Every path that puts a workload on a node comes through `Gate.admit`: the pure rules are in
coordinator/core/admission.py; this records a refusal with its path and raises. `place_worker` is
the only function that creates a worker.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from spotdrain.coordinator.core import messages as msg
from spotdrain.coordinator.core import worker_machine as wm
from spotdrain.coordinator.core.admission import PlacementRequest, admit
from spotdrain.coordinator.fleet.registry import NoFreePort
from spotdrain.protocol import kinds

if TYPE_CHECKING:
    from spotdrain.coordinator.fleet.wiring import Fleet


class PlacementRefused(Exception):
    def __init__(self, node_id: str, reason: str) -> None:
        super().__init__(f"placement on {node_id} refused: {reason}")
        self.node_id = node_id
        self.reason = reason


class Gate:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    async def admit(self, node_id: str, request: PlacementRequest, what: dict[str, Any]) -> None:
        """The gate's answer for `request` on `node_id`; a refusal is recorded and raised."""
        view = self.fleet.nodes.view(node_id)
        why = "unknown_node" if view is None else admit(view, request)
        if why is not None:
            await self.fleet.record(
                "placement_refused",
                node_id,
                {**what, "workload": request.kind, "path": request.path, "reason": why},
                "",
            )
            raise PlacementRefused(node_id, why)

    def request_for(self, image: str, kind: str, path: str) -> PlacementRequest:
        """What a worker of `image` asks of a node. Callers that pick a node first (capacity,
        recovery) ask with the same request, so the node they pick is one the gate admits: a
        flagged image is kept off spot nodes (--no-spot-for-flagged) in the pick as well."""
        off_spot = self.fleet.contracts.keeps_off_spot(image, kind)
        return PlacementRequest(kind=kind, gpus=1, path=path, off_spot=off_spot)

    async def place_worker(
        self,
        node_id: str,
        model: str,
        image: str,
        capacity: int,
        port: int = 0,
        path: str = "operator",
        kind: str = "inference",
    ) -> wm.Worker:
        """Every path that puts a worker on a node comes through here (docs/design.md,
        invariant 4)."""
        if kind not in kinds.WORKERS:
            raise ValueError(f"worker kind must be one of {kinds.WORKERS}, got {kind!r}")
        fleet = self.fleet
        request = self.request_for(image, kind, path)
        await self.admit(node_id, request, {"model": model, "image": image})
        if not port:
            try:
                port = fleet.registry.free_port(node_id)
            except NoFreePort:
                raise PlacementRefused(node_id, "no_free_port") from None
        worker = wm.Worker(
            worker_id=f"w-{uuid.uuid4().hex[:10]}",
            node_id=node_id,
            model=model,
            image=image,
            port=port,
            capacity=max(capacity, 1),
            created_at=fleet.clock(),
            kind=kind,
        )
        # Booked in memory first: a placement running beside this one sees the GPU taken.
        fleet.registry.add(worker)
        fleet.nodes.load_changed(node_id)
        await fleet.save(worker)
        await fleet.record(
            "worker_starting",
            node_id,
            {"worker_id": worker.worker_id, "model": model, "path": path, "workload": kind},
            "",
        )
        fleet.send(
            node_id,
            msg.StartWorker(
                worker_id=worker.worker_id,
                model=model,
                image=image,
                port=port,
                capacity=worker.capacity,
                kind=kind,
            ),
        )
        return worker
