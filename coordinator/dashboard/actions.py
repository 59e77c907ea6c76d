"""What the dashboard reads and changes: the operations the gRPC API runs
(coordinator/api/operations.py), called directly as the dashboard's operator, whose token the
dashboard checked. Each action meets the API's own checks, and a refusal is the API's own domain
error with its own words (a spot change on a rented node: FAILED_PRECONDITION and the rentals
that hold it), mapped to an HTTP status here. Answers are converted as the API converts them, so
the pages draw what a gRPC caller would see.
"""

from __future__ import annotations

import grpc

from spotdrain.coordinator.api import convert
from spotdrain.coordinator.api.errors import status_for
from spotdrain.coordinator.api.operations import Operations
from spotdrain.v1 import spotdrain_pb2 as pb

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


def http_refusal(error: BaseException) -> tuple[int, grpc.StatusCode, str]:
    """An error as the API maps it, and the HTTP status that says the same."""
    code, text = status_for(error)
    return HTTP_STATUS.get(code, 500), code, text


class Api:
    def __init__(self, ops: Operations) -> None:
        self.ops = ops

    # --- reads ------------------------------------------------------------------------------

    async def timeline(self, reclaim_id: str) -> pb.Timeline:
        reclaim_id = convert.check_id(reclaim_id, "reclaim_id")
        return convert.timeline_pb(*await self.ops.timeline(reclaim_id))

    async def models(self) -> list[pb.Model]:
        return [convert.model_pb(m) for m in await self.ops.models()]

    # --- actions ----------------------------------------------------------------------------

    async def set_spot(self, node_id: str, spot: bool) -> pb.Node:
        node_id = convert.check_id(node_id, "node_id")
        return convert.node_pb(await self.ops.set_spot(node_id, spot))

    async def set_replicas(self, model: str, replicas: int, image: str, slots: int) -> pb.Model:
        model = convert.check_id(model, "model", required=False)
        return convert.model_pb(await self.ops.set_replicas(model, replicas, image, slots))

    async def pause(self, node_id: str) -> str:
        return await self.ops.operator_pause(convert.check_id(node_id, "node_id"))

    async def resume(self, node_id: str) -> bool:
        return await self.ops.operator_resume(convert.check_id(node_id, "node_id"))
