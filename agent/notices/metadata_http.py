"""HTTP for the metadata sources: one GET or PUT to a link-local endpoint, bounded in time and
size, with every failure as one `ReadFailed` (the source's health decides what it means)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

MAX_BODY = 64 * 1024  # a metadata document is a few hundred bytes


class ReadFailed(Exception):
    """The endpoint could not be read: refused, timed out, 5xx, or an oversized body."""


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    headers: dict[str, str]


def session() -> aiohttp.ClientSession:
    # No proxy from the environment: metadata endpoints are link-local and must be reached
    # directly. One connection kept alive per source.
    return aiohttp.ClientSession(
        trust_env=False,
        connector=aiohttp.TCPConnector(limit=2, force_close=False),
        auto_decompress=False,
    )


async def fetch(
    http: aiohttp.ClientSession,
    method: str,
    url: str,
    headers: dict[str, str],
    timeout_s: float,
    body: str | None = None,
) -> Reply:
    """One request and its whole answer (to its Content-Length or its last chunk) under one
    deadline: a body still arriving at `timeout_s` is a failed read, never a partial document."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _exchange(http, method, url, headers, body)
    except TimeoutError:
        raise ReadFailed(f"{method} {url}: no whole answer in {timeout_s:g} s") from None
    except aiohttp.ClientError as e:  # refused, reset, or a body cut short of its length
        raise ReadFailed(f"{method} {url}: {e.__class__.__name__}: {e}") from None


async def _exchange(
    http: aiohttp.ClientSession,
    method: str,
    url: str,
    headers: dict[str, str],
    body: str | None,
) -> Reply:
    async with http.request(
        method,
        url,
        headers=headers,
        data=body,
        allow_redirects=False,
        timeout=aiohttp.ClientTimeout(total=None),  # fetch's own deadline covers it all
    ) as resp:
        if resp.content_length is not None and resp.content_length > MAX_BODY:
            raise ReadFailed(
                f"{method} {url}: answer of {resp.content_length} bytes, more than {MAX_BODY}"
            )
        # read(n) gives what has arrived so far, not the body: read until the end of it.
        data = bytearray()
        while chunk := await resp.content.read(MAX_BODY + 1 - len(data)):
            data += chunk
            if len(data) > MAX_BODY:
                raise ReadFailed(f"{method} {url}: answer larger than {MAX_BODY} bytes")
        if resp.status >= 500:
            raise ReadFailed(f"{method} {url}: HTTP {resp.status}")
        return Reply(resp.status, bytes(data), {k.lower(): v for k, v in resp.headers.items()})
