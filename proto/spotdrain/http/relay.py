"""The one relay of a streamed HTTP answer, used by the slot gate and the reference router.

A streamed answer (SSE, or a chunked body) is read from the upstream chunk by chunk and written
to the client as it comes. For SSE only whole events are written: a partial event is held until
its blank line arrives (at most `hold_max` bytes), so when the upstream goes away mid-event the
client's parser never sees half an event glued to the error event that ends the stream.

How it ended is judged by what the client holds (docs/design.md invariant 7): an SSE stream
whose `data: [DONE]` went out is complete whatever happens after; one that did not is ended with
an explicit `interrupted` error event, unless its last event already is an error (the gate's own,
relayed by the router, or the worker's), which is then the client's explicit error. A stream
that cannot end cleanly (chunked, or SSE stopped inside an event let through whole) is aborted
at the transport, so the client sees a truncated body, never a clean end. Every last write is
bounded (spotdrain.http.sse.FINAL_WRITE_TIMEOUT_S).
"""

from __future__ import annotations

import asyncio
import enum
import json
import re
from collections.abc import Callable

import aiohttp
from aiohttp import web

from spotdrain.http import sse

# An SSE event longer than this without its blank line is let through as it comes rather than
# held: the hold is bounded whatever the upstream sends.
HOLD_MAX = 1 << 20

# A blank line: two line ends, each CRLF, LF or CR (the SSE spec). Atomic groups, so a CRLF is
# never read as two line ends.
_BLANK_LINE = re.compile(rb"(?>\r\n|\r|\n)(?>\r\n|\r|\n)")
# A chunk ending in one of these ends at an event boundary: the hot path, one check.
_ENDS_EVENT = (b"\n\n", b"\r\n\r\n", b"\r\r")
# The last event is looked for in this many trailing bytes of what went out.
_LAST_EVENT_BYTES = 4096


def event_end(data: bytes, start: int = 0) -> int:
    """Index just past the last blank line (an SSE event's end) in data at or after start;
    -1 if there is none."""
    end = -1
    for match in _BLANK_LINE.finditer(data, start):
        end = match.end()
    return end


def last_event(data: bytes) -> str:
    """How the last SSE event in data reads: "done" (`data: [DONE]`), "error" (an `error`
    event, or data with an "error" object, which the openai SDK raises on), or ""."""
    text = data[-_LAST_EVENT_BYTES:].replace(b"\r\n", b"\n").replace(b"\r", b"\n").rstrip(b"\n")
    event = text.rsplit(b"\n\n", 1)[-1]
    for line in event.split(b"\n"):
        if line.startswith(b"event:") and line[6:].strip() == b"error":
            return "error"
        if line.startswith(b"data:"):
            data_line = line[5:].strip()
            if data_line == b"[DONE]":
                return "done"
            if b'"error"' in data_line:
                try:
                    doc = json.loads(data_line)
                except ValueError:
                    continue
                if isinstance(doc, dict) and doc.get("error"):
                    return "error"
    return ""


class EventFramer:
    """Pure: cuts an SSE byte stream into the part that may go to the client now (whole events)
    and a held partial event."""

    __slots__ = ("hold_max", "held", "open", "last", "dropped")

    def __init__(self, hold_max: int = HOLD_MAX) -> None:
        self.hold_max = hold_max
        self.held = b""  # the start of an event whose blank line has not come yet
        self.open = False  # what went out ends inside an event (one longer than hold_max)
        self.last = b""  # the last bytes that went out: they end with the stream's last event
        self.dropped = 0  # bytes of a partial event never let through (the upstream ended)

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to write now for one chunk from the upstream (b"" to write nothing)."""
        if not self.held and not self.open and chunk.endswith(_ENDS_EVENT):
            self.last = chunk
            return chunk
        data = self.held + chunk if self.held else chunk
        if self.open:
            # The blank line may begin in the bytes already out (held is empty while open).
            prev = self.last[-3:]
            end = event_end(prev + data) - len(prev)
        else:
            # held has no blank line: only its last bytes can start one.
            end = event_end(data, max(0, len(self.held) - 3))
        if end >= 0:
            out, self.held, self.open = data[:end], data[end:], False
        elif self.open or len(data) >= self.hold_max:
            out, self.held, self.open = data, b"", True
        else:
            out, self.held = b"", data
        if out:
            self.last = out
        return out

    def finish(self) -> bytes:
        """The upstream ended: the bytes still to write. A held `data: [DONE]` without its blank
        line goes; any other partial event is dropped (an SSE parser discards it at the end
        anyway, and it must not be glued to an error event)."""
        held, self.held = self.held, b""  # never held while open
        if held and last_event(held) == "done":
            self.last = held
            return held
        self.dropped += len(held)
        return b""

    def ended(self) -> str:
        """How the last whole event that went out reads ("done", "error" or "")."""
        return "" if self.open else last_event(self.last)


class Ending(enum.Enum):
    """How a relayed stream ended, judged by what the client holds."""

    COMPLETE = "complete"  # the whole answer (SSE: up to its [DONE]; chunked: its clean end)
    CLIENT_GONE = "client_gone"  # the client went away; nothing more is written
    STOPPED = "stopped"  # the caller cut it (the gate at the grace deadline)
    UPSTREAM_ERROR = "upstream_error"  # SSE: the last event is the upstream's own error
    UPSTREAM_CUT = "upstream_cut"  # SSE: a clean end of the body without [DONE]
    UPSTREAM_BROKE = "upstream_broke"  # reading failed: reset, killed, a truncated body


def is_stream(upstream: aiohttp.ClientResponse) -> bool:
    """An answer relayed as it comes (SSE or chunked), rather than read whole."""
    return upstream.content_type == "text/event-stream" or upstream.headers.get(
        "Transfer-Encoding", ""
    ).lower().endswith("chunked")


class StreamRelay:
    """One streamed answer from `upstream` to the client's prepared `response`.

    `await run()` relays until the end and says how it ended; the caller reports it, then
    `await end(message)` writes the client's last bytes (`message` is the error event's, for an
    interrupted SSE stream)."""

    def __init__(
        self,
        request: web.BaseRequest,
        response: web.StreamResponse,
        upstream: aiohttp.ClientResponse,
        *,
        hold_max: int = HOLD_MAX,
        edit: Callable[[bytes], bytes] | None = None,
    ) -> None:
        self._request = request
        self._response = response
        self._upstream = upstream
        self.sse = upstream.content_type == "text/event-stream"
        self.framer = EventFramer(hold_max) if self.sse else None
        self.broken: BaseException | None = None  # what reading the upstream raised, if it did
        self.ending: Ending | None = None
        # SSE only: whole events pass through it on their way out (a router's continuation
        # records and rewrites them); how the stream ended is judged on what the upstream sent.
        self._edit = edit if self.sse else None

    async def run(self, stopped: Callable[[], bool] = lambda: False) -> Ending:
        """Relay until the upstream ends or breaks, or the client goes away. A cancellation for
        which `stopped()` is true (the caller's cut) ends the relay as STOPPED; any other (the
        client went away, the server stops) propagates."""
        try:
            how = await self._pump()
        except asyncio.CancelledError:
            if not stopped():
                raise
            how = Ending.STOPPED
        self.ending = self._judge(how)
        return self.ending

    async def _pump(self) -> Ending:
        read = self._upstream.content.readany
        write = self._response.write
        framer = self.framer
        edit = self._edit
        while True:
            try:
                chunk = await read()
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                self.broken = e
                return Ending.UPSTREAM_BROKE
            eof = not chunk
            if framer is not None:
                chunk = framer.finish() if eof else framer.feed(chunk)
                if chunk and edit is not None and not framer.open:
                    chunk = edit(chunk)
            if chunk:
                try:
                    await write(chunk)
                except ConnectionError:  # aiohttp's ClientConnectionResetError: client gone
                    return Ending.CLIENT_GONE
            if eof:
                # SSE ends complete only with [DONE] (judged next); a chunked body's end is its end.
                return Ending.UPSTREAM_CUT if framer is not None else Ending.COMPLETE

    def _judge(self, how: Ending) -> Ending:
        if how is Ending.CLIENT_GONE or self.framer is None:
            return how
        ended = self.framer.ended()
        if ended == "done":
            return Ending.COMPLETE  # the client holds the whole answer, whatever came after
        if how is Ending.UPSTREAM_CUT and ended == "error":
            return Ending.UPSTREAM_ERROR
        return how

    async def end(self, message: str = "", request_id: str = "") -> None:
        """Write the client's last bytes for the ending `run()` returned: a clean end, the
        interrupted error event (SSE), or an abort at the transport. Bounded."""
        how = self.ending
        if how is Ending.CLIENT_GONE:
            return
        if how is Ending.COMPLETE:
            last = b""
        elif self.framer is None or self.framer.open:
            sse.abort(self._request)  # no clean end is honest here: a truncated body
            return
        elif self.framer.ended() == "error":
            last = b""  # the client already holds an explicit error event
        else:
            last = sse.interrupted_event(message, request_id)
        if not await sse.bounded(self._response.write_eof(last)):
            sse.abort(self._request)
