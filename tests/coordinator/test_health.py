"""gRPC health checking as a load balancer or an operator's grpc-health-probe sees it: Check,
and List, which answers every registered service's status at once."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from spotdrain.coordinator.api.health import HealthServicer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICES = {
    "",
    "spotdrain.v1.AgentLink",
    "spotdrain.v1.Admin",
    "spotdrain.v1.Routes",
    "spotdrain.v1.Rentals",
}


def test_a_probe_lists_every_service_the_coordinator_serves(coordinator):
    """An operator's probe asks the running coordinator for all its services in one List call:
    each is there and SERVING, as Check says of it one by one (List used to fail INTERNAL)."""
    stub = health_pb2_grpc.HealthStub(coordinator.channel())
    listed = stub.List(health_pb2.HealthListRequest(), timeout=5)
    assert {name: s.status for name, s in listed.statuses.items()} == dict.fromkeys(
        SERVICES, SERVING
    )
    for name in SERVICES:
        check = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert check.status == SERVING


async def test_list_follows_a_service_set_down_and_the_shutdown():
    """A replica that loses the lead sets its services NOT_SERVING, then the process stops:
    List answers each state as it is, like Check."""
    servicer = HealthServicer()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def listed() -> dict[str, int]:
                reply = await stub.List(health_pb2.HealthListRequest(), timeout=5)
                return {name: s.status for name, s in reply.statuses.items()}

            assert await listed() == {"": SERVING}
            await servicer.set("spotdrain.v1.Admin", SERVING)
            await servicer.set("spotdrain.v1.Routes", NOT_SERVING)
            assert await listed() == {
                "": SERVING,
                "spotdrain.v1.Admin": SERVING,
                "spotdrain.v1.Routes": NOT_SERVING,
            }
            await servicer.enter_graceful_shutdown()
            await servicer.set("spotdrain.v1.Admin", SERVING)  # ignored once shutting down
            assert await listed() == dict.fromkeys(
                ("", "spotdrain.v1.Admin", "spotdrain.v1.Routes"), NOT_SERVING
            )
            check = await stub.Check(health_pb2.HealthCheckRequest(service="spotdrain.v1.Admin"))
            assert check.status == NOT_SERVING
    finally:
        await server.stop(None)
