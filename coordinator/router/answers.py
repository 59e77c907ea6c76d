"""The router's side of the wire to slot gates: the header it stamps, how an answer reads."""

from __future__ import annotations

import json
from dataclasses import dataclass

from aiohttp import hdrs, web
from multidict import CIMultiDict, CIMultiDictProxy

from spotdrain.http import sse

ROUTE_VERSION_HEADER = "X-Route-Version"
WORKER_ID_HEADER = "X-Worker-Id"
RETRY_AFTER_S = "1"
NOT_FORWARDED = frozenset({"content-length"})


def error_type(data: bytes) -> str:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return ""
    error = doc.get("error") if isinstance(doc, dict) else None
    kind = error.get("type") if isinstance(error, dict) else None
    return kind if isinstance(kind, str) else ""


def try_elsewhere(status: int, kind: str) -> bool:
    """The gate refused before its worker saw the request, so another worker may take it.
    A 503 or 502 `interrupted` is a request the worker had: relayed, never retried."""
    if status == 503:
        return kind != "interrupted"
    if status == 429:
        return kind == "worker_busy"
    return status == 502 and kind == "upstream_unavailable"


def model_of(body: bytes) -> str | None:
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    model = doc.get("model") if isinstance(doc, dict) else None
    return model if isinstance(model, str) and model else None


def upstream_headers(incoming: CIMultiDictProxy[str], request_id: str) -> CIMultiDict[str]:
    # The route version is this router's to stamp, never the client's.
    return sse.forwarded(incoming, request_id, NOT_FORWARDED | {ROUTE_VERSION_HEADER.lower()})


def client_headers(
    upstream: CIMultiDictProxy[str], worker_id: str, request_id: str
) -> CIMultiDict[str]:
    out = sse.forwarded(upstream, request_id, NOT_FORWARDED)
    out[WORKER_ID_HEADER] = worker_id
    return out


def error_response(
    status: int,
    kind: str,
    message: str,
    request_id: str,
    *,
    retry_after: bool = False,
    worker_id: str = "",
) -> web.Response:
    headers = {}
    if retry_after:
        headers[hdrs.RETRY_AFTER] = RETRY_AFTER_S
    if worker_id:
        headers[WORKER_ID_HEADER] = worker_id
    return sse.error_response(status, kind, message, request_id, headers)


@dataclass(frozen=True)
class Cut:
    """The gate cut a non-streamed answer before any byte of it reached the client."""

    worker_id: str
    answer: web.Response


@dataclass(frozen=True)
class Refusal:
    """A worker did not take the request (nothing reached the client): try another."""

    worker_id: str
    why: str
