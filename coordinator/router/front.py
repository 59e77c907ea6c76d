"""The reference router's HTTP front: OpenAI-compatible requests to the least-loaded gate.

- `POST /v1/chat/completions` goes to the least-loaded ready worker of the model's table
  (spotdrain.coordinator.router.model_routes): slots in use over capacity, plus this router's
  own requests in flight there. A model's first request starts its watch and waits, at most
  SNAPSHOT_WAIT_S, for the snapshot. The upstream request carries `X-Route-Version`, the table
  version the pick was made from: a worker removed at version V never gets a request stamped V
  or later. A gate's refusal (503 draining, 429 busy, 502 worker unreachable) or a connection
  error before any response byte sends the request to another worker, never the same one
  twice, up to `attempts`; then 503 `no_worker`.
- Streams are relayed as they come (spotdrain.http.relay), the gate's `interrupted` error event
  included. Once a response byte went to the client the request is never retried. A gate
  connection that breaks mid-stream ends the client's stream as the gate would (invariant 7):
  an SSE `error` event with an `interrupted` error and no `[DONE]`.

Other endpoints: `GET /v1/models` (models with a ready worker), `GET /stats` (counters),
`GET /routes` (each watched model's table and version, for operators and tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import aiohttp
from aiohttp import hdrs, web
from multidict import CIMultiDict, CIMultiDictProxy

from spotdrain.coordinator.router.model_routes import ModelRoutes, ModelWatch, Route
from spotdrain.http import sse
from spotdrain.http.relay import Ending, StreamRelay, is_stream
from spotdrain.http.sse import REQUEST_ID_HEADER
from spotdrain.net.leader import Replicas

log = logging.getLogger("spotdrain.router")

ROUTE_VERSION_HEADER = "X-Route-Version"
WORKER_ID_HEADER = "X-Worker-Id"

SNAPSHOT_WAIT_S = 2.0  # a model's first request waits this long for its routing table
GATE_CONNECT_TIMEOUT_S = 3.0
# Below the gate's (aiohttp's) 75 s keep-alive, so a pooled connection is rarely one the gate
# is closing; when it is, that is a connection error before any byte, and another worker is
# tried.
GATE_KEEPALIVE_S = 15.0
MAX_MODELS = 256  # watches are per model, and the model name comes from the client
MAX_BODY_BYTES = 64 << 20
RETRY_AFTER_S = "1"

# Beyond the shared hop-by-hop set: aiohttp recomputes Content-Length on the way back.
_NOT_FORWARDED = frozenset({"content-length"})


# --- the HTTP front ---------------------------------------------------------------------------


@dataclass
class Stats:
    completed: int = 0  # a worker's answer relayed whole (a stream up to its [DONE])
    retried: int = 0  # attempts after a request's first (each sent to another worker)
    refused: int = 0  # requests the router answered itself with 503 (no worker, no table)
    interrupted: int = 0  # answers that ended interrupted, the gate's or the router's doing
    upstream_errors: int = 0  # connections to gates that failed or broke


@dataclass(frozen=True)
class Refusal:
    """A worker did not take the request (nothing reached the client): try another."""

    worker_id: str
    why: str


class Router:
    def __init__(self, replicas: Replicas, attempts: int) -> None:
        self._replicas = replicas
        self.attempts = attempts
        self.watches: dict[str, ModelWatch] = {}
        self.in_flight: Counter[str] = Counter()  # this router's requests, by worker id
        self.stats = Stats()
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0, limit_per_host=0, keepalive_timeout=GATE_KEEPALIVE_S
            ),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=GATE_CONNECT_TIMEOUT_S, sock_read=None
            ),
            # Bytes pass through untouched, and no header the client did not send is added.
            auto_decompress=False,
            skip_auto_headers=(hdrs.ACCEPT_ENCODING, hdrs.USER_AGENT, hdrs.ACCEPT),
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def close(self) -> None:
        for watch in self.watches.values():
            watch.task.cancel()
        await asyncio.gather(*(w.task for w in self.watches.values()), return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/stats", self.stats_json)
        app.router.add_get("/routes", self.routes_json)
        return app

    # --- routing state -----------------------------------------------------------------------

    async def _table(self, model: str) -> tuple[ModelRoutes | None, str]:
        """The model's table once it has a snapshot; else None and why not."""
        watch = self.watches.get(model)
        if watch is None:
            if len(self.watches) >= MAX_MODELS:
                return None, f"this router watches at most {MAX_MODELS} models"
            watch = self.watches[model] = ModelWatch(model, self._replicas)
        if await watch.wait_synced(SNAPSHOT_WAIT_S):
            return watch.table, ""
        return None, watch.problem

    # --- endpoints ---------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        data = [
            {"id": model, "object": "model", "created": 0, "owned_by": "spotdrain"}
            for model, watch in sorted(self.watches.items())
            if watch.table.routes
        ]
        return web.json_response({"object": "list", "data": data})

    async def stats_json(self, request: web.Request) -> web.Response:
        return web.json_response(asdict(self.stats))

    async def routes_json(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                model: {
                    "version": w.table.version,
                    "synced": w.table.synced,
                    "problem": w.problem,
                    "workers": [asdict(r) for r in w.table.routes.values()],
                }
                for model, w in sorted(self.watches.items())
            }
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        request_id = request.headers.get(REQUEST_ID_HEADER) or str(uuid.uuid4())
        body = await request.read()
        model = _model_of(body)
        if model is None:
            return _error(
                400,
                "invalid_request_error",
                'the body must be a JSON object with a "model" string',
                request_id,
            )
        table, problem = await self._table(model)
        if table is None:
            self.stats.refused += 1
            log.warning("request %s: model %s: no routing table: %s", request_id, model, problem)
            return _error(
                503,
                "no_worker",
                f"no routing table for model {model!r}: {problem}",
                request_id,
                retry_after=True,
            )
        headers = _upstream_headers(request.headers, request_id)
        tried: list[str] = []
        refusals: list[str] = []
        for attempt in range(self.attempts):
            # The version and the pick are read together: no await between them.
            version = table.version
            route = table.pick(self.in_flight, exclude=tried)
            if route is None:
                break
            if attempt:
                self.stats.retried += 1
            tried.append(route.worker_id)
            headers[ROUTE_VERSION_HEADER] = str(version)
            with self._counted(route.worker_id):
                answer = await self._exchange(request, route, body, headers, request_id)
            if isinstance(answer, Refusal):
                refusals.append(f"{answer.worker_id}: {answer.why}")
                continue
            return answer
        self.stats.refused += 1
        why = "; ".join(refusals) if refusals else "none is ready"
        log.warning("request %s: no worker of %s took it (%s)", request_id, model, why)
        return _error(
            503,
            "no_worker",
            f"no worker of model {model!r} could take the request ({why})",
            request_id,
            retry_after=True,
        )

    # --- one attempt on one worker -----------------------------------------------------------

    @contextlib.contextmanager
    def _counted(self, worker_id: str) -> Iterator[None]:
        """The worker's requests in flight, for the least-loaded choice."""
        self.in_flight[worker_id] += 1
        try:
            yield
        finally:
            self.in_flight[worker_id] -= 1
            if self.in_flight[worker_id] <= 0:
                del self.in_flight[worker_id]

    async def _exchange(
        self,
        request: web.Request,
        route: Route,
        body: bytes,
        headers: CIMultiDict[str],
        request_id: str,
    ) -> web.StreamResponse | Refusal:
        assert self._session is not None
        url = f"http://{route.address}/v1/chat/completions"
        try:
            upstream = await self._session.post(
                url, data=body, headers=headers, allow_redirects=False
            )
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            # No response byte came: nothing reached the client, another worker may take it.
            self.stats.upstream_errors += 1
            log.warning(
                "request %s: worker %s on %s (%s) unreachable: %r",
                request_id,
                route.worker_id,
                route.node_id,
                route.address,
                e,
            )
            return Refusal(route.worker_id, f"unreachable ({type(e).__name__})")
        try:
            if upstream.status in (429, 502, 503):
                return await self._refusal_or_answer(request, route, upstream, request_id)
            if is_stream(upstream):
                return await self._relay_stream(request, route, upstream, request_id)
            try:
                data = await upstream.read()
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                # The worker had the request and its answer is lost: interrupted, not retried.
                self.stats.upstream_errors += 1
                self.stats.interrupted += 1
                log.warning(
                    "request %s: worker %s broke its answer: %r", request_id, route.worker_id, e
                )
                return _error(
                    502,
                    "interrupted",
                    "the connection to the worker broke mid-answer; the answer is incomplete",
                    request_id,
                    worker_id=route.worker_id,
                )
            return self._whole(route, upstream, data, request_id)
        finally:
            upstream.close()  # no-op after a complete answer; else the gate sees us go

    async def _refusal_or_answer(
        self,
        request: web.Request,
        route: Route,
        upstream: aiohttp.ClientResponse,
        request_id: str,
    ) -> web.StreamResponse | Refusal:
        try:
            data = await upstream.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            self.stats.upstream_errors += 1
            return Refusal(route.worker_id, f"HTTP {upstream.status}, body lost ({e!r})")
        kind = _error_type(data)
        if _try_elsewhere(upstream.status, kind):
            log.info(
                "request %s: worker %s on %s refused (%d %s); trying another",
                request_id,
                route.worker_id,
                route.node_id,
                upstream.status,
                kind,
            )
            return Refusal(route.worker_id, kind or f"HTTP {upstream.status}")
        return self._whole(route, upstream, data, request_id)

    def _whole(
        self, route: Route, upstream: aiohttp.ClientResponse, data: bytes, request_id: str
    ) -> web.Response:
        if upstream.status >= 500 and _error_type(data) == "interrupted":
            self.stats.interrupted += 1  # the gate cut it before its answer began
        else:
            self.stats.completed += 1
        return web.Response(
            status=upstream.status,
            reason=upstream.reason,
            body=data,
            headers=_client_headers(upstream.headers, route.worker_id, request_id),
        )

    async def _relay_stream(
        self,
        request: web.Request,
        route: Route,
        upstream: aiohttp.ClientResponse,
        request_id: str,
    ) -> web.StreamResponse:
        """Relay as it comes (spotdrain.http.relay), the gate's error event included. From the
        first byte sent the request is the client's: never retried. Decide once how it ended."""
        response = web.StreamResponse(
            status=upstream.status,
            reason=upstream.reason,
            headers=_client_headers(upstream.headers, route.worker_id, request_id),
        )
        await response.prepare(request)
        relay = StreamRelay(request, response, upstream)
        ending = await relay.run()
        if relay.broken is not None:
            self.stats.upstream_errors += 1
            log.warning(
                "request %s: stream from worker %s on %s broke: %r",
                request_id,
                route.worker_id,
                route.node_id,
                relay.broken,
            )
        if ending is Ending.CLIENT_GONE:
            log.info("request %s: the client went away mid-stream", request_id)
            return response
        if ending is Ending.COMPLETE:
            self.stats.completed += 1
        else:
            # The gate's own interrupted event, when it is the last, is already the client's
            # explicit error; otherwise the relay ends the stream with ours (invariant 7).
            self.stats.interrupted += 1
            if ending is Ending.UPSTREAM_CUT:
                log.warning(
                    "request %s: stream from worker %s ended without [DONE]; told the client",
                    request_id,
                    route.worker_id,
                )
        await relay.end(
            "the connection to the worker broke mid-stream; the answer is incomplete", request_id
        )
        return response


# --- helpers ----------------------------------------------------------------------------------


def _model_of(body: bytes) -> str | None:
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    model = doc.get("model") if isinstance(doc, dict) else None
    return model if isinstance(model, str) and model else None


def _error_type(data: bytes) -> str:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return ""
    error = doc.get("error") if isinstance(doc, dict) else None
    kind = error.get("type") if isinstance(error, dict) else None
    return kind if isinstance(kind, str) else ""


def _try_elsewhere(status: int, kind: str) -> bool:
    """The gate refused before its worker saw the request, so another worker may take it.
    A 503 or 502 `interrupted` is a request the worker had: relayed, never retried."""
    if status == 503:
        return kind != "interrupted"
    if status == 429:
        return kind == "worker_busy"
    return status == 502 and kind == "upstream_unavailable"


def _upstream_headers(incoming: CIMultiDictProxy[str], request_id: str) -> CIMultiDict[str]:
    # The route version is this router's to stamp, never the client's.
    return sse.forwarded(incoming, request_id, _NOT_FORWARDED | {ROUTE_VERSION_HEADER.lower()})


def _client_headers(
    upstream: CIMultiDictProxy[str], worker_id: str, request_id: str
) -> CIMultiDict[str]:
    out = sse.forwarded(upstream, request_id, _NOT_FORWARDED)
    out[WORKER_ID_HEADER] = worker_id
    return out


def _error(
    status: int,
    kind: str,
    message: str,
    request_id: str,
    *,
    retry_after: bool = False,
    worker_id: str = "",
) -> web.Response:
    headers = {REQUEST_ID_HEADER: request_id}
    if retry_after:
        headers[hdrs.RETRY_AFTER] = RETRY_AFTER_S
    if worker_id:
        headers[WORKER_ID_HEADER] = worker_id
    return web.Response(
        status=status,
        body=sse.error_body(kind, message, request_id),
        content_type="application/json",
        headers=headers,
    )
