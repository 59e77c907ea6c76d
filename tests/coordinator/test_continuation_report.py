"""`Routes.ReportContinuation`: the one write a router identity may make, checked like any value
from the wire (a real coordinator over mutual TLS)."""

from __future__ import annotations

from pathlib import Path

import grpc

from fakes.harness import Coordinator
from fakes.pki import CertFiles, Pki
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc


def aio_channel(coordinator: Coordinator, who: CertFiles) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(
        Path(who.ca).read_bytes(), Path(who.key).read_bytes(), Path(who.cert).read_bytes()
    )
    return grpc.aio.secure_channel(coordinator.address, creds)


async def report(channel: grpc.aio.Channel, **fields: object) -> grpc.StatusCode:
    base: dict[str, object] = {
        "request_id": "r1",
        "model": "m",
        "from_worker_id": "w-x",
        "to_worker_id": "w-y",
    }
    message = pb.StreamContinued(**{**base, **fields})
    try:
        await pb_grpc.RoutesStub(channel).ReportContinuation(message, timeout=5)
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def test_a_continuation_report_is_checked_and_only_a_router_may_send_one(
    coordinator: Coordinator, pki: Pki
) -> None:
    """A router's report for a node with no drain to record it in is NOT_FOUND (whether it names
    the node or not), an oversized id or gap INVALID_ARGUMENT; a node or renter may not report
    at all. Nothing is recorded."""
    router = aio_channel(coordinator, pki.issue("router:r1"))
    node = aio_channel(coordinator, pki.issue("node:node-a"))
    renter = aio_channel(coordinator, pki.issue("renter:alice"))
    try:
        assert await report(router) == grpc.StatusCode.NOT_FOUND
        assert await report(router, from_node_id="node-a") == grpc.StatusCode.NOT_FOUND
        assert await report(router, from_node_id="n" * 257) == grpc.StatusCode.INVALID_ARGUMENT
        assert await report(router, request_id="x" * 257) == grpc.StatusCode.INVALID_ARGUMENT
        assert await report(router, gap_s=-1.0) == grpc.StatusCode.INVALID_ARGUMENT
        assert await report(router, gap_s=float("nan")) == grpc.StatusCode.INVALID_ARGUMENT
        assert await report(node) == grpc.StatusCode.PERMISSION_DENIED
        assert await report(renter) == grpc.StatusCode.PERMISSION_DENIED
    finally:
        for channel in (router, node, renter):
            await channel.close()
    assert not [e for e in coordinator.admin().events() if e["kind"] == "stream_continued"]
