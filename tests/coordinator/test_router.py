"""The reference router (`spotdrain-router`) between OpenAI clients and slot gates, fed by a
real coordinator process over mutual TLS.

Everything on the node side is faked in the test process: a FakeAgent connects over
`AgentLink.Connect` with the node's certificate, and when an operator places a worker
(`Admin.StartWorker`) it starts a FakeGate (an aiohttp server that answers like a worker behind
its slot gate) and reports the worker started with the gate's address. The router runs as a
subprocess with a `router:` certificate and learns the gates only from `Routes.WatchRoutes`.

The property that must keep holding (docs/design.md "Owner pause timeline": routers drop a
draining worker at once) is checked by a background watcher, which fails the test the moment a
drained worker's gate sees a request stamped with a route version at or after its removal.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import pytest
from aiohttp import web
from multidict import CIMultiDict

from fakes.harness import Coordinator, Proc, start_coordinator
from fakes.pki import CertFiles, Pki
from fakes.waiting import eventually
from spotdrain.coordinator.router.app import main as router_main
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

MODEL = "fake-llm"


def aio_channel(coordinator: Coordinator, who: CertFiles) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(
        Path(who.ca).read_bytes(), Path(who.key).read_bytes(), Path(who.cert).read_bytes()
    )
    return grpc.aio.secure_channel(coordinator.address, creds)


# --- a worker behind its slot gate -------------------------------------------------------------


def chunk_event(i: int) -> bytes:
    doc = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def gate_interrupted_event(request_id: str) -> bytes:
    """What agent/workloads/slot_gate.py writes when it cuts a stream (invariant 7)."""
    error = {
        "type": "interrupted",
        "message": "the worker was stopped (node reclaimed or paused); the answer is incomplete",
        "request_id": request_id,
    }
    return b"event: error\ndata: " + json.dumps({"error": error}).encode() + b"\n\n"


def completion(text: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        ],
    }


@dataclass(frozen=True)
class Seen:
    request_id: str
    route_version: int
    refused: bool  # the gate was draining and answered 503


class FakeGate:
    """A worker behind its slot gate, as the router sees it. Parameters ride in the JSON body
    (the SDK's extra_body): x_tokens, x_pace_ms, x_delay_ms, and x_end: "done" (default),
    "interrupted" (the gate cut the stream: its error event, no [DONE]) or "break" (the
    connection drops mid-stream, as when the gate process dies)."""

    def __init__(self, worker_id: str, on_request: Callable[[FakeGate, Seen], None]) -> None:
        self.worker_id = worker_id
        self.on_request = on_request
        self.on_slots: Callable[[FakeGate], None] = lambda gate: None
        self.seen: list[Seen] = []
        self.sent: dict[str, bytearray] = {}  # request id -> the stream bytes the gate wrote
        self.draining = False
        self.in_flight = 0
        self.address = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        self._runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        host, port = self._runner.addresses[0][:2]
        self.address = f"{host}:{port}"
        return self.address

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def served(self) -> list[Seen]:
        return [s for s in self.seen if not s.refused]

    async def chat(self, request: web.Request) -> web.StreamResponse:
        seen = Seen(
            request.headers.get("X-Request-Id", ""),
            int(request.headers.get("X-Route-Version", "-1")),
            self.draining,
        )
        self.seen.append(seen)
        self.on_request(self, seen)
        if self.draining:
            error = {"type": "worker_draining", "message": "the worker is draining"}
            return web.json_response({"error": error}, status=503, headers={"Retry-After": "1"})
        doc = await request.json()
        self.in_flight += 1
        self.on_slots(self)
        try:
            return await self._answer(request, doc, seen.request_id)
        finally:
            self.in_flight -= 1
            self.on_slots(self)

    async def _answer(
        self, request: web.Request, doc: dict[str, Any], rid: str
    ) -> web.StreamResponse:
        tokens = int(doc.get("x_tokens", 3))
        pace = doc.get("x_pace_ms", 2) / 1000
        if not doc.get("stream"):
            await asyncio.sleep(doc.get("x_delay_ms", 0) / 1000)
            text = "".join(f"tok{i} " for i in range(tokens))
            return web.json_response(completion(text), headers={"X-Request-Id": rid})
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "X-Request-Id": rid}
        )
        await response.prepare(request)
        sent = bytearray()
        self.sent[rid] = sent
        for i in range(tokens):
            sent += chunk_event(i)
            await response.write(chunk_event(i))
            await asyncio.sleep(pace)
        end = doc.get("x_end", "done")
        if end == "break":
            assert request.transport is not None
            request.transport.abort()
            return response
        last = gate_interrupted_event(rid) if end == "interrupted" else b"data: [DONE]\n\n"
        sent += last
        await response.write_eof(last)
        return response


# --- a node's agent -----------------------------------------------------------------------------


class FakeAgent:
    """The coordinator's view of a node agent: registers with the node's certificate, starts a
    FakeGate for each start_worker and reports it started, drains that gate on drain_worker, and
    (with report_slots) tells the coordinator its gates' slot counts as they change."""

    def __init__(
        self,
        coordinator: Coordinator,
        pki: Pki,
        node_id: str,
        on_request: Callable[[FakeGate, Seen], None],
        report_slots: bool = False,
    ) -> None:
        self.node_id = node_id
        self.identity = pki.issue(f"node:{node_id}")
        self.channel = aio_channel(coordinator, self.identity)
        self.link = pb_grpc.AgentLinkStub(self.channel)
        self.gates: dict[str, FakeGate] = {}
        self.drains: list[pb.DrainWorker] = []
        self.report_slots = report_slots
        self._on_request = on_request
        self._outbox: asyncio.Queue[pb.AgentMessage | None] = asyncio.Queue()
        self._registered = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        self.send(
            pb.AgentMessage(
                register=pb.Register(
                    node_id=self.node_id,
                    gpus=[pb.Gpu(index=0, uuid=f"GPU-{self.node_id}", name="fake")],
                    spot=True,
                    node_group="test",
                )
            )
        )
        call = self.link.Connect(self._outgoing())
        self._reader = asyncio.create_task(self._read(call))
        async with asyncio.timeout(10):
            await self._registered.wait()

    def send(self, message: pb.AgentMessage) -> None:
        self._outbox.put_nowait(message)

    def slots(self, worker_id: str, in_use: int, capacity: int = 4) -> None:
        report = pb.WorkerSlots(
            worker_id=worker_id, slots_in_use=in_use, capacity=capacity, claimed_state="ready"
        )
        self.send(pb.AgentMessage(slots=pb.SlotReport(workers=[report])))

    async def taint(self, reclaim_id: str, reason: str = "pause") -> pb.TaintReply:
        now = time.time()
        return await self.link.Taint(
            pb.TaintRequest(
                node_id=self.node_id,
                reclaim_id=reclaim_id,
                reason=reason,
                terminate_at=now + 120,
                grace_deadline=now + 110,
            ),
            timeout=5,
        )

    async def close(self) -> None:
        self._outbox.put_nowait(None)
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        for gate in self.gates.values():
            await gate.close()
        await self.channel.close()

    def _slots_changed(self, gate: FakeGate, capacity: int) -> None:
        if self.report_slots:
            self.slots(gate.worker_id, gate.in_flight, capacity)

    async def _outgoing(self) -> AsyncIterator[pb.AgentMessage]:
        while (message := await self._outbox.get()) is not None:
            yield message

    async def _read(self, call: Any) -> None:
        async for message in call:
            which = message.WhichOneof("body")
            if which == "registered":
                self._registered.set()
            elif which == "start_worker":
                await self._start(message.start_worker)
            elif which == "drain_worker":
                self.drains.append(message.drain_worker)
                gate = self.gates.get(message.drain_worker.worker_id)
                if gate is not None:
                    gate.draining = True

    async def _start(self, command: pb.StartWorker) -> None:
        gate = FakeGate(command.worker_id, self._on_request)
        gate.on_slots = lambda g: self._slots_changed(g, command.capacity)
        self.gates[command.worker_id] = gate
        address = await gate.start()
        self.send(
            pb.AgentMessage(
                worker=pb.WorkerReport(
                    worker_id=command.worker_id,
                    state="started",
                    gate_address=address,
                    capacity=command.capacity,
                )
            )
        )


# --- the coordinator's routes, as a second router would see them -------------------------------


class RouteLog:
    """Every update of a model's `WatchRoutes`, in a background task (operator identity)."""

    def __init__(self, coordinator: Coordinator, model: str) -> None:
        self.channel = aio_channel(coordinator, coordinator.operator)  # type: ignore[arg-type]
        self.stub = pb_grpc.RoutesStub(self.channel)
        self.model = model
        self.updates: list[pb.RouteUpdate] = []
        self.ready: set[str] = set()
        self.removed_at: dict[str, int] = {}
        self.on_removed: Callable[[str, int], None] = lambda worker_id, version: None
        self._task = asyncio.create_task(self._watch())

    @property
    def version(self) -> int:
        return self.updates[-1].version if self.updates else -1

    async def _watch(self) -> None:
        async for update in self.stub.WatchRoutes(pb.WatchRoutesRequest(model=self.model)):
            self.updates.append(update)
            if update.snapshot:
                self.ready = {r.worker_id for r in update.upsert}
            self.ready |= {r.worker_id for r in update.upsert}
            for worker_id in update.removed:
                self.ready.discard(worker_id)
                self.removed_at.setdefault(worker_id, update.version)
                self.on_removed(worker_id, update.version)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.channel.close()


# --- the router process -------------------------------------------------------------------------


@dataclass
class RouterProc:
    proc: Proc
    url: str
    http: aiohttp.ClientSession

    async def get(self, path: str) -> Any:
        async with self.http.get(self.url + path) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async def stats(self) -> dict[str, int]:
        return await self.get("/stats")

    async def caught_up(self, model: str, version: int) -> None:
        """Until the router's table for `model` is at `version` or later."""
        await eventually(
            lambda: self.get("/routes"),
            f"the router's table of {model} at version {version}",
            ok=lambda tables: (tables.get(model) or {}).get("version", -1) >= version,
        )

    async def chat(self, **body: Any) -> tuple[int, CIMultiDict[str], Any]:
        headers = body.pop("headers", {})
        doc = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}
        async with self.http.post(
            f"{self.url}/v1/chat/completions", json=doc, headers=headers
        ) as resp:
            return resp.status, resp.headers.copy(), await resp.json(content_type=None)


def router_argv(coordinator: Coordinator, identity: CertFiles, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "spotdrain.coordinator.router.app",
        "--listen",
        "127.0.0.1:0",
        "--coordinator",
        coordinator.address,
        "--tls-cert",
        identity.cert,
        "--tls-key",
        identity.key,
        "--ca",
        identity.ca,
        *extra,
    ]


async def start_router(
    log_path: Path, coordinator: Coordinator, identity: CertFiles, http: aiohttp.ClientSession
) -> RouterProc:
    proc = Proc(
        "router",
        # The fake gates do not continue a text: cuts are relayed as the gate sent them here;
        # continuation is tests/test_stream_continuation.py's, with the reference model server.
        router_argv(
            coordinator, identity, "--log-level", "DEBUG", "--continue-cut-streams", "false"
        ),
        log_path,
        {"PYTHONUNBUFFERED": "1"},
    )

    def listening() -> re.Match[str] | None:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"router exited {proc.popen.returncode}:\n{proc.log()}")
        return re.search(r"spotdrain-router: listening on (\S+)", proc.log())

    match = await eventually(listening, "the router to listen", timeout=20)
    return RouterProc(proc, f"http://{match.group(1)}", http)


# --- the scene: two nodes, one worker each, a router ---------------------------------------------


class Invariant:
    """Fails the test the moment a property breaks, from whatever callback noticed it."""

    def __init__(self) -> None:
        self.broken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.reported = False

    def fail(self, why: str) -> None:
        if not self.broken.done():
            self.broken.set_exception(AssertionError(why))

    async def guard(self, scenario: Awaitable[Any]) -> Any:
        task = asyncio.ensure_future(scenario)
        await asyncio.wait({task, self.broken}, return_when=asyncio.FIRST_COMPLETED)
        if self.broken.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self.reported = True
            self.broken.result()
        return task.result()


@dataclass
class Scene:
    coordinator: Coordinator
    router: RouterProc
    routes: RouteLog
    agents: dict[str, FakeAgent]
    workers: dict[str, str]  # node id -> its worker's id
    invariant: Invariant
    drained: dict[str, int] = field(default_factory=dict)  # worker id -> version it left at

    def gate(self, node_id: str) -> FakeGate:
        return self.agents[node_id].gates[self.workers[node_id]]


@pytest.fixture
async def scene(tmp_path: Path, coordinator: Coordinator, pki: Pki) -> AsyncIterator[Scene]:
    """node-a and node-b, each with one ready worker of MODEL (4 slots), and a router that has
    seen both. The drained-worker property is armed for the whole test."""
    invariant = Invariant()
    drained: dict[str, int] = {}

    def check_request(gate: FakeGate, seen: Seen) -> None:
        removed = drained.get(gate.worker_id)
        if removed is not None and seen.route_version >= removed:
            invariant.fail(
                f"worker {gate.worker_id} left the routes at version {removed}, and its gate "
                f"still got request {seen.request_id} routed at version {seen.route_version}"
            )

    def check_removed(worker_id: str, version: int) -> None:
        drained.setdefault(worker_id, version)
        for agent in agents.values():
            gate = agent.gates.get(worker_id)
            for seen in gate.seen if gate is not None else ():
                check_request(gate, seen)

    agents = {
        node: FakeAgent(coordinator, pki, node, check_request) for node in ("node-a", "node-b")
    }
    routes = RouteLog(coordinator, MODEL)
    routes.on_removed = check_removed
    operator = aio_channel(coordinator, coordinator.operator)  # type: ignore[arg-type]
    http = aiohttp.ClientSession()
    router: RouterProc | None = None
    try:
        workers = {}
        for node, agent in agents.items():
            await agent.connect()
            info = await pb_grpc.AdminStub(operator).StartWorker(
                pb.StartWorkerRequest(node_id=node, model=MODEL, image="fake", slots=4), timeout=5
            )
            workers[node] = info.worker_id
        await eventually(lambda: routes.ready == set(workers.values()), "both workers ready")
        router = await start_router(
            tmp_path / "router.log", coordinator, pki.issue("router:r1"), http
        )
        # The router's first request for the model starts its watch.
        status, _, _ = await router.chat()
        assert status == 200
        await router.caught_up(MODEL, routes.version)
        yield Scene(coordinator, router, routes, agents, workers, invariant, drained)
    finally:
        if router is not None:
            router.proc.stop()
        await http.close()
        await routes.close()
        for agent in agents.values():
            await agent.close()
        await operator.close()
    # Teardown check: whatever the test did, the property held to the end.
    if invariant.broken.done() and not invariant.reported:
        invariant.broken.result()


def sdk(router: RouterProc) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)


# --- scenarios ----------------------------------------------------------------------------------


async def test_the_least_loaded_worker_gets_the_request(scene: Scene) -> None:
    """node-a's worker has 3 of its 4 slots in use and node-b's 1: the next request goes to
    node-b's. The loads swap: the next goes to node-a's. With equal loads, a stream this router
    holds open on one worker counts: the next request goes to the other."""
    a, b = scene.workers["node-a"], scene.workers["node-b"]
    router = scene.router

    async def loads(load_a: int, load_b: int) -> None:
        before = scene.routes.version
        scene.agents["node-a"].slots(a, load_a)
        scene.agents["node-b"].slots(b, load_b)
        await eventually(lambda: scene.routes.version >= before + 2, "both slot changes routed")
        await router.caught_up(MODEL, scene.routes.version)

    await loads(3, 1)
    status, headers, _ = await router.chat(headers={"X-Request-Id": "to-b"})
    assert (status, headers["X-Worker-Id"], headers.getall("X-Request-Id")) == (200, b, ["to-b"])
    assert [s.request_id for s in scene.gate("node-b").served()][-1] == "to-b"

    await loads(2, 4)
    status, headers, _ = await router.chat()
    assert (status, headers["X-Worker-Id"]) == (200, a)
    # A request id the client did not give is made up, sent to the gate and returned.
    assert scene.gate("node-a").served()[-1].request_id == headers["X-Request-Id"] != ""

    await loads(0, 0)
    async with router.http.post(
        f"{router.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [], "stream": True, "x_tokens": 20, "x_pace_ms": 50},
    ) as long_stream:
        holder = long_stream.headers["X-Worker-Id"]
        status, headers, _ = await router.chat()
        assert status == 200 and headers["X-Worker-Id"] == ({a, b} - {holder}).pop()
        assert (await long_stream.read()).endswith(b"data: [DONE]\n\n")
    assert (await router.stats())["retried"] == 0


async def test_a_paused_node_gets_no_request_routed_after_the_router_saw_it_go(
    scene: Scene,
) -> None:
    """Clients keep four requests in flight through the router while the owner pauses node-a
    (its agent calls Taint with reason "pause"). The coordinator removes node-a's worker from
    the routes at version V and tells the agent to drain it. From the moment the router has
    seen V, every request goes to node-b's worker: node-a's gate never sees a request routed at
    V or later (checked on every request it gets), and no client sees an error: the model is
    still listed, served by node-b's worker alone."""
    for agent in scene.agents.values():  # slot counts flow as on a real node: many versions
        agent.report_slots = True
    a, b = scene.workers["node-a"], scene.workers["node-b"]
    results: list[tuple[int, str, float]] = []  # status, worker, when the request began
    stop = asyncio.Event()

    async def client() -> None:
        while not stop.is_set():
            began = time.monotonic()
            status, headers, _ = await scene.router.chat(x_delay_ms=3)
            results.append((status, headers.get("X-Worker-Id", ""), began))

    async def story() -> float:
        clients = [asyncio.create_task(client()) for _ in range(4)]
        try:
            await eventually(
                lambda: (
                    len(scene.gate("node-a").served()) >= 10
                    and len(scene.gate("node-b").served()) >= 10
                ),
                "traffic on both workers",
            )
            reply = await scene.agents["node-a"].taint("rcl-pause-1", reason="pause")
            assert [t.reclaim_id for t in reply.taints] == ["rcl-pause-1"]
            removed = await eventually(lambda: scene.routes.removed_at.get(a), "removal of a")
            await scene.router.caught_up(MODEL, removed)
            seen_at = time.monotonic()
            count = len(results)
            await eventually(lambda: len(results) >= count + 40, "traffic after the pause")
        finally:
            stop.set()
            await asyncio.gather(*clients)
        return seen_at

    seen_at = await scene.invariant.guard(story())
    assert {status for status, _, _ in results} == {200}
    after = [worker for _, worker, began in results if began > seen_at]
    assert after and set(after) == {b}
    # The agent was told to drain it, for the pause, with the deadlines it gave.
    drains = scene.agents["node-a"].drains
    assert [(d.worker_id, d.reason) for d in drains][:1] == [(a, "pause")]
    assert all(s.route_version < scene.drained[a] for s in scene.gate("node-a").seen)
    models = await scene.router.get("/v1/models")
    assert [m["id"] for m in models["data"]] == [MODEL]
    routes = (await scene.router.get("/routes"))[MODEL]
    assert [w["worker_id"] for w in routes["workers"]] == [b]


async def test_a_refusing_gate_is_retried_on_the_other_worker(scene: Scene) -> None:
    """node-a's gate starts draining before the coordinator knows (its agent lost the link):
    it answers 503 worker_draining. The router sends the same request, same request id, to
    node-b's worker; the client sees one clean answer. Then node-a's gate is gone altogether
    (connection refused): the same again."""
    b = scene.workers["node-b"]
    before = scene.routes.version
    scene.agents["node-b"].slots(b, 2)  # node-a's is the least loaded: the router tries it first
    await eventually(lambda: scene.routes.version > before, "the slot change routed")
    await scene.router.caught_up(MODEL, scene.routes.version)
    scene.gate("node-a").draining = True

    status, headers, body = await scene.router.chat(headers={"X-Request-Id": "retry-1"})
    assert (status, headers["X-Worker-Id"]) == (200, b)
    assert body["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "
    assert [s for s in scene.gate("node-a").seen if s.request_id == "retry-1"] == [
        Seen("retry-1", scene.routes.version, refused=True)
    ]
    assert [s.request_id for s in scene.gate("node-b").served()][-1] == "retry-1"

    # Streams too: the SDK never knows.
    async with sdk(scene.router) as api:
        stream = await api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == "tok0 tok1 tok2 "

    await scene.gate("node-a").close()
    status, headers, _ = await scene.router.chat(headers={"X-Request-Id": "retry-2"})
    assert (status, headers["X-Worker-Id"]) == (200, b)
    stats = await scene.router.stats()
    assert stats["retried"] == 3 and stats["upstream_errors"] == 1 and stats["refused"] == 0


async def test_no_worker_left_is_503_no_worker(scene: Scene) -> None:
    """A model nobody serves: 503 no_worker with Retry-After, at once. Both gates of the model
    refusing: each is tried once (never the same one twice), then 503 no_worker."""
    router = scene.router
    t0 = time.monotonic()
    async with router.http.post(
        f"{router.url}/v1/chat/completions", json={"model": "nobody-serves-this", "messages": []}
    ) as resp:
        assert resp.status == 503 and resp.headers["Retry-After"]
        error = (await resp.json())["error"]
    assert error["type"] == "no_worker" and "nobody-serves-this" in error["message"]
    assert time.monotonic() - t0 < 2.0

    for node in scene.workers:
        scene.gate(node).draining = True
    status, headers, body = await router.chat(headers={"X-Request-Id": "nowhere"})
    assert status == 503 and headers["Retry-After"] and headers["X-Request-Id"] == "nowhere"
    assert body["error"]["type"] == "no_worker"
    for node in scene.workers:
        assert [s.request_id for s in scene.gate(node).seen].count("nowhere") == 1
    stats = await router.stats()
    assert stats["refused"] == 2 and stats["retried"] == 1

    models = await router.get("/v1/models")
    assert [m["id"] for m in models["data"]] == [MODEL]  # known and routed, just all refusing


async def test_streams_pass_through_as_the_gate_sent_them(scene: Scene) -> None:
    """A complete stream ends normally in the SDK. A stream the gate cut (its interrupted error
    event, no [DONE]) reaches the client byte for byte, and the SDK raises on it. A gate whose
    connection breaks mid-stream: the router ends the client's stream the way the gate would,
    with an interrupted error event and no [DONE]. None of these is retried."""
    gates = {w: scene.agents[n].gates[w] for n, w in scene.workers.items()}
    async with sdk(scene.router) as api:
        stream = await api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_body={"x_tokens": 5},
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        assert text == "tok0 tok1 tok2 tok3 tok4 "

        async with scene.router.http.post(
            f"{scene.router.url}/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [],
                "stream": True,
                "x_tokens": 4,
                "x_end": "interrupted",
            },
            headers={"X-Request-Id": "cut-raw"},
        ) as resp:
            raw = await resp.read()
            worker = resp.headers["X-Worker-Id"]
        assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
        assert raw == bytes(gates[worker].sent["cut-raw"])
        assert raw.endswith(gate_interrupted_event("cut-raw")) and b"[DONE]" not in raw

        stream = await api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_body={"x_tokens": 3, "x_end": "interrupted"},
            extra_headers={"X-Request-Id": "cut-sdk"},
        )
        got = []
        with pytest.raises(openai.APIError) as raised:
            async for c in stream:
                got.append(c.choices[0].delta.content)
        assert got == ["tok0 ", "tok1 ", "tok2 "]
        assert raised.value.body["type"] == "interrupted"  # type: ignore[index]
        assert raised.value.body["request_id"] == "cut-sdk"  # type: ignore[index]

        async with scene.router.http.post(
            f"{scene.router.url}/v1/chat/completions",
            json={"model": MODEL, "messages": [], "stream": True, "x_tokens": 2, "x_end": "break"},
            headers={"X-Request-Id": "broken"},
        ) as resp:
            raw = await resp.read()
        events = [e for e in raw.split(b"\n\n") if e]
        assert events[:2] == [chunk_event(0).strip(), chunk_event(1).strip()]
        assert events[2].startswith(b"event: error\ndata: ") and len(events) == 3
        error = json.loads(events[2].split(b"data: ", 1)[1])["error"]
        assert error["type"] == "interrupted" and error["request_id"] == "broken"
        assert b"[DONE]" not in raw

        stream = await api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_body={"x_tokens": 2, "x_end": "break"},
        )
        with pytest.raises(openai.APIError) as raised:
            async for _ in stream:
                pass
        assert raised.value.body["type"] == "interrupted"  # type: ignore[index]

    stats = await scene.router.stats()
    assert stats["interrupted"] == 4 and stats["upstream_errors"] == 2
    assert stats["retried"] == 0
    for rid in ("cut-raw", "cut-sdk", "broken"):
        assert sum(s.request_id == rid for g in gates.values() for s in g.seen) == 1


async def test_the_router_rides_out_a_coordinator_restart(
    scene: Scene, tmp_path: Path, pki: Pki
) -> None:
    """The coordinator stops: the router keeps routing on the table it has (a worker that
    drains meanwhile is refused by its own gate, and retried elsewhere). The coordinator comes
    back on the same address: the router takes a fresh snapshot, rebuilt from the store."""
    router = scene.router
    old = scene.coordinator
    await asyncio.to_thread(old.proc.stop)

    async def watch_lost() -> bool:
        return (await router.get("/routes"))[MODEL]["problem"] != ""

    await eventually(watch_lost, "the router to see its watch go")
    status, _, _ = await router.chat()
    assert status == 200
    scene.gate("node-a").draining = True  # drained locally while the coordinator is away
    status, headers, _ = await router.chat()
    assert (status, headers["X-Worker-Id"]) == (200, scene.workers["node-b"])

    port = int(old.address.rpartition(":")[2])
    new = await asyncio.to_thread(start_coordinator, tmp_path / "restarted", pki, old.db, port)
    try:

        async def resnapshotted() -> bool:
            table = (await router.get("/routes"))[MODEL]
            workers = {w["worker_id"] for w in table["workers"]}
            return table["problem"] == "" and workers == set(scene.workers.values())

        await eventually(resnapshotted, "the router's fresh snapshot", timeout=20)
        status, headers, _ = await router.chat()
        assert status == 200
    finally:
        await asyncio.to_thread(new.proc.stop)


async def test_a_router_with_a_node_certificate_is_refused_at_start(
    tmp_path: Path, coordinator: Coordinator, pki: Pki
) -> None:
    """A router started with a node's certificate: the coordinator refuses its Routes calls
    (PERMISSION_DENIED), and the router says so in one line and exits 1, rather than serving
    503s forever."""
    proc = await asyncio.create_subprocess_exec(
        *router_argv(coordinator, pki.issue("node:node-a")),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 1, err
    assert b"listening" not in out
    assert err.decode().strip().splitlines() == [
        f"spotdrain-router: error: the coordinator at {coordinator.address} refused this "
        "router: PERMISSION_DENIED: node:node-a may not read routes"
    ]


async def test_a_router_identity_may_only_read_routes(coordinator: Coordinator, pki: Pki) -> None:
    channel = aio_channel(coordinator, pki.issue("router:r1"))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.AdminStub(channel).ListNodes(pb.ListNodesRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.AgentLinkStub(channel).Taint(
                pb.TaintRequest(node_id="node-a", reclaim_id="rcl-1", reason="pause"), timeout=5
            )
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.AdminStub(channel).StartWorker(
                pb.StartWorkerRequest(node_id="node-a", model=MODEL, image="x"), timeout=5
            )
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # Its own verb is allowed: no worker, but not refused.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.RoutesStub(channel).PickWorker(
                pb.PickWorkerRequest(model=MODEL), timeout=5
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await channel.close()
    refused = [e for e in coordinator.admin().events() if e["kind"] == "identity_refused"]
    assert [(e["identity"], e["call"]) for e in refused] == [("router:r1", "Taint")]


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "the following arguments are required: --listen, --coordinator"),
        (
            ["--listen", "nohost", "--coordinator", "127.0.0.1:1", "--insecure"],
            "--listen must be HOST:PORT, got 'nohost'",
        ),
        (
            ["--listen", "127.0.0.1:0", "--coordinator", "127.0.0.1:1"],
            "give --tls-cert, --tls-key and --ca, or --insecure",
        ),
        (
            ["--listen", "127.0.0.1:0", "--coordinator", "127.0.0.1:1", "--insecure", "--ca", "/x"],
            "--insecure and TLS flags exclude each other",
        ),
        (
            [
                "--listen",
                "127.0.0.1:0",
                "--coordinator",
                "127.0.0.1:1",
                "--insecure",
                "--attempts",
                "0",
            ],
            "--attempts must be at least 1, got 0",
        ),
        (
            [
                "--listen",
                "127.0.0.1:0",
                "--coordinator",
                "127.0.0.1:1",
                "--tls-cert",
                "/nope",
                "--tls-key",
                "/nope",
                "--ca",
                "/nope",
            ],
            "cannot read CA /nope",
        ),
    ],
)
def test_router_bad_flags_give_one_line_and_exit_2(args, message, capsys):
    try:
        code = router_main(args)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spotdrain-router: error: "), lines
    assert message in lines[0]
