"""The HTTP and SSE wire shapes the slot gate and the reference router share.

One definition of how an interrupted answer looks (docs/design.md invariant 7): an SSE `error` event
whose `data:` line is an OpenAI-style error object (the openai SDK raises `APIError` on it), and
never a `data: [DONE]`. The same error object is the body of a non-streamed refusal.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable

from aiohttp import hdrs, web
from multidict import CIMultiDict, CIMultiDictProxy

# Carried from the client through the router and the gate to the worker, and back.
REQUEST_ID_HEADER = "X-Request-Id"

# RFC 9110 7.6.1, plus what a proxy recomputes or answers itself (Host, Expect).
HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "Proxy-Connection",
        "TE",
        "Trailer",
        "Trailers",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Expect",
    )
)


def hop_by_hop(
    headers: CIMultiDictProxy[str], extra: frozenset[str] = frozenset()
) -> frozenset[str]:
    """The headers not to forward: the fixed set, `extra`, and any the Connection header names."""
    named = headers.get(hdrs.CONNECTION)
    base = HOP_BY_HOP | extra
    if not named:
        return base
    return base | {h.strip().lower() for h in named.split(",")}


def forwarded(
    headers: CIMultiDictProxy[str], request_id: str, extra: frozenset[str] = frozenset()
) -> CIMultiDict[str]:
    """`headers` to pass on: less the hop-by-hop ones and `extra` (lower-case names), with the
    request id set."""
    drop = hop_by_hop(headers, extra)
    out: CIMultiDict[str] = CIMultiDict(
        (name, value) for name, value in headers.items() if name.lower() not in drop
    )
    out[REQUEST_ID_HEADER] = request_id
    return out


def error_body(kind: str, message: str, request_id: str | None) -> bytes:
    error: dict[str, str] = {"type": kind, "message": message}
    if request_id is not None:
        error["request_id"] = request_id
    return json.dumps({"error": error}).encode()


def error_response(
    status: int, kind: str, message: str, request_id: str | None, headers: dict[str, str]
) -> web.Response:
    """An error the gate or the router answers itself, as JSON, with the request id (once
    there is one) beside the caller's own headers."""
    if request_id is not None:
        headers = {**headers, REQUEST_ID_HEADER: request_id}
    return web.Response(
        status=status,
        body=error_body(kind, message, request_id),
        content_type="application/json",
        headers=headers,
    )


def interrupted_event(message: str, request_id: str) -> bytes:
    """The SSE event that ends an interrupted stream, in place of `data: [DONE]`."""
    return b"event: error\ndata: " + error_body("interrupted", message, request_id) + b"\n\n"


# Seconds the last bytes of a cut or refused request may take to be handed to a client's
# connection; then the connection is aborted, so a client that stopped reading cannot hold a
# proxy's cut or shutdown.
FINAL_WRITE_TIMEOUT_S = 1.0


async def bounded(write: Awaitable[object]) -> bool:
    """Await the last bytes for a client, at most FINAL_WRITE_TIMEOUT_S. False if they did not
    go (timeout, or the client is gone)."""
    try:
        async with asyncio.timeout(FINAL_WRITE_TIMEOUT_S):
            await write
        return True
    except (TimeoutError, ConnectionError):
        return False


def abort(request: web.BaseRequest) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()
