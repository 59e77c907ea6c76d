"""The fake node (tests/fakes/fakenode.py) against a real coordinator: what the coordinator tests
rely on when they call it."""

from __future__ import annotations

import asyncio
import signal
import time

from fakes.fakenode import FakeNode, Ops
from spotdrain.v1 import spotdrain_pb2 as pb


async def test_disconnect_returns_only_once_the_coordinator_has_seen_the_stream_go(
    coordinator, pki
):
    """A coordinator too busy to run (frozen here with SIGSTOP) has not noticed the drop yet:
    disconnect() must not return before it has, however long that takes. The tests that place
    on a disconnected node next depend on it."""
    node = FakeNode(coordinator, pki, "node-a")
    ops = Ops(coordinator)
    try:
        await node.connect()
        coordinator.proc.signal(signal.SIGSTOP)
        thawed_at = time.monotonic() + 1.0
        asyncio.get_running_loop().call_later(1.0, coordinator.proc.signal, signal.SIGCONT)
        await node.disconnect()
        assert time.monotonic() >= thawed_at
        [seen] = (await ops.admin.ListNodes(pb.ListNodesRequest())).nodes
        assert not seen.connected
    finally:
        coordinator.proc.signal(signal.SIGCONT)
        await node.close()
        await ops.channel.close()
