"""The router's side of the wire to slot gates: the header it stamps, how an answer reads."""

from __future__ import annotations

import json

ROUTE_VERSION_HEADER = "X-Route-Version"


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
