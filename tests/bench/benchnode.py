"""What the coordinator benchmarks share: a node as the coordinator sees it (a real AgentLink
stream that registers, answers every start at once and notes every drain), a channel for a
certificate, and a bounded wait. Not a benchmark itself; pytest collects nothing here."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from fakes.harness import Coordinator  # noqa: E402
from fakes.pki import CertFiles, Pki  # noqa: E402
from spotdrain.v1 import spotdrain_pb2 as pb  # noqa: E402
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc  # noqa: E402

WAIT_S = 10.0  # bound on any one wait: only stops a broken run from hanging


def channel(coord: Coordinator, who: CertFiles | None) -> grpc.aio.Channel:
    if coord.tls is None:
        return grpc.aio.insecure_channel(coord.address)
    assert who is not None
    creds = grpc.ssl_channel_credentials(
        Path(who.ca).read_bytes(), Path(who.key).read_bytes(), Path(who.cert).read_bytes()
    )
    return grpc.aio.secure_channel(coord.address, creds)


async def until(predicate: Any, what: str, timeout: float = WAIT_S, every: float = 0.002) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(every)
    return value


class FakeNode:
    def __init__(
        self, coord: Coordinator, pki: Pki | None, node_id: str, gpus: int, group: str = "bench"
    ) -> None:
        self.node_id = node_id
        self.group = group
        self.gpus = gpus
        self.channel = channel(coord, pki.issue(f"node:{node_id}") if pki else None)
        self.link = pb_grpc.AgentLinkStub(self.channel)
        self.live: dict[str, float] = {}  # worker id -> perf_counter of its start_worker
        self.drained: set[str] = set()  # drain_worker received, not yet reported stopped
        self.starts: list[tuple[float, str, str]] = []  # (perf_counter, node, worker) received
        self._outbox: asyncio.Queue[pb.AgentMessage | None] = asyncio.Queue()
        self._registered = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        self._next_port = 30000

    async def connect(self) -> None:
        self._outbox.put_nowait(
            pb.AgentMessage(
                register=pb.Register(
                    node_id=self.node_id,
                    gpus=[
                        pb.Gpu(index=i, uuid=f"GPU-{self.node_id}-{i}", name="fake")
                        for i in range(self.gpus)
                    ],
                    spot=True,
                    node_group=self.group,
                )
            )
        )
        call = self.link.Connect(self._outgoing())
        self._reader = asyncio.create_task(self._read(call))
        async with asyncio.timeout(WAIT_S):
            await self._registered.wait()

    async def _outgoing(self) -> AsyncIterator[pb.AgentMessage]:
        while (message := await self._outbox.get()) is not None:
            yield message

    async def _read(self, call: Any) -> None:
        async for message in call:
            which = message.WhichOneof("body")
            if which == "start_worker":
                seen = time.perf_counter()
                c = message.start_worker
                self.starts.append((seen, self.node_id, c.worker_id))
                self.live[c.worker_id] = seen
                self._next_port += 1
                self._outbox.put_nowait(
                    pb.AgentMessage(
                        worker=pb.WorkerReport(
                            worker_id=c.worker_id,
                            state="started",
                            gate_address=f"127.0.0.1:{self._next_port}",
                            capacity=c.capacity,
                        )
                    )
                )
            elif which == "drain_worker":
                self.drained.add(message.drain_worker.worker_id)
            elif which == "registered":
                self._registered.set()

    def check(self) -> None:
        if self._reader is not None and self._reader.done():
            raise RuntimeError(f"{self.node_id}: stream ended: {self._reader.exception()}")

    async def taint(
        self, reclaim_id: str, reason: str = "pause", remove: bool = False
    ) -> pb.TaintReply:
        """As the agent calls it: the reclamation's deadlines, computed once."""
        now = time.time()
        return await self.link.Taint(
            pb.TaintRequest(
                node_id=self.node_id,
                reclaim_id=reclaim_id,
                reason=reason,
                remove=remove,
                terminate_at=now + 120,
                grace_deadline=now + 110,
            ),
            timeout=WAIT_S,
        )

    def report_stopped(self, worker_ids: set[str]) -> None:
        for worker_id in sorted(worker_ids):
            self.live.pop(worker_id, None)
            self.drained.discard(worker_id)
            self._outbox.put_nowait(
                pb.AgentMessage(
                    worker=pb.WorkerReport(worker_id=worker_id, state="stopped", exit_code=0)
                )
            )

    async def resume(self, reclaim_id: str) -> None:
        await self.link.SetWorkload(
            pb.SetWorkloadRequest(node_id=self.node_id, enabled=True, reclaim_id=reclaim_id),
            timeout=WAIT_S,
        )

    async def close(self) -> None:
        self._outbox.put_nowait(None)
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        await self.channel.close()
