"""The slot gate in front of an inference worker: real HTTP on loopback, both sides.

The worker is a tiny OpenAI-shaped aiohttp server on port 0 (FakeWorker below): a chat
completions endpoint that streams tokens at a set pace and ends with `data: [DONE]` (or answers
JSON after a delay), an echo endpoint, and an endpoint that dies mid-stream. Clients are aiohttp
and the official `openai` SDK. Every test's gate is checked at teardown: its slot counts were a
walk of +1/-1 steps within capacity, it ends with nothing in flight, and on_idle came at most
once (docs/design.md: "Four drain paths", inference row; invariant 7).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fakes.waiting import eventually
from spotdrain.agent.workloads.slot_gate import Interrupted, SlotGate

WORKER = "w-1"


# --- the fake worker -------------------------------------------------------------------------


def chunk_event(i: int, pad: int = 0) -> bytes:
    doc = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "fake",
        "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}],
    }
    if pad:
        doc["pad"] = "x" * pad
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def completion(text: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 0,
        "model": "fake",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
        ],
    }


@dataclass
class FakeWorker:
    """OpenAI-shaped fake inference server. Parameters ride in the JSON body (the SDK's
    extra_body): x_tokens, x_pace_ms, x_delay_ms, x_die ("close", "abort", "mid_event",
    "no_done", "error_event", "abort_after_done"), x_die_after, x_pad (bytes of padding per
    event)."""

    seen: list[dict[str, Any]] = field(default_factory=list)
    endings: dict[str, str] = field(default_factory=dict)  # request id -> how its answer ended
    url: str = ""
    runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_route("*", "/echo/{tail:.*}", self.echo)
        app.router.add_get("/chunked", self.chunked)
        # handler_cancellation: the worker notices at once when the gate closes its request
        # (a real server such as vLLM aborts the generation then).
        self.runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def close(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    async def echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.seen.append({"path": request.path, "headers": dict(request.headers)})
        return web.json_response(
            {
                "method": request.method,
                "path": request.path,
                "query": request.query_string,
                "headers": {k.lower(): v for k, v in request.headers.items()},
                "body": body.decode(),
            },
            status=int(request.query.get("status", "200")),
            headers={"X-Worker": "fake", "Set-Cookie": "a=1"},
        )

    async def chunked(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for i in range(int(request.query.get("n", "3"))):
            await response.write(f"line {i}\n".encode())
            await asyncio.sleep(float(request.query.get("pace", "0.01")))
        if request.query.get("die"):
            assert request.transport is not None
            request.transport.close()
            return response
        await response.write_eof()
        return response

    async def chat(self, request: web.Request) -> web.StreamResponse:
        doc = await request.json()
        rid = request.headers.get("X-Request-Id", "")
        self.seen.append({"path": request.path, "headers": dict(request.headers), "body": doc})
        tokens = int(doc.get("x_tokens", 3))
        pace = doc.get("x_pace_ms", 5) / 1000
        try:
            if not doc.get("stream"):
                await asyncio.sleep(doc.get("x_delay_ms", 0) / 1000)
                text = "".join(f"tok{i} " for i in range(tokens))
                response = web.json_response(completion(text))
                self.endings[rid] = "complete"
                return response
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            die, die_after = doc.get("x_die"), doc.get("x_die_after", 2)
            for i in range(tokens):
                if die in ("close", "abort", "mid_event") and i == die_after:
                    return self.die(request, response, die)
                await response.write(chunk_event(i, doc.get("x_pad", 0)))
                await asyncio.sleep(pace)
            if die == "no_done":
                await response.write_eof()  # a clean HTTP end, but no [DONE]
                self.endings[rid] = "no_done"
                return response
            if die == "error_event":  # the worker's own error (vLLM's shape), then a clean end
                await response.write(b'data: {"error": {"type": "InternalServerError"}}\n\n')
                await response.write_eof()
                self.endings[rid] = "error_event"
                return response
            await response.write(b"data: [DONE]\n\n")
            if die == "abort_after_done":
                return self.die(request, response, "abort")
            await response.write_eof()
            self.endings[rid] = "complete"
            return response
        except ConnectionError:
            self.endings[rid] = "client_gone"  # the gate closed our connection
            return web.Response()  # never sent
        except asyncio.CancelledError:
            self.endings[rid] = "client_gone"
            raise

    def die(self, request: web.Request, response: web.StreamResponse, how: str) -> Any:
        transport = request.transport
        assert transport is not None
        rid = request.headers.get("X-Request-Id", "")
        self.endings[rid] = f"died:{how}"
        if how == "abort":
            transport.abort()  # RST, as when the container is SIGKILLed with data unread
        elif how == "mid_event":
            # Half an event, its chunk framed so the gate's HTTP parser accepts it, then FIN.
            half = b'data: {"id": "chatcmpl-fake", "choi'
            transport.write(b"%x\r\n%s\r\n" % (len(half), half))
            transport.close()
        else:
            transport.close()  # FIN in the middle of the chunked body
        return response


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the gate under test, with what it reported ----------------------------------------------


@dataclass
class Gate:
    gate: SlotGate
    slots: list[int] = field(default_factory=list)
    idle: list[str] = field(default_factory=list)
    interrupted: list[Interrupted] = field(default_factory=list)
    # on_slots value at the moment on_idle was called: the stop must follow the last release
    idle_at_slots: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.gate.url

    def check(self) -> None:
        """Teardown invariants: a walk of +1/-1 steps from 0 within capacity, ending at 0;
        on_idle at most once, only while draining with nothing in flight."""
        level = 0
        for value in self.slots:
            assert abs(value - level) == 1, self.slots
            assert 0 <= value <= self.gate.capacity, self.slots
            level = value
        assert level == 0 and self.gate.in_flight == 0, self.slots
        assert len(self.idle) <= 1, self.idle
        assert all(v == 0 for v in self.idle_at_slots)
        if self.idle:
            assert self.gate.draining
        ids = [i.request_id for i in self.interrupted]
        assert len(ids) == len(set(ids)), f"a request reported twice: {ids}"


async def open_gate(upstream: str, **kwargs: Any) -> Gate:
    g: Gate

    def on_idle(worker_id: str) -> None:
        g.idle.append(worker_id)
        g.idle_at_slots.append(g.gate.in_flight)

    gate = SlotGate(
        WORKER,
        upstream,
        on_slots=lambda w, n: g.slots.append(n),
        on_idle=on_idle,
        on_interrupted=lambda what: g.interrupted.append(what),
        **{"capacity": 64, **kwargs},
    )
    g = Gate(gate)
    await gate.start()
    return g


@pytest.fixture
async def worker() -> AsyncIterator[FakeWorker]:
    w = FakeWorker()
    await w.start()
    yield w
    await w.close()


@pytest.fixture
async def make_gate() -> AsyncIterator[Callable[..., Any]]:
    made: list[Gate] = []

    async def make(upstream: str, **kwargs: Any) -> Gate:
        g = await open_gate(upstream, **kwargs)
        made.append(g)
        return g

    yield make
    for g in made:
        await g.gate.close()
        g.check()


@pytest.fixture
async def gate(worker: FakeWorker, make_gate: Callable[..., Any]) -> Gate:
    return await make_gate(worker.url)


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def chat(stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {
        "model": "fake",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        **extra,
    }


async def read_events(resp: aiohttp.ClientResponse, n: int) -> bytes:
    """Read until n SSE events have arrived (a stream still open)."""
    got = b""
    while got.count(b"\n\n") < n:
        piece = await asyncio.wait_for(resp.content.readany(), 5)
        assert piece, f"stream ended after {got!r}"
        got += piece
    return got


def error_events(text: str) -> list[dict[str, Any]]:
    """The `event: error` events of an SSE body, their data parsed."""
    out = []
    for block in text.split("\n\n"):
        lines = block.split("\n")
        if "event: error" in lines:
            data = [ln[len("data: ") :] for ln in lines if ln.startswith("data: ")]
            out.append(json.loads("\n".join(data)))
    return out


# --- passing through -------------------------------------------------------------------------


async def test_requests_pass_through_with_method_path_query_headers_body_and_status(
    gate: Gate, worker: FakeWorker, client: aiohttp.ClientSession
) -> None:
    """A request through the gate reaches the worker as sent (less hop-by-hop headers), and
    the worker's answer comes back as given, with the request id both ways."""
    async with client.put(
        f"{gate.url}/echo/a/b?x=1&y=two&status=201",
        data=b"the body",
        headers={
            "X-Request-Id": "req-1",
            "Authorization": "Bearer t",
            "Connection": "keep-alive, X-Hop",
            "X-Hop": "private to this hop",
        },
    ) as resp:
        assert resp.status == 201
        assert resp.headers["X-Worker"] == "fake"
        assert resp.headers["Set-Cookie"] == "a=1"
        assert resp.headers["X-Request-Id"] == "req-1"
        seen = await resp.json()
    assert seen["method"] == "PUT"
    assert seen["path"] == "/echo/a/b"
    assert seen["query"] == "x=1&y=two&status=201"
    assert seen["body"] == "the body"
    assert seen["headers"]["authorization"] == "Bearer t"
    assert seen["headers"]["x-request-id"] == "req-1"
    assert "x-hop" not in seen["headers"]

    async with client.get(f"{gate.url}/echo/") as resp:
        assert resp.status == 200
        made = resp.headers["X-Request-Id"]
        assert (await resp.json())["headers"]["x-request-id"] == made  # a new uuid4, passed up
    assert len(made) == 36
    assert gate.slots == [1, 0, 1, 0]
    assert gate.interrupted == [] and gate.idle == []


async def test_a_client_that_expects_100_continue_gets_it_and_its_body_through(
    gate: Gate, client: aiohttp.ClientSession
) -> None:
    async with client.post(f"{gate.url}/echo/up", data=b"y" * 5000, expect100=True) as resp:
        assert resp.status == 200
        seen = await resp.json()
    assert seen["body"] == "y" * 5000
    assert "expect" not in seen["headers"]


async def test_a_chunked_answer_that_is_not_sse_is_relayed_whole(
    gate: Gate, client: aiohttp.ClientSession
) -> None:
    async with client.get(f"{gate.url}/chunked?n=4") as resp:
        assert resp.status == 200
        assert await resp.text() == "".join(f"line {i}\n" for i in range(4))
    assert gate.interrupted == []


async def test_a_chunked_answer_the_worker_breaks_is_truncated_for_the_client(
    gate: Gate, client: aiohttp.ClientSession
) -> None:
    """Not SSE, so no error event to send: the client's body is cut short, never clean."""
    async with client.get(f"{gate.url}/chunked?n=2&die=1") as resp:
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    await eventually(lambda: gate.gate.in_flight == 0, "slot released")
    assert [(i.streamed, i.reason) for i in gate.interrupted] == [(True, "upstream_failed")]


async def test_an_open_stream_holds_its_slot_until_its_last_byte(
    gate: Gate, client: aiohttp.ClientSession
) -> None:
    async with client.post(
        f"{gate.url}/v1/chat/completions", json=chat(x_tokens=4, x_pace_ms=30)
    ) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        await read_events(resp, 1)
        assert gate.gate.in_flight == 1
        assert gate.slots == [1]
        rest = (await resp.read()).decode()
    assert rest.endswith("data: [DONE]\n\n")
    assert gate.slots == [1, 0]
    assert gate.gate.in_flight == 0


async def test_the_gate_has_capacity_slots_and_refuses_one_more(
    worker: FakeWorker, make_gate: Callable[..., Any], client: aiohttp.ClientSession
) -> None:
    g = await make_gate(worker.url, capacity=1, retry_after_s=3)
    async with client.post(
        f"{g.url}/v1/chat/completions", json=chat(x_tokens=3, x_pace_ms=30)
    ) as first:
        await read_events(first, 1)
        async with client.post(f"{g.url}/v1/chat/completions", json=chat()) as second:
            assert second.status == 429
            assert second.headers["Retry-After"] == "3"
            assert (await second.json())["error"]["type"] == "worker_busy"
        assert (await first.read()).endswith(b"data: [DONE]\n\n")
    async with client.post(f"{g.url}/v1/chat/completions", json=chat(stream=False)) as third:
        assert third.status == 200
    assert g.slots == [1, 0, 1, 0]


# --- draining --------------------------------------------------------------------------------


async def test_the_owner_pauses_while_a_stream_is_open(
    gate: Gate, client: aiohttp.ClientSession
) -> None:
    """Drain: a new request is refused with 503 and Retry-After; the open stream runs to its
    [DONE]; then, and only then, on_idle fires, once."""
    async with client.post(
        f"{gate.url}/v1/chat/completions", json=chat(x_tokens=6, x_pace_ms=30)
    ) as stream:
        await read_events(stream, 1)
        gate.gate.drain()
        assert gate.gate.draining
        async with client.post(f"{gate.url}/v1/chat/completions", json=chat()) as refused:
            assert refused.status == 503
            assert refused.headers["Retry-After"] == "1"
            body = await refused.json()
        assert body["error"]["type"] == "worker_draining"
        assert body["error"]["message"]
        assert gate.idle == []
        rest = await stream.read()
    assert rest.endswith(b"data: [DONE]\n\n")
    assert b"event: error" not in rest
    assert gate.idle == [WORKER]
    assert gate.idle_at_slots == [0]
    assert gate.slots == [1, 0]
    gate.gate.drain()  # again: nothing new
    assert gate.idle == [WORKER]
    assert gate.interrupted == []


async def test_a_drain_with_nothing_in_flight_is_idle_at_once(gate: Gate) -> None:
    gate.gate.drain()
    assert gate.idle == [WORKER]  # synchronously, from drain() itself
    gate.gate.drain()
    await gate.gate.cut()
    assert gate.idle == [WORKER]


async def test_last_slot_released_to_on_idle_is_immediate(
    gate: Gate, client: aiohttp.ClientSession
) -> None:
    """Event-driven: on_idle runs in the same step that releases the last slot (docs/design.md
    target: last slot released to stop issued, p99 <= 50 ms; no poll)."""
    stamps: dict[str, float] = {}
    on_slots = gate.gate._on_slots

    def slots(worker_id: str, n: int) -> None:
        on_slots(worker_id, n)
        if n == 0:
            stamps["released"] = time.perf_counter()

    def idle(worker_id: str) -> None:
        stamps["idle"] = time.perf_counter()

    gate.gate._on_slots, gate.gate._on_idle = slots, idle
    async with client.post(
        f"{gate.url}/v1/chat/completions", json=chat(x_tokens=3, x_pace_ms=20)
    ) as stream:
        await read_events(stream, 1)
        gate.gate.drain()
        await stream.read()
    assert stamps["idle"] - stamps["released"] < 0.005


# --- cutting ---------------------------------------------------------------------------------


async def test_the_grace_deadline_cuts_an_open_stream(
    gate: Gate, worker: FakeWorker, client: aiohttp.ClientSession
) -> None:
    """cut(): the client gets an `error` event of type interrupted and never `[DONE]`; the
    request is reported interrupted with its id; the worker's request is closed."""
    async with client.post(
        f"{gate.url}/v1/chat/completions",
        json=chat(x_tokens=100, x_pace_ms=20),
        headers={"X-Request-Id": "long-1"},
    ) as stream:
        head = await read_events(stream, 2)
        await gate.gate.cut()
        text = (head + await stream.read()).decode()
    assert "[DONE]" not in text
    assert text.count("tok") >= 2
    assert text.endswith("\n\n")
    errors = error_events(text)
    assert len(errors) == 1
    assert errors[0]["error"]["type"] == "interrupted"
    assert errors[0]["error"]["request_id"] == "long-1"
    assert errors[0]["error"]["message"]
    assert gate.interrupted == [Interrupted(WORKER, "long-1", True, "stopped")]
    assert gate.gate.in_flight == 0 and gate.idle == [WORKER]
    await eventually(lambda: worker.endings.get("long-1") == "client_gone", "worker request closed")
    async with client.post(f"{gate.url}/v1/chat/completions", json=chat()) as after:
        assert after.status == 503  # still draining after a cut


async def test_the_grace_deadline_cuts_a_request_waiting_for_its_answer(
    gate: Gate, worker: FakeWorker, client: aiohttp.ClientSession
) -> None:
    """Not streamed: the client gets 503 with an interrupted error body."""
    request = asyncio.create_task(
        client.post(
            f"{gate.url}/v1/chat/completions",
            json=chat(stream=False, x_delay_ms=5000),
            headers={"X-Request-Id": "slow-1"},
        )
    )
    await eventually(lambda: worker.seen, "the worker to get the request")
    await gate.gate.cut()
    async with await request as resp:
        assert resp.status == 503
        assert resp.headers["X-Request-Id"] == "slow-1"
        body = await resp.json()
    assert body["error"]["type"] == "interrupted"
    assert body["error"]["request_id"] == "slow-1"
    assert gate.interrupted == [Interrupted(WORKER, "slow-1", False, "stopped")]
    assert gate.idle == [WORKER]


async def test_a_cut_is_not_held_up_by_a_client_that_stopped_reading(
    gate: Gate, worker: FakeWorker
) -> None:
    """A client that stopped reading, every buffer to it full: cut() returns at once (the
    error event waits in the gate's send buffer), and the client, reading on, finds it at the
    end, without [DONE]."""
    host, port = gate.gate.address.rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.setblocking(False)
    body = json.dumps(chat(x_tokens=100_000, x_pace_ms=0, x_pad=60_000)).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gate\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: stuck\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_sendall(sock, head.encode() + body)
        await eventually(lambda: gate.gate.in_flight == 1 and worker.seen, "the stream to open")
        await asyncio.sleep(0.3)  # not reading: the gate's writes to us block
        t0 = time.monotonic()
        await gate.gate.cut()
        assert time.monotonic() - t0 < 0.5
        assert gate.interrupted == [Interrupted(WORKER, "stuck", True, "stopped")]
        assert gate.gate.in_flight == 0 and gate.idle == [WORKER]
        received = bytearray()
        while not received.endswith(b"\r\n0\r\n\r\n"):
            piece = await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 5)
            assert piece, "connection closed before the end of the response"
            received += piece
    finally:
        sock.close()
    assert len(received) > 1_000_000  # the gate really was blocked on us
    assert b"event: error" in received[-1000:]
    assert b"[DONE]" not in received
    await eventually(lambda: worker.endings.get("stuck") == "client_gone", "worker request closed")


async def test_closing_the_gate_cuts_open_streams_but_is_no_drain(
    gate: Gate, client: aiohttp.ClientSession
) -> None:
    """The agent shutting down closes its gates: open streams end with the interrupted error
    and are reported, but on_idle is not called (SIGTERM to the agent stops no workload)."""
    async with client.post(
        f"{gate.url}/v1/chat/completions",
        json=chat(x_tokens=100, x_pace_ms=20),
        headers={"X-Request-Id": "at-shutdown"},
    ) as stream:
        await read_events(stream, 1)
        await gate.gate.close()
        text = (await stream.read()).decode()
    assert error_events(text)[0]["error"]["request_id"] == "at-shutdown"
    assert "[DONE]" not in text
    assert gate.interrupted == [Interrupted(WORKER, "at-shutdown", True, "stopped")]
    assert gate.idle == [] and not gate.gate.draining


async def test_a_cut_after_the_stream_finished_is_not_an_interruption(
    gate: Gate, client: aiohttp.ClientSession
) -> None:
    async with client.post(f"{gate.url}/v1/chat/completions", json=chat(x_tokens=2)) as stream:
        assert (await stream.read()).endswith(b"data: [DONE]\n\n")
    await gate.gate.cut()
    assert gate.interrupted == []


# --- the worker failing ----------------------------------------------------------------------


@pytest.mark.parametrize("how", ["close", "abort", "mid_event", "no_done"])
async def test_the_worker_dies_mid_stream(
    how: str, gate: Gate, client: aiohttp.ClientSession
) -> None:
    """The worker container is killed (FIN or RST mid-body, even mid-event) or ends its stream
    without [DONE]: the client never sees a clean end but an interrupted error event, after
    whole events only; reported as upstream_failed."""
    async with client.post(
        f"{gate.url}/v1/chat/completions",
        json=chat(x_tokens=5, x_die=how, x_die_after=3),
        headers={"X-Request-Id": f"dies-{how}"},
    ) as stream:
        assert stream.status == 200
        text = (await stream.read()).decode()
    blocks = [b for b in text.split("\n\n") if b]
    tokens, last = blocks[:-1], blocks[-1]
    expected = 5 if how == "no_done" else 3
    assert [json.loads(b.removeprefix("data: ")) for b in tokens] == [
        json.loads(chunk_event(i).decode().removeprefix("data: ")) for i in range(expected)
    ]
    assert last.startswith("event: error\ndata: ")
    assert error_events(text)[0]["error"]["type"] == "interrupted"
    assert "[DONE]" not in text
    assert gate.interrupted == [Interrupted(WORKER, f"dies-{how}", True, "upstream_failed")]


async def test_a_worker_that_ends_with_its_own_error_event_gets_no_second_one(
    gate: Gate, client: aiohttp.ClientSession
) -> None:
    """The worker says error itself and ends its stream: the client has its explicit error
    (the openai SDK raises on it), so the gate adds none; still reported, the answer is cut."""
    async with client.post(
        f"{gate.url}/v1/chat/completions",
        json=chat(x_tokens=2, x_die="error_event"),
        headers={"X-Request-Id": "own-error"},
    ) as stream:
        text = (await stream.read()).decode()
    blocks = [b for b in text.split("\n\n") if b]
    assert blocks[-1] == 'data: {"error": {"type": "InternalServerError"}}'
    assert len(blocks) == 3 and not error_events(text)
    assert gate.interrupted == [Interrupted(WORKER, "own-error", True, "upstream_failed")]


async def test_a_worker_killed_after_its_done_went_out_gave_a_complete_answer(
    gate: Gate, client: aiohttp.ClientSession
) -> None:
    """What the client holds decides: [DONE] reached it, so the answer is whole even though
    the worker's connection then reset; nothing is reported interrupted or appended."""
    async with client.post(
        f"{gate.url}/v1/chat/completions",
        json=chat(x_tokens=2, x_die="abort_after_done"),
        headers={"X-Request-Id": "done-then-reset"},
    ) as stream:
        text = (await stream.read()).decode()
    assert text.endswith("data: [DONE]\n\n") and not error_events(text)
    assert gate.interrupted == []


async def test_an_unreachable_worker_is_502_and_not_an_interruption(
    make_gate: Callable[..., Any], client: aiohttp.ClientSession
) -> None:
    g = await make_gate(f"http://127.0.0.1:{free_port()}")
    async with client.post(f"{g.url}/v1/chat/completions", json=chat()) as resp:
        assert resp.status == 502
        assert (await resp.json())["error"]["type"] == "upstream_unavailable"
    g.gate.drain()
    async with client.post(f"{g.url}/v1/chat/completions", json=chat()) as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["type"] == "worker_draining"
    assert g.interrupted == []
    assert g.slots == [1, 0]


# --- the client going away -------------------------------------------------------------------


async def test_a_client_that_leaves_mid_stream_frees_its_slot(
    gate: Gate, worker: FakeWorker, client: aiohttp.ClientSession
) -> None:
    """Between two slow tokens: the slot is released at once (not at the next token), the
    worker's request is closed, and nothing is reported interrupted."""
    resp = await client.post(
        f"{gate.url}/v1/chat/completions",
        json=chat(x_tokens=3, x_pace_ms=10_000),
        headers={"X-Request-Id": "leaver"},
    )
    await read_events(resp, 1)
    gate.gate.drain()
    resp.close()
    t0 = time.monotonic()
    await eventually(lambda: gate.gate.in_flight == 0, "slot released", timeout=2)
    assert time.monotonic() - t0 < 1.0
    await eventually(lambda: worker.endings.get("leaver") == "client_gone", "worker request closed")
    assert gate.interrupted == []
    assert gate.idle == [WORKER]


# --- the official OpenAI SDK -----------------------------------------------------------------


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def test_the_openai_sdk_reads_a_complete_stream(gate: Gate) -> None:
    async with sdk(gate.url) as api:
        stream = await api.chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_body={"x_tokens": 4},
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == "tok0 tok1 tok2 tok3 "


async def test_the_openai_sdk_raises_on_a_cut_stream(gate: Gate) -> None:
    """The SDK raises openai.APIError (the base class; status was 200) from the error event's
    data line, with the interrupted error object as its body."""
    async with sdk(gate.url) as api:
        stream = await api.chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_body={"x_tokens": 100, "x_pace_ms": 10},
            extra_headers={"X-Request-Id": "sdk-cut"},
        )
        got: list[str] = []
        with pytest.raises(openai.APIError) as raised:
            async for c in stream:
                got.append(c.choices[0].delta.content or "")
                if len(got) == 2:
                    cutting = asyncio.create_task(gate.gate.cut())
        await cutting
    assert type(raised.value) is openai.APIError
    assert raised.value.body == {
        "type": "interrupted",
        "message": raised.value.message,
        "request_id": "sdk-cut",
    }
    assert gate.interrupted == [Interrupted(WORKER, "sdk-cut", True, "stopped")]


async def test_the_openai_sdk_raises_when_the_worker_dies_mid_stream(gate: Gate) -> None:
    async with sdk(gate.url) as api:
        stream = await api.chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_body={"x_tokens": 5, "x_die": "abort"},
        )
        with pytest.raises(openai.APIError) as raised:
            async for _ in stream:
                pass
    assert raised.value.body["type"] == "interrupted"


async def test_the_openai_sdk_alone_does_not_notice_a_stream_that_just_stops(
    worker: FakeWorker,
) -> None:
    """Why the gate sends its error event: straight from a worker whose stream ends cleanly
    without [DONE], the SDK ends the iteration as if the answer were complete."""
    async with sdk(worker.url) as api:
        stream = await api.chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_body={"x_tokens": 5, "x_die": "no_done", "x_die_after": 99},
        )
        chunks = [c async for c in stream]
    assert len(chunks) == 5


# --- many streams, cut at any moment ---------------------------------------------------------


@dataclass(frozen=True)
class Req:
    streamed: bool
    tokens: int  # streamed: tokens at pace_ms; not streamed: answered after tokens * pace_ms
    pace_ms: int
    leaves_after: int | None  # streamed only: the client goes away after this many events


requests_ = st.builds(
    Req,
    streamed=st.booleans(),
    tokens=st.integers(1, 12),
    pace_ms=st.integers(5, 20),
    leaves_after=st.none() | st.integers(1, 3),
)


async def many_streams(reqs: list[Req], cut_after_ms: int | None) -> dict[str, str]:
    worker = FakeWorker()
    await worker.start()
    g = await open_gate(worker.url, capacity=len(reqs))
    outcomes: dict[str, str] = {}
    try:
        async with aiohttp.ClientSession() as client:

            async def one(i: int, req: Req) -> None:
                rid = f"r{i}"
                body = chat(
                    stream=req.streamed,
                    x_tokens=req.tokens,
                    x_pace_ms=req.pace_ms,
                    x_delay_ms=req.tokens * req.pace_ms,
                )
                async with client.post(
                    f"{g.url}/v1/chat/completions", json=body, headers={"X-Request-Id": rid}
                ) as resp:
                    if resp.status != 200:  # cut before the worker's answer began
                        outcomes[rid] = f"{resp.status}:{(await resp.json())['error']['type']}"
                        return
                    if not req.streamed:
                        await resp.json()
                        outcomes[rid] = "complete"
                        return
                    if req.leaves_after is not None:
                        text = ""
                        while text.count("\n\n") < req.leaves_after and "[DONE]" not in text:
                            piece = await resp.content.readany()
                            if not piece:
                                break
                            text += piece.decode()
                        outcomes[rid] = "left"
                        return
                    text = (await resp.read()).decode()
                errors = error_events(text)
                done = "data: [DONE]" in text
                assert not (errors and done), f"{rid}: both an error and [DONE]: {text!r}"
                if errors:
                    assert errors == [
                        {"error": {**errors[0]["error"], "type": "interrupted", "request_id": rid}}
                    ]
                outcomes[rid] = "complete" if done else "error_event" if errors else "neither"

            async def deadline() -> None:
                # Every request has reached the worker (some short ones may be over already).
                await eventually(lambda: len(worker.seen) == len(reqs), "all requests in")
                g.gate.drain()
                if cut_after_ms is not None:
                    await asyncio.sleep(cut_after_ms / 1000)
                    await g.gate.cut()

            tasks = [one(i, r) for i, r in enumerate(reqs)]
            await asyncio.wait_for(asyncio.gather(deadline(), *tasks), 20)
        await eventually(lambda: g.gate.in_flight == 0, "every slot released")
    finally:
        await g.gate.close()
        await worker.close()
    g.check()
    assert g.idle == [WORKER]
    reported = {i.request_id: i for i in g.interrupted}
    for i in range(len(reqs)):
        rid = f"r{i}"
        outcome = outcomes[rid]
        if outcome == "left":
            continue  # a client that left may or may not have been cut before it left
        assert outcome != "neither", rid
        if outcome == "complete":
            assert rid not in reported, f"{rid} completed and was reported interrupted"
        else:
            assert outcome in ("error_event", "503:interrupted"), (rid, outcome)
            streamed = outcome == "error_event"
            assert reported[rid] == Interrupted(WORKER, rid, streamed, "stopped")
    assert all(outcomes[rid] != "complete" for rid in reported)
    if cut_after_ms is None:
        assert g.interrupted == []
    return outcomes


async def test_fifty_requests_cut_at_once_some_done_some_not() -> None:
    """The same property, one fixed scene that surely has both sides: short streams that are
    over before the cut, long ones open at it, answers still being computed."""
    reqs = [Req(True, 2, 5, None)] * 15 + [Req(True, 40, 10, None)] * 25
    reqs += [Req(False, 1, 5, None)] * 5 + [Req(False, 100, 10, None)] * 5
    outcomes = await many_streams(reqs, cut_after_ms=100)
    assert sorted(set(outcomes.values())) == ["503:interrupted", "complete", "error_event"]
    assert list(outcomes.values()).count("error_event") == 25


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    reqs=st.lists(requests_, min_size=1, max_size=12),
    cut_after_ms=st.none() | st.integers(0, 80),
)
def test_many_requests_each_end_complete_or_interrupted_never_both(
    reqs: list[Req], cut_after_ms: int | None
) -> None:
    """N concurrent requests through a draining gate, cut at a random moment: every slot is
    released, on_idle fires once, and each request either completed (its [DONE] or its 200)
    and was not reported, or was reported interrupted and its client saw the error: never
    both, never neither."""
    outcomes = asyncio.run(many_streams(reqs, cut_after_ms))
    for outcome in sorted(set(outcomes.values())):
        event(f"outcome {outcome}")  # shown by --hypothesis-show-statistics
