"""The slot gate: an HTTP reverse proxy in front of one inference worker.

Every request to the worker passes through here, so the agent knows at each moment how many
slots are in use, can refuse new requests the moment a drain starts, and can end open streams
at the grace deadline (docs/design.md, "Four drain paths", inference row).

- A request holds a slot from arrival until its response is finished (for a stream: the last
  byte written, or the client gone). `on_slots(worker_id, in_flight)` on every change. At most
  `capacity` slots: one more request gets 429 `worker_busy` with Retry-After.
- `drain()`: every new request gets 503 `worker_draining` with Retry-After; open ones go on.
  `on_idle(worker_id)` is called once, from the code that releases the last slot (no polling:
  the agent stops the worker from it; DESIGN target "last slot released to stop issued",
  p99 <= 50 ms), or from `drain()` itself when nothing is in flight.
- `cut()`, the grace deadline: every open request ends now and is reported `Interrupted`
  (reason "stopped"). So is a request the worker fails mid-response (reason "upstream_failed":
  the container was killed, the connection reset, or an SSE stream ended without
  `data: [DONE]`). A client that goes away is not interrupted: its slot is released and the
  upstream request closed, so the worker stops generating for it.

What the client sees of a cut, and the answers the gate gives itself, are gate_answers.py's.
Responses with a Content-Length are read whole and then sent (small JSON answers; never half
sent, so a cut can still answer 503). SSE and chunked responses are relayed chunk by chunk as
they arrive. The hot path (one streamed chunk) is one read, a length check, one write.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import hdrs, web

from spotdrain.agent.workloads.gate_answers import (
    answer,
    error_response,
    interrupted_message,
    send,
)
from spotdrain.http import sse
from spotdrain.http.relay import Ending, StreamRelay, is_stream
from spotdrain.http.sse import REQUEST_ID_HEADER

log = logging.getLogger("spotdrain.agent.gate")

# Slot phases. A cut acts on WAITING and RELAYING only: a FINISHING slot has its whole answer
# and is ending normally, so it is never reported interrupted as well (never both).
_WAITING, _RELAYING, _FINISHING = 0, 1, 2

# Idle connections to the worker are dropped before a typical server's keep-alive (uvicorn: 5 s)
# would drop them, so a request is never sent on a connection the worker is closing (that would
# look like the worker failing mid-request).
UPSTREAM_KEEPALIVE_S = 4.0
UPSTREAM_CONNECT_TIMEOUT_S = 5.0
# Beyond the hop-by-hop set: aiohttp recomputes Content-Length on the way back.
_NOT_RETURNED = frozenset({"content-length"})
DRAINING_MESSAGE = "the worker is draining; retry elsewhere"


@dataclass(frozen=True)
class Interrupted:
    """A request cut while in flight (docs/design.md invariant 7: reported, never a finished
    answer)."""

    worker_id: str
    request_id: str
    streamed: bool  # the client had a streamed response (headers sent) open when it was cut
    reason: str  # "stopped" (the gate cut it) or "upstream_failed" (the worker died or broke)


def _ignore(*_args: object) -> None:
    return None


class _Slot:
    __slots__ = ("request_id", "task", "phase", "cut", "finished")

    def __init__(self, request_id: str, task: asyncio.Task[object] | None) -> None:
        self.request_id = request_id
        self.task = task
        self.phase = _WAITING
        self.cut = False  # cut() asked this request to end; its task was cancelled for it
        self.finished: asyncio.Future[None] | None = None  # made by cut(), to wait for the end


class SlotGate:
    def __init__(
        self,
        worker_id: str,
        upstream: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        capacity: int = 1,
        on_slots: Callable[[str, int], None] = _ignore,
        on_idle: Callable[[str], None] = _ignore,
        on_interrupted: Callable[[Interrupted], None] = _ignore,
        on_refused: Callable[[str], None] = _ignore,
        retry_after_s: int = 1,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"gate {worker_id}: capacity must be >= 1, got {capacity}")
        self.worker_id = worker_id
        self.upstream = upstream.rstrip("/")
        self.capacity = capacity
        self._host = host
        self._port = port
        self._on_slots = on_slots
        self._on_idle = on_idle
        self._on_interrupted = on_interrupted
        self._on_refused = on_refused  # (why): "worker_draining" or "worker_busy", for metrics
        self._retry_after = str(retry_after_s)
        self._slots: set[_Slot] = set()
        self._in_flight = 0
        self._draining = False
        self._idle_reported = False
        self._closing = False
        self._address = ""
        self._runner: web.ServerRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> str:
        """Bind and serve; returns the "host:port" actually bound."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=max(256, self.capacity),
                limit_per_host=0,
                keepalive_timeout=UPSTREAM_KEEPALIVE_S,
            ),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=UPSTREAM_CONNECT_TIMEOUT_S, sock_read=None
            ),
            # Bytes pass through untouched: no decompression, and no headers the client did not
            # send (an added Accept-Encoding would get it a body encoding it never asked for).
            auto_decompress=False,
            skip_auto_headers=(hdrs.ACCEPT_ENCODING, hdrs.USER_AGENT, hdrs.ACCEPT),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        # handler_cancellation: a client that goes away cancels its handler at once, so its slot
        # is released and the worker's request closed even while no byte is moving.
        server = web.Server(self._handle, handler_cancellation=True, access_log=None)
        self._runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port, backlog=1024)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self._address = f"{host}:{port}"
        log.info("gate %s: serving on %s for %s", self.worker_id, self._address, self.upstream)
        return self._address

    async def close(self) -> None:
        """Stop serving. Whatever is still in flight is cut and reported; this is not a drain
        (on_idle is not called: closing the gate, as on agent shutdown, stops no worker)."""
        if self._closing:
            return
        self._closing = True
        await self._cut_open()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # --- state -------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        return self._address

    @property
    def url(self) -> str:
        return f"http://{self._address}"

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def draining(self) -> bool:
        return self._draining

    # --- drain and cut -----------------------------------------------------------------------

    def drain(self) -> None:
        """Refuse every new request from now on; open ones go on. Calling it again is a no-op."""
        if self._draining:
            return
        self._draining = True
        log.info("gate %s: draining, %d in flight", self.worker_id, self._in_flight)
        if self._in_flight == 0:
            self._report_idle()

    async def cut(self) -> None:
        """The grace deadline: end every in-flight request now, each reported `Interrupted`.
        The gate stays draining. Returns when every cut request has ended (bounded by
        spotdrain.http.sse.FINAL_WRITE_TIMEOUT_S for clients that do not read)."""
        self.drain()
        await self._cut_open()

    async def _cut_open(self) -> None:
        victims = [s for s in self._slots if s.phase != _FINISHING and not s.cut]
        if victims:
            log.warning("gate %s: cutting %d open requests", self.worker_id, len(victims))
        loop = asyncio.get_running_loop()
        for slot in victims:
            slot.cut = True
            slot.finished = loop.create_future()
            # The handler decides, where it stands, what the client gets and whether it was
            # interrupted; a cancel reaches it wherever it waits (the worker or a slow client).
            if slot.task is not None:
                slot.task.cancel()
        # Also the ones an earlier cut() is still ending: return only when all have ended.
        waits = [s.finished for s in self._slots if s.finished is not None]
        if not waits:
            return
        _, pending = await asyncio.wait(waits, timeout=sse.FINAL_WRITE_TIMEOUT_S + 1.0)
        if pending:
            log.error("gate %s: %d cut requests did not end", self.worker_id, len(pending))

    # --- slots -------------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[..., None], *args: object) -> None:
        # A failing callback must not break the proxy or leak a slot.
        try:
            fn(*args)
        except Exception:
            log.exception("gate %s: %s callback failed", self.worker_id, what)

    def _take(self, slot: _Slot) -> None:
        self._slots.add(slot)
        self._in_flight += 1
        self._call("on_slots", self._on_slots, self.worker_id, self._in_flight)

    def _release(self, slot: _Slot) -> None:
        self._slots.discard(slot)
        self._in_flight -= 1
        self._call("on_slots", self._on_slots, self.worker_id, self._in_flight)
        if slot.finished is not None and not slot.finished.done():
            slot.finished.set_result(None)
        if self._draining and self._in_flight == 0:
            self._report_idle()

    def _report_idle(self) -> None:
        if self._idle_reported:
            return
        self._idle_reported = True
        log.info("gate %s: idle while draining", self.worker_id)
        self._call("on_idle", self._on_idle, self.worker_id)

    def _report_interrupted(self, slot: _Slot, streamed: bool, reason: str) -> None:
        log.warning(
            "gate %s: request %s interrupted (%s, %s)",
            self.worker_id,
            slot.request_id,
            reason,
            "streamed" if streamed else "not streamed",
        )
        self._call(
            "on_interrupted",
            self._on_interrupted,
            Interrupted(self.worker_id, slot.request_id, streamed, reason),
        )

    # --- the proxy ---------------------------------------------------------------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if self._draining or self._closing:
            self._call("on_refused", self._on_refused, "worker_draining")
            return self._refusal(503, "worker_draining", DRAINING_MESSAGE)
        if self._in_flight >= self.capacity:
            self._call("on_refused", self._on_refused, "worker_busy")
            return self._refusal(429, "worker_busy", f"all {self.capacity} slots are in use")
        slot = _Slot(
            request.headers.get(REQUEST_ID_HEADER) or str(uuid.uuid4()), asyncio.current_task()
        )
        self._take(slot)
        try:
            return await self._forward(request, slot)
        finally:
            self._release(slot)

    async def _forward(self, request: web.BaseRequest, slot: _Slot) -> web.StreamResponse:
        """One request, start to end. Returns the finished response (streams: prepared and
        ended here, so the slot is held until the last byte is written)."""
        assert self._session is not None
        if request.headers.get(hdrs.EXPECT, "").lower() == "100-continue":
            # Expect is not forwarded (the worker's interim answer would be lost on the way), so
            # the gate answers it, as aiohttp's router would.
            try:
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            except ConnectionError:
                return web.Response()  # the client went away; never sent
        upstream: aiohttp.ClientResponse | None = None
        try:
            try:
                upstream = await self._session.request(
                    request.method,
                    self.upstream + request.raw_path,
                    headers=sse.forwarded(request.headers, slot.request_id),
                    data=request.content if request.body_exists else None,
                    allow_redirects=False,
                )
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
                # Never connected: no request was ever in the worker, nothing was interrupted.
                log.warning("gate %s: worker unreachable: %s", self.worker_id, e)
                if self._draining or self._closing:
                    return await answer(
                        request, self._refusal(503, "worker_draining", DRAINING_MESSAGE)
                    )
                message = f"worker unreachable at {self.upstream}"
                return await answer(request, self._refusal(502, "upstream_unavailable", message))
            headers = sse.forwarded(upstream.headers, slot.request_id, _NOT_RETURNED)
            if is_stream(upstream):
                response = web.StreamResponse(
                    status=upstream.status, reason=upstream.reason, headers=headers
                )
                await response.prepare(request)
                return await self._relay(request, upstream, response, slot)
            body = await upstream.read()
        except asyncio.CancelledError:
            # A cut while waiting for the worker's answer. Once relaying, _relay has decided.
            if slot.phase != _WAITING or not slot.cut or _uncancel() > 0:
                raise  # the client went away (or the server is shutting down): not interrupted
            self._report_interrupted(slot, False, "stopped")
            return await self._answer_interrupted(request, slot, 503, "stopped by the gate")
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            if slot.phase != _WAITING:
                raise
            # Connected, then the worker broke before its whole answer was in: it was in flight.
            log.warning("gate %s: worker failed request %s: %r", self.worker_id, slot.request_id, e)
            self._report_interrupted(slot, False, "upstream_failed")
            return await self._answer_interrupted(request, slot, 502, "the worker failed")
        finally:
            if upstream is not None:
                upstream.close()  # no-op after a complete answer; else the worker sees us go
        slot.phase = _FINISHING
        response = web.Response(
            status=upstream.status, reason=upstream.reason, body=body, headers=headers
        )
        try:
            await send(request, response)
        except ConnectionError:
            pass  # the client went away
        return response

    async def _relay(
        self,
        request: web.BaseRequest,
        upstream: aiohttp.ClientResponse,
        response: web.StreamResponse,
        slot: _Slot,
    ) -> web.StreamResponse:
        """Relay a streamed answer as it arrives (spotdrain.http.relay); decide, once, how it
        ended: complete, the client gone, or interrupted (never two of these)."""
        slot.phase = _RELAYING
        relay = StreamRelay(request, response, upstream)
        # A cancel is the gate's cut only if cut() asked for it and nothing else (the client
        # going away, the server stopping) cancelled too.
        ending = await relay.run(stopped=lambda: slot.cut and _uncancel() == 0)
        if ending is Ending.CLIENT_GONE:
            return response  # release the slot; the worker's request is closed on the way out
        message = ""
        if ending is Ending.COMPLETE:
            slot.phase = _FINISHING
        else:
            upstream.close()
            reason = "stopped" if ending is Ending.STOPPED else "upstream_failed"
            if reason != "stopped":
                log.warning(
                    "gate %s: worker broke stream %s: %s",
                    self.worker_id,
                    slot.request_id,
                    repr(relay.broken) if relay.broken else ending.value,
                )
            self._report_interrupted(slot, True, reason)
            message = interrupted_message(reason)
        await relay.end(message, slot.request_id)
        return response

    # --- answers of the gate's own (gate_answers.py) ------------------------------------------

    def _refusal(self, status: int, kind: str, message: str) -> web.Response:
        return error_response(status, kind, message, self._retry_after)

    async def _answer_interrupted(
        self, request: web.BaseRequest, slot: _Slot, status: int, message: str
    ) -> web.StreamResponse:
        slot.phase = _FINISHING
        retry_after, request_id = self._retry_after, slot.request_id
        return await answer(
            request, error_response(status, "interrupted", message, retry_after, request_id)
        )


# --- helpers ---------------------------------------------------------------------------------


def _uncancel() -> int:
    task = asyncio.current_task()
    return task.uncancel() if task is not None else 0
