"""grpc.health.v1.Health for the coordinator: gRPC's reference servicer, with List.

The reference aio servicer (grpc_health) answers Check and Watch but leaves List to the
generated base class, which raises NotImplementedError: every List call failed INTERNAL. This
one keeps its own copy of every status set through the public methods, so List answers the
same statuses Check does without reading the reference servicer's private state.
"""

from __future__ import annotations

from typing import Any

from grpc_health.v1 import health, health_pb2


class HealthServicer(health.aio.HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        self._statuses: dict[str, int] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._shutting_down = False

    async def set(self, service: str, status: int) -> None:
        if not self._shutting_down:
            self._statuses[service] = status
        await super().set(service, status)

    async def enter_graceful_shutdown(self) -> None:
        if not self._shutting_down:
            self._shutting_down = True
            self._statuses = dict.fromkeys(
                self._statuses, health_pb2.HealthCheckResponse.NOT_SERVING
            )
        await super().enter_graceful_shutdown()

    async def List(  # noqa: N802 (gRPC method name)
        self,
        request: health_pb2.HealthListRequest,
        context: Any,  # noqa: ANN401
    ) -> health_pb2.HealthListResponse:
        # The coordinator registers a handful of services: one answer always holds them all
        # (the protocol's RESOURCE_EXHAUSTED for too many is never needed).
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=status)
                for name, status in self._statuses.items()
            }
        )
