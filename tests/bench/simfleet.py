"""The simulated fleet of fleet_scale.py: a worker process holding a shard of simulated agents.

Each simulated agent is one mutual-TLS channel with its own `node:<id>` certificate and one
`AgentLink.Connect` stream, doing what the coordinator expects from a real agent: Register
first (with the workers it runs), a heartbeat every 5 s (random phase) with its WorkerSlots,
WorkerReport(state="started") for every start_worker, a stop report a second after a
drain_worker, and reconnects with the agent's backoff (0.1, 0.2, 0.5, 1, 2 s).

Many streams per process, one asyncio loop, nothing per message but a protobuf and a queue put:
the simulator shares the cores with the coordinator it measures. The orchestrator talks to a
shard over a multiprocessing pipe: (request id, command, arguments) in, (request id, result)
out; long commands (a series of Taints, an event or flood phase) run concurrently.
Not a benchmark itself; pytest collects nothing here.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from spotdrain.agent.drain.link import BACKOFF_S, HEARTBEAT_S  # noqa: E402
from spotdrain.agent.drain.link import CHANNEL_OPTIONS as AGENT_CHANNEL_OPTIONS  # noqa: E402
from spotdrain.net.leader import Replicas  # noqa: E402
from spotdrain.protocol.limits import MAX_BATCH_BYTES, MAX_BATCH_EVENTS  # noqa: E402
from spotdrain.v1 import spotdrain_pb2 as pb  # noqa: E402
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc  # noqa: E402

# The real agent's (agent/drain/link.py), copied so a refactor of the agent cannot change the load.
TAINT_DEADLINE_S = 0.8
DRAIN_STOP_S = 1.0  # drain_worker -> "stopped": the gate empties, the container exits
# The real agent's channel and timings, so the simulated fleet behaves like one; each node is
# its own agent: never share a connection between two certificates.
CHANNEL_OPTIONS = [*AGENT_CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
GPUS = 2


async def _drain(queue: asyncio.Queue[pb.AgentMessage | None]) -> Any:
    while (message := await queue.get()) is not None:
        yield message


class SimNode:
    def __init__(self, shard: Shard, node_id: str, group: str, creds: Any) -> None:
        self.shard = shard
        self.node_id = node_id
        self.group = group
        # Several replicas ("a,b"): the stream and the Taint find the leader as the agent's do
        # (spotdrain.net.leader); one address is one channel, as before.
        self.replicas = Replicas(
            shard.address.split(","),
            lambda a: grpc.aio.secure_channel(a, creds, options=CHANNEL_OPTIONS),
        )
        self.workers: dict[str, list[Any]] = {}  # worker id -> [gate address, capacity, state]
        self.outbox: asyncio.Queue[pb.AgentMessage | None] | None = None  # set while registered
        self.registered_at = 0.0  # monotonic, the latest Registered
        self.acked: asyncio.Event | None = None  # the flood's one batch in flight
        self._ports = itertools.count(30000)
        self._gate = False  # holds a startup slot

    def send(self, message: pb.AgentMessage) -> bool:
        if self.outbox is None:
            return False
        self.outbox.put_nowait(message)
        return True

    def _register(self) -> pb.AgentMessage:
        running = [
            pb.WorkerReport(worker_id=w, state="started", gate_address=gate, capacity=cap)
            for w, (gate, cap, _state) in self.workers.items()
        ]
        gpus = [pb.Gpu(index=i, uuid=f"GPU-{self.node_id}-{i}", name="sim") for i in range(GPUS)]
        return pb.AgentMessage(
            register=pb.Register(
                node_id=self.node_id,
                gpus=gpus,
                spot=True,
                node_group=self.group,
                agent_version="simfleet",
                workers=running,
            )
        )

    async def run(self) -> None:
        """Sessions until the shard closes; a session that never registered is counted."""
        # Bounded startup: only so many handshakes and registrations in flight per shard.
        await self.shard.startup.acquire()
        self._gate = True
        attempt = 0
        while not self.shard.closing:
            started = time.monotonic()
            registered, code = await self._session()
            self._release_gate()
            if self.shard.closing:
                return
            if registered:
                attempt = 0
            else:
                self.shard.failed.append((started, code))
            await asyncio.sleep(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])
            attempt += 1

    def _release_gate(self) -> None:
        if self._gate:
            self._gate = False
            self.shard.startup.release()

    async def _session(self) -> tuple[bool, str]:
        queue: asyncio.Queue[pb.AgentMessage | None] = asyncio.Queue()
        queue.put_nowait(self._register())
        call = self.replicas.stub(pb_grpc.AgentLinkStub).Connect(_drain(queue))
        registered, code = False, "OK"
        try:
            async for message in call:
                which = message.WhichOneof("body")
                if which == "registered":
                    registered = True
                    self.outbox = queue
                    self.registered_at = time.monotonic()
                    self._release_gate()
                elif which == "start_worker":
                    self._start(message.start_worker)
                elif which == "drain_worker":
                    self._drained(message.drain_worker.worker_id)
                elif which == "ack":
                    self.shard.on_ack(self, message.ack.uids)
        except grpc.aio.AioRpcError as e:
            code = e.code().name
            self.replicas.moved(e)
            if "connect" in (e.details() or "").lower():
                # No connection at all (the coordinator not back yet, the channel's own
                # backoff): not a stream the coordinator accepted and then dropped.
                code += ":no-connection"
        finally:
            self.outbox = None
            queue.put_nowait(None)
            call.cancel()
        return registered, code

    def _start(self, command: pb.StartWorker) -> None:
        self.shard.starts.append((time.monotonic(), self.node_id, command.worker_id))
        gate = f"127.0.0.1:{next(self._ports)}"
        self.workers[command.worker_id] = [gate, command.capacity, "ready"]
        self.send(
            pb.AgentMessage(
                worker=pb.WorkerReport(
                    worker_id=command.worker_id,
                    state="started",
                    gate_address=gate,
                    capacity=command.capacity,
                )
            )
        )

    def _drained(self, worker_id: str) -> None:
        worker = self.workers.get(worker_id)
        if worker is None or worker[2] == "draining":
            return  # a drain re-sent on re-registration
        worker[2] = "draining"
        asyncio.get_running_loop().call_later(DRAIN_STOP_S, self._stopped, worker_id)

    def _stopped(self, worker_id: str) -> None:
        if self.workers.pop(worker_id, None) is not None:
            self.send(
                pb.AgentMessage(
                    worker=pb.WorkerReport(worker_id=worker_id, state="stopped", exit_code=0)
                )
            )

    def heartbeat(self) -> pb.AgentMessage:
        slots = [
            pb.WorkerSlots(worker_id=w, slots_in_use=0, capacity=cap, claimed_state=state)
            for w, (_gate, cap, state) in self.workers.items()
        ]
        return pb.AgentMessage(heartbeat=pb.Heartbeat(node_id=self.node_id, workers=slots))

    async def heartbeats(self) -> None:
        await asyncio.sleep(random.uniform(0, HEARTBEAT_S))
        while True:
            self.send(self.heartbeat())
            await asyncio.sleep(HEARTBEAT_S)

    async def taint(self, reclaim_id: str) -> dict[str, Any]:
        """As the agent calls it: deadlines computed once, 800 ms to answer."""
        ready = [w for w, (_g, _c, state) in self.workers.items() if state == "ready"]
        now = time.time()
        request = pb.TaintRequest(
            node_id=self.node_id,
            reclaim_id=reclaim_id,
            reason="notice",
            terminate_at=now + 120,
            grace_deadline=now + 110,
        )
        t0 = time.monotonic()
        try:
            await self.replicas.on_leader(pb_grpc.AgentLinkStub, "Taint", request, TAINT_DEADLINE_S)
            code = "OK"
        except grpc.aio.AioRpcError as e:
            code = e.code().name
        ms = (time.monotonic() - t0) * 1000
        return {"node": self.node_id, "t0": t0, "ms": ms, "code": code, "workers": ready}


class Shard:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.address = ""
        self.nodes: dict[str, SimNode] = {}
        self.tasks: list[asyncio.Task[Any]] = []
        self.closing = False
        self.startup = asyncio.Semaphore(200)
        self.failed: list[tuple[float, str]] = []  # (session start, code) never registered
        self.starts: list[tuple[float, str, str]] = []  # (monotonic, node, worker) received
        self.pending: dict[str, float] = {}  # first uid of a batch -> monotonic sent
        self.ack_ms: list[float] = []
        self._uids = itertools.count()
        self.done = asyncio.Event()

    # --- what the orchestrator asks -------------------------------------------------------

    async def cmd_connect(self, address: str, ca: str, specs: list[list[str]], inflight: int):
        self.address = address
        self.startup = asyncio.Semaphore(inflight)
        ca_bytes = _read(ca)
        for node_id, group, cert, key in specs:
            creds = grpc.ssl_channel_credentials(ca_bytes, _read(key), _read(cert))
            node = self.nodes[node_id] = SimNode(self, node_id, group, creds)
            self.tasks.append(asyncio.ensure_future(node.run()))
            self.tasks.append(asyncio.ensure_future(node.heartbeats()))
        return len(self.nodes)

    async def cmd_stats(self, since: float = 0.0, failed_after: float = 0.0) -> dict[str, Any]:
        times = os.times()
        since_nodes = [n.registered_at for n in self.nodes.values() if n.registered_at > since]
        return {
            "registered": sum(1 for n in self.nodes.values() if n.outbox is not None),
            "registered_since": len(since_nodes),
            "last_registered": max(since_nodes, default=0.0),
            "failed_since": dict(Counter(code for t, code in self.failed if t >= failed_after)),
            "workers": sum(len(n.workers) for n in self.nodes.values()),
            "starts": len(self.starts),
            "cpu_s": times.user + times.system,
        }

    async def cmd_starts_since(self, since: float) -> list[tuple[float, str, str]]:
        return [s for s in self.starts if s[0] >= since]

    async def cmd_taints(self, items: list[tuple[str, float, str]]) -> list[dict[str, Any]]:
        """Each (node, monotonic start time, reclaim id) at its time, all concurrently."""

        async def one(node_id: str, at: float, reclaim_id: str) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            return await self.nodes[node_id].taint(reclaim_id)

        return list(await asyncio.gather(*(one(*item) for item in items)))

    async def cmd_lag(self, duration: float, every: float = 0.01) -> list[float]:
        """This shard's event-loop lag (ms late for a `every` s sleep) over `duration`: when
        it is large, a round trip measured here is the simulator's wait as much as the
        coordinator's."""
        lags: list[float] = []
        end = time.monotonic() + duration
        while time.monotonic() < end:
            t0 = time.monotonic()
            await asyncio.sleep(every)
            lags.append(max(0.0, (time.monotonic() - t0 - every) * 1000))
        return lags

    async def cmd_events(self, duration: float, every: float, per_tick: int, size: int):
        """Every `every` s, `per_tick` random registered nodes each send a batch of `size`."""
        self.ack_ms = []
        end = time.monotonic() + duration
        await asyncio.sleep(random.uniform(0, every))
        while time.monotonic() < end:
            live = [n for n in self.nodes.values() if n.outbox is not None]
            for node in random.sample(live, min(per_tick, len(live))):
                self._send_batch(node, size, b"{}")
            await asyncio.sleep(every)
        await asyncio.sleep(2.0)  # the last acks
        lost = len(self.pending)
        self.pending.clear()
        return {"ack_ms": self.ack_ms, "unacked": lost}

    async def cmd_flood(self, node_id: str, duration: float) -> dict[str, Any]:
        """The largest batches the limits allow, the next as soon as the last is acked."""
        node = self.nodes[node_id]
        pad = _flood_pad(node_id)
        sent, acked, lat, errors = 0, 0, [], 0
        end = time.monotonic() + duration
        while time.monotonic() < end and not self.closing:
            node.acked = asyncio.Event()
            t0 = time.monotonic()
            if not self._send_batch(node, MAX_BATCH_EVENTS, pad, track=False):
                errors += 1
                await asyncio.sleep(0.1)
                continue
            sent += 1
            try:
                async with asyncio.timeout(10):
                    await node.acked.wait()
                acked += 1
                lat.append((time.monotonic() - t0) * 1000)
            except TimeoutError:
                errors += 1
        node.acked = None
        return {"batches": sent, "acked": acked, "ack_ms": lat, "errors": errors}

    async def cmd_stop(self) -> int:
        self.closing = True
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.gather(*(n.replicas.close() for n in self.nodes.values()))
        self.done.set()
        return 0

    # --- events and acks ------------------------------------------------------------------

    def _send_batch(self, node: SimNode, size: int, details: bytes, track: bool = True) -> bool:
        now = time.time()
        uids = [f"sim-{node.node_id}-{os.getpid()}-{next(self._uids)}" for _ in range(size)]
        events = [
            pb.Event(
                uid=uid,
                kind="bench_probe",
                node_id=node.node_id,
                wall_time=now,
                details_json=details.decode(),
            )
            for uid in uids
        ]
        if not node.send(pb.AgentMessage(events=pb.EventBatch(events=events))):
            return False
        if track:
            self.pending[uids[0]] = time.monotonic()
        return True

    def on_ack(self, node: SimNode, uids: Any) -> None:
        now = time.monotonic()
        for uid in uids:
            sent = self.pending.pop(uid, None)
            if sent is not None:
                self.ack_ms.append((now - sent) * 1000)
        if node.acked is not None:
            node.acked.set()


def _read(path: str) -> bytes:
    # Before the streams start, a few KB each: not worth a thread per file.
    return Path(path).read_bytes()


def _flood_pad(node_id: str) -> bytes:
    """details_json that makes a MAX_BATCH_EVENTS batch just fit MAX_BATCH_BYTES."""
    probe = pb.Event(
        uid=f"sim-{node_id}-{os.getpid()}-0000000",
        kind="bench_probe",
        node_id=node_id,
        wall_time=time.time(),
        details_json=json.dumps({"pad": ""}),
    )
    room = MAX_BATCH_BYTES * 0.97 / MAX_BATCH_EVENTS - probe.ByteSize() - 8
    return json.dumps({"pad": "x" * max(0, int(room))}).encode()


async def _serve(conn: Connection) -> None:
    shard = Shard(conn)
    loop = asyncio.get_running_loop()
    running: set[asyncio.Task[Any]] = set()

    async def handle(req_id: int, cmd: str, kwargs: dict[str, Any]) -> None:
        try:
            result: Any = ("ok", await getattr(shard, f"cmd_{cmd}")(**kwargs))
        except Exception as e:  # the orchestrator reports it and stops the run
            result = ("error", f"{type(e).__name__}: {e}")
        try:
            conn.send((req_id, *result))
        except OSError:  # the orchestrator stopped first (its run is over): nobody to tell
            pass

    def readable() -> None:
        try:
            req_id, cmd, kwargs = conn.recv()
        except (EOFError, OSError):  # the orchestrator is gone: stop too
            loop.remove_reader(conn.fileno())
            running.add(asyncio.ensure_future(shard.cmd_stop()))
            return
        task = asyncio.ensure_future(handle(req_id, cmd, kwargs))
        running.add(task)
        task.add_done_callback(running.discard)

    loop.add_reader(conn.fileno(), readable)
    await shard.done.wait()
    loop.remove_reader(conn.fileno())


def shard_main(conn: Connection) -> None:
    # Ctrl-C reaches the whole process group; the orchestrator stops its shards itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    asyncio.run(_serve(conn))
