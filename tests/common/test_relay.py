"""The one stream relay the slot gate and the router share (spotdrain.http.relay).

The framer is pure and driven with bytes. The relay runs for real on loopback: an upstream that
writes exact HTTP bytes (so a test decides where chunks split and how the stream is cut), a small
aiohttp proxy that relays through `StreamRelay` as the gate and the router do, and an aiohttp
client reading raw bytes. Absences are proved by what the client holds at the end, or by a
barrier the upstream waits on.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from spotdrain.http.relay import Ending, EventFramer, StreamRelay, event_end

MESSAGE = "cut on the way; the answer is incomplete"

# --- the framer, pure -------------------------------------------------------------------------


def frame(chunks: list[bytes], hold_max: int = 1 << 20) -> tuple[list[bytes], EventFramer]:
    framer = EventFramer(hold_max)
    return [framer.feed(c) for c in chunks], framer


def test_an_event_split_across_chunks_goes_out_whole_once_its_blank_line_comes() -> None:
    out, framer = frame([b"data: a\n\ndata: b", b"b\n", b"\ndata: [DONE]\n\n"])
    assert out == [b"data: a\n\n", b"", b"data: bb\n\ndata: [DONE]\n\n"]
    assert framer.ended() == "done"


@pytest.mark.parametrize(
    "chunks",
    [
        [b"data: a\r\n\r\n"],
        [b"data: a\r\n\r", b"\n"],  # CRLF CRLF split inside its last pair
        [b"data: a\r\n", b"\r\n"],
        [b"data: a\n\r\n"],  # LF then CRLF: mixed line ends are still a blank line
        [b"data: a\r\n\n"],
        [b"data: a\r\r"],
        [b"data: a\n", b"\r"],
    ],
)
def test_every_blank_line_the_sse_spec_allows_ends_an_event(chunks: list[bytes]) -> None:
    out, _ = frame(chunks)
    sent = b"".join(out)
    assert sent.startswith(b"data: a") and event_end(sent) == len(sent)  # whole, and out


def test_a_crlf_is_one_line_end_not_a_blank_line() -> None:
    assert event_end(b"data: a\r\ndata: b\r\n") == -1
    out, framer = frame([b"data: a\r\n", b"data: b\r\n"])
    assert out == [b"", b""] and framer.held == b"data: a\r\ndata: b\r\n"


def test_an_event_longer_than_the_hold_goes_out_as_it_comes_and_ends_nothing_cleanly() -> None:
    """The hold is bounded: past hold_max a partial event is let through, and once it is, the
    stream cannot be ended with an error event (it would be glued to the partial)."""
    out, framer = frame([b"data: " + b"x" * 40, b"y" * 10, b"z\n\ndata: next"], hold_max=32)
    assert out == [b"data: " + b"x" * 40, b"y" * 10, b"z\n\n"]
    assert not framer.open and framer.held == b"data: next"
    out, framer = frame([b"data: " + b"x" * 40], hold_max=32)
    assert framer.open and framer.ended() == ""


def test_a_blank_line_that_straddles_a_let_through_partial_is_still_seen() -> None:
    out, framer = frame([b"data: " + b"x" * 40 + b"\r\n", b"\r\ndata: b"], hold_max=32)
    assert out == [b"data: " + b"x" * 40 + b"\r\n", b"\r\n"]
    assert not framer.open and framer.held == b"data: b"


def test_at_the_end_a_partial_event_is_dropped_but_a_done_without_its_blank_line_goes() -> None:
    _, framer = frame([b'data: a\n\ndata: {"choi'])
    assert framer.finish() == b"" and framer.dropped == len(b'data: {"choi')
    assert framer.ended() == ""
    _, framer = frame([b"data: a\n\ndata: [DONE]"])
    assert framer.finish() == b"data: [DONE]" and framer.ended() == "done"


# --- the relay on loopback --------------------------------------------------------------------

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


END = b"0\r\n\r\n"  # the chunked body's clean end
RESET, CLOSE = "reset", "close"


@dataclass
class Upstream:
    """Answers every request with `script`: bytes to write, an asyncio.Event to wait for, or
    RESET (RST, as a killed container) / CLOSE (FIN mid-body)."""

    script: list[bytes | asyncio.Event | str] = field(default_factory=list)
    url: str = ""
    server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        for step in self.script:
            if isinstance(step, asyncio.Event):
                await step.wait()
            elif step == RESET:
                writer.transport.abort()
                return
            elif step == CLOSE:
                writer.close()
                return
            else:
                assert isinstance(step, bytes)
                writer.write(step)
                await writer.drain()
        writer.close()


@dataclass
class Proxy:
    """Relays every request to the upstream through StreamRelay, as the gate and router do."""

    upstream: str
    hold_max: int = 1 << 20
    endings: list[Ending] = field(default_factory=list)
    url: str = ""
    _session: aiohttp.ClientSession | None = None

    async def start(self) -> Callable[[], Awaitable[None]]:
        session = aiohttp.ClientSession(auto_decompress=False)
        runner = web.ServerRunner(web.Server(self._handle), handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        self._session = session

        async def stop() -> None:
            await runner.cleanup()
            await session.close()

        return stop

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        assert self._session is not None
        async with self._session.get(self.upstream) as upstream:
            response = web.StreamResponse(status=upstream.status)
            response.content_type = upstream.content_type
            await response.prepare(request)
            relay = StreamRelay(request, response, upstream, hold_max=self.hold_max)
            self.endings.append(await relay.run())
            await relay.end(MESSAGE, "rid-1")
            return response


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    u = Upstream()
    await u.start()
    yield u
    assert u.server is not None
    u.server.close()


@pytest.fixture
async def proxy(upstream: Upstream) -> AsyncIterator[Proxy]:
    p = Proxy(upstream.url)
    stop = await p.start()
    yield p
    await stop()


async def fetch(proxy: Proxy) -> tuple[bytes, bool]:
    """The client's whole body, and whether the HTTP response ended cleanly."""
    body = b""
    async with aiohttp.ClientSession() as client, client.get(proxy.url) as resp:
        try:
            async for data in resp.content.iter_any():
                body += data
        except aiohttp.ClientPayloadError:
            return body, False
    return body, True


def error_event() -> bytes:
    error = {"type": "interrupted", "message": MESSAGE, "request_id": "rid-1"}
    return b"event: error\ndata: " + json.dumps({"error": error}).encode() + b"\n\n"


async def test_a_stream_ended_cleanly_mid_event_drops_the_half_event_and_says_interrupted(
    upstream: Upstream, proxy: Proxy
) -> None:
    """The worker writes one event and half the next, then ends its body cleanly: the client
    gets the whole event and the error event, never the half glued to it."""
    upstream.script = [SSE_HEAD, chunk(b'data: a\n\ndata: {"choi'), END]
    body, clean = await fetch(proxy)
    assert (body, clean) == (b"data: a\n\n" + error_event(), True)
    assert proxy.endings == [Ending.UPSTREAM_CUT]


@pytest.mark.parametrize("how", [RESET, CLOSE])
async def test_an_upstream_cut_mid_event_gives_whole_events_then_the_error(
    how: str, upstream: Upstream, proxy: Proxy
) -> None:
    upstream.script = [SSE_HEAD, chunk(b"data: a\n\nda"), chunk(b'ta: {"ch'), how]
    body, clean = await fetch(proxy)
    assert (body, clean) == (b"data: a\n\n" + error_event(), True)
    assert proxy.endings == [Ending.UPSTREAM_BROKE]


async def test_an_event_ended_by_mixed_line_ends_reaches_the_client_before_the_cut(
    upstream: Upstream, proxy: Proxy
) -> None:
    """LF then CRLF is a blank line (the SSE spec): the event is whole and goes out, rather
    than being held as a partial and lost when the worker dies."""
    upstream.script = [SSE_HEAD, chunk(b"data: a\r\n\r"), chunk(b"\ndata: b\n\r\ndata: c"), RESET]
    body, clean = await fetch(proxy)
    assert (body, clean) == (b"data: a\r\n\r\ndata: b\n\r\n" + error_event(), True)


async def test_an_oversized_partial_event_is_let_through_and_a_cut_then_truncates(
    upstream: Upstream,
) -> None:
    """The hold is bounded: the client gets an oversized event's start while the worker still
    writes it. Cut then, the stream cannot end with an error event (it would be glued to the
    half event), so the client sees a truncated body, never a clean end."""
    big = b"data: " + b"x" * 100
    more = asyncio.Event()
    upstream.script = [SSE_HEAD, chunk(big), more, RESET]
    proxy = Proxy(upstream.url, hold_max=64)
    stop = await proxy.start()
    try:
        async with aiohttp.ClientSession() as client, client.get(proxy.url) as resp:
            assert await resp.content.readexactly(len(big)) == big  # before the worker goes on
            more.set()
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.content.read()
        assert proxy.endings == [Ending.UPSTREAM_BROKE]
    finally:
        await stop()


async def test_a_last_event_that_is_already_an_error_gets_no_second_one(
    upstream: Upstream, proxy: Proxy
) -> None:
    """The gate's own interrupted event (or a worker's error) relayed last is the client's
    explicit error: the stream ends cleanly after it, with no error event of ours added."""
    theirs = b'event: error\r\ndata: {"error": {"type": "interrupted"}}\r\n\r\n'
    upstream.script = [SSE_HEAD, chunk(b"data: a\n\n"), chunk(theirs), END]
    body, clean = await fetch(proxy)
    assert (body, clean) == (b"data: a\n\n" + theirs, True)
    assert proxy.endings == [Ending.UPSTREAM_ERROR]


async def test_done_then_a_broken_connection_is_still_a_complete_answer(
    upstream: Upstream, proxy: Proxy
) -> None:
    upstream.script = [SSE_HEAD, chunk(b"data: a\n\ndata: [DONE]\n\n"), RESET]
    body, clean = await fetch(proxy)
    assert (body, clean) == (b"data: a\n\ndata: [DONE]\n\n", True)
    assert proxy.endings == [Ending.COMPLETE]


async def test_a_chunked_body_cut_is_truncated_and_its_clean_end_is_complete(
    upstream: Upstream, proxy: Proxy
) -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
    upstream.script = [head, chunk(b"line 0\n"), RESET]
    assert await fetch(proxy) == (b"line 0\n", False)
    upstream.script = [head, chunk(b"line 0\n"), END]
    assert await fetch(proxy) == (b"line 0\n", True)
    assert proxy.endings == [Ending.UPSTREAM_BROKE, Ending.COMPLETE]
