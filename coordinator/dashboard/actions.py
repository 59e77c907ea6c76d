"""What the dashboard reads and changes, through the code the gRPC API runs.

Reads and the operator's actions call the servicers' own methods (AdminServicer: GetTimeline,
ListModels, SetNodeSpot, SetModelReplicas), with the operator identity the dashboard's token
stands for, so each action meets the API's own checks and its refusals carry the API's own
words (a spot change on a rented node: FAILED_PRECONDITION and the rentals that hold it). A
pause and a resume call what AgentLink.Taint and SetWorkload call (Drains.taint, end_pause).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from spotdrain.coordinator.api import convert
from spotdrain.coordinator.api.admin import AdminServicer
from spotdrain.coordinator.api.agent_link import Coordinator
from spotdrain.protocol import timing
from spotdrain.v1 import spotdrain_pb2 as pb

# Reclamation ids of the pauses the dashboard starts: its resume ends these and no other (a
# pause the host's owner made with `spotctl pause` is the owner's to end).
DASHBOARD_PAUSE = "dashboard-pause-"


class ApiRefused(Exception):
    """The API said no: its status code and its message, as a gRPC caller would see them."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}


class OperatorContext:
    """What a servicer asks of its gRPC context, one per call: who calls (the dashboard's
    operator, whose token the dashboard checked), and the status a refusal sets, which
    `raise_refusal` turns into ApiRefused."""

    def __init__(self, name: str = "dashboard") -> None:
        self._common_name = f"operator:{name}".encode()
        self._code = grpc.StatusCode.OK
        self._details = ""

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"x509_common_name": [self._common_name]}

    def peer(self) -> str:
        return "dashboard"

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise ApiRefused(code, details)

    def raise_refusal(self) -> None:
        if self._code != grpc.StatusCode.OK:
            raise ApiRefused(self._code, self._details)


class Api:
    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self.admin = AdminServicer(coord)

    @staticmethod
    async def _call(method: Callable[[Any, Any], Awaitable[Any]], request: Any) -> Any:  # noqa: ANN401
        """A servicer method as the dashboard's operator: its answer, or its refusal raised."""
        context = OperatorContext()
        answer = await method(request, context)
        context.raise_refusal()
        return answer

    # --- reads ------------------------------------------------------------------------------

    async def timeline(self, reclaim_id: str) -> pb.Timeline:
        request = pb.GetTimelineRequest(reclaim_id=convert.check_id(reclaim_id, "reclaim_id"))
        return await self._call(self.admin.GetTimeline, request)

    async def models(self) -> list[pb.Model]:
        return list((await self._call(self.admin.ListModels, pb.ListModelsRequest())).models)

    # --- actions ----------------------------------------------------------------------------

    async def set_spot(self, node_id: str, spot: bool) -> pb.Node:
        request = pb.SetNodeSpotRequest(node_id=node_id, spot=spot)
        return await self._call(self.admin.SetNodeSpot, request)

    async def set_replicas(self, model: str, replicas: int, image: str, slots: int) -> pb.Model:
        request = pb.SetModelReplicasRequest(
            model=model, replicas=replicas, image=image, slots=slots
        )
        return await self._call(self.admin.SetModelReplicas, request)

    async def pause(self, node_id: str) -> str:
        """The operator's pause: the node's workload flag off and its workers drained, as a
        host's pause does at the coordinator, with D = now + 120 s (the owner's promise)."""
        fleet = self.coord.fleet
        self._known(node_id)
        held = [
            t.reclaim_id
            for t in fleet.nodes.node_taints(node_id)
            if t.reclaim_id.startswith(DASHBOARD_PAUSE)
        ]
        if held:
            raise ApiRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {node_id} is paused from the dashboard already ({held[0]})",
            )
        reclaim_id = f"{DASHBOARD_PAUSE}{uuid.uuid4().hex[:12]}"
        terminate_at = self.coord.clock() + timing.NOTICE_S
        await fleet.drains.taint(
            node_id, reclaim_id, "pause", terminate_at, terminate_at - timing.GRACE_S
        )
        return reclaim_id

    async def resume(self, node_id: str) -> bool:
        """Ends the dashboard's pauses of the node (never its owner's); the workload flag as it
        is now."""
        fleet = self.coord.fleet
        self._known(node_id)
        ours = [
            t.reclaim_id
            for t in fleet.nodes.node_taints(node_id)
            if t.reclaim_id.startswith(DASHBOARD_PAUSE)
        ]
        if not ours:
            owner = [t.reclaim_id for t in fleet.nodes.node_taints(node_id) if t.reason == "pause"]
            why = (
                (
                    f"node {node_id} is paused by its owner on the host ({owner[0]}): "
                    "resume it there (spotctl resume)"
                )
                if owner
                else (f"node {node_id} is not paused from the dashboard")
            )
            raise ApiRefused(grpc.StatusCode.FAILED_PRECONDITION, why)
        enabled = False
        for reclaim_id in ours:
            enabled = await fleet.drains.end_pause(node_id, reclaim_id)
        return enabled

    def _known(self, node_id: str) -> None:
        convert.check_id(node_id, "node_id")
        if node_id not in self.coord.fleet.nodes.rows:
            raise ApiRefused(grpc.StatusCode.NOT_FOUND, f"no node {node_id!r}")
