"""The one placement gate (docs/design.md invariant 4), as the fleet runs it.

Every path that puts a workload on a node comes through `Gate.admit`: the pure rules are in
coordinator/core/admission.py; this records a refusal with its path and raises. `place_worker` is
the only function that creates a worker.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

from spotdrain.coordinator.core import messages as msg
from spotdrain.coordinator.core import worker_machine as wm
from spotdrain.coordinator.core.admission import PlacementRequest, admit
from spotdrain.coordinator.fleet.registry import (
    FleetState,
    NoFreePort,
    SaveWorker,
    SendCommand,
)
from spotdrain.protocol import kinds

log = logging.getLogger("spotdrain.coordinator.fleet.placer")


class PlacementRefused(Exception):
    def __init__(self, node_id: str, reason: str) -> None:
        super().__init__(f"placement on {node_id} refused: {reason}")
        self.node_id = node_id
        self.reason = reason


class Gate:
    def __init__(
        self,
        state: FleetState,
        save: SaveWorker,
        send: SendCommand,
        keeps_off_spot: Callable[[str, str], bool],
    ) -> None:
        self.events, self.clock, self.nodes = state.events, state.clock, state.nodes
        self.registry = state.registry
        self.save = save
        self.send = send
        # Whether an image is kept off spot nodes (the contracts' judgement, --no-spot-for-flagged).
        self.keeps_off_spot = keeps_off_spot

    async def admit(self, node_id: str, request: PlacementRequest, what: dict[str, Any]) -> None:
        """The gate's answer for `request` on `node_id`; a refusal is recorded and raised."""
        view = self.nodes.view(node_id)
        why = "unknown_node" if view is None else admit(view, request)
        if why is not None:
            await self.events.record(
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
        off_spot = self.keeps_off_spot(image, kind)
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
        request = self.request_for(image, kind, path)
        await self.admit(node_id, request, {"model": model, "image": image})
        if not port:
            try:
                port = self.registry.free_port(node_id)
            except NoFreePort:
                raise PlacementRefused(node_id, "no_free_port") from None
        worker = wm.Worker(
            worker_id=f"w-{uuid.uuid4().hex[:10]}",
            node_id=node_id,
            model=model,
            image=image,
            port=port,
            capacity=max(capacity, 1),
            created_at=self.clock(),
            kind=kind,
        )
        # Booked in memory first: a placement running beside this one sees the GPU taken.
        self.registry.add(worker)
        self.nodes.load_changed(node_id)
        await self.save(worker)
        await self.events.record(
            "worker_starting",
            node_id,
            {"worker_id": worker.worker_id, "model": model, "path": path, "workload": kind},
            "",
        )
        self.send(
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

    async def place_again(self, worker: wm.Worker, path: str) -> wm.Worker | None:
        """A worker like `worker` (its model, image, capacity and kind) placed again on its
        node: a node back from a reboot, a resumed pause. A refusal is logged and the caller
        goes on with its other workers."""
        try:
            return await self.place_worker(
                worker.node_id,
                worker.model,
                worker.image,
                worker.capacity,
                path=path,
                kind=worker.kind,
            )
        except PlacementRefused as e:
            log.info("%s of %s: %s", path, worker.node_id, e)
            return None
