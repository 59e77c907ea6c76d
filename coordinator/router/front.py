"""The reference router's HTTP front: OpenAI-compatible requests to the least-loaded gate.

- `POST /v1/chat/completions` goes to the least-loaded ready worker of the model's table
  (spotdrain.coordinator.router.model_routes): slots in use over capacity, plus this router's
  own requests in flight there. A model's first request starts its watch and waits, at most
  SNAPSHOT_WAIT_S, for the snapshot. The upstream request carries `X-Route-Version`, the table
  version the pick was made from: a worker removed at version V never gets a request stamped V
  or later. A gate's refusal (503 draining, 429 busy, 502 worker unreachable) or a connection
  error before any response byte sends the request to another worker, never the same one
  twice, up to `attempts`; then 503 `no_worker`.
- `POST /v1/completions` the same way.
- Streams are relayed as they come (spotdrain.http.relay). Once a response byte went to the
  client the request is never sent again as it was. A stream the gate cuts (its `interrupted`
  error event), or whose connection breaks while its worker is no longer in the table
  (draining), is continued on another ready worker (spotdrain.http.continuation, docs/api.md
  "Continuing a cut stream"), at most `max_continuations` times; a non-streamed answer the
  gate cut is sent again to another worker. What cannot be continued ends as the gate would
  end it (invariant 7): an SSE `error` event with an `interrupted` error and no `[DONE]`.

Other endpoints: `GET /v1/models` (models with a ready worker), `GET /stats` (counters),
`GET /metrics` (the same counters for Prometheus), `GET /routes` (each watched model's table
and version, for operators and tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict

import aiohttp
from aiohttp import hdrs, web
from multidict import CIMultiDict

from spotdrain.coordinator.router.answers import (
    ROUTE_VERSION_HEADER,
    Cut,
    Refusal,
    client_headers,
    error_response,
    error_type,
    model_of,
    try_elsewhere,
    upstream_headers,
)
from spotdrain.coordinator.router.continuing import (
    CONTINUE_PICK_WAIT_S,
    Clock,
    Continuer,
    end_with,
)
from spotdrain.coordinator.router.model_routes import ModelRoutes, ModelWatch, Route
from spotdrain.coordinator.router.stats import Stats
from spotdrain.http.continuation import Transcript
from spotdrain.http.relay import Ending, StreamRelay, is_stream
from spotdrain.http.sse import REQUEST_ID_HEADER
from spotdrain.net.leader import Replicas

log = logging.getLogger("spotdrain.router")


SNAPSHOT_WAIT_S = 2.0  # a model's first request waits this long for its routing table
GATE_CONNECT_TIMEOUT_S = 3.0
# Below the gate's (aiohttp's) 75 s keep-alive, so a pooled connection is rarely one the gate
# is closing; when it is, that is a connection error before any byte, and another worker is
# tried.
GATE_KEEPALIVE_S = 15.0
MAX_MODELS = 256  # watches are per model, and the model name comes from the client
MAX_BODY_BYTES = 64 << 20

# --- the HTTP front ---------------------------------------------------------------------------


class Router:
    def __init__(
        self,
        replicas: Replicas,
        attempts: int,
        *,
        continue_cut: bool = True,
        max_continuations: int = 2,
        continue_wait_s: float = CONTINUE_PICK_WAIT_S,
    ) -> None:
        self._replicas = replicas
        self.attempts = attempts
        self.continue_cut = continue_cut
        self.max_continuations = max_continuations if continue_cut else 0
        self.continue_wait_s = continue_wait_s
        self.watches: dict[str, ModelWatch] = {}
        self.in_flight: Counter[str] = Counter()  # this router's requests, by worker id
        self.stats = Stats()
        self._session: aiohttp.ClientSession | None = None
        self.continuer = Continuer(
            replicas,
            self.stats,
            self.in_flight,
            lambda: self._session,
            self._counted,
            self._note_break,
            attempts=attempts,
            max_continuations=self.max_continuations,
            continue_wait_s=continue_wait_s,
        )

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
        await self.continuer.close()
        for watch in self.watches.values():
            watch.task.cancel()
        await asyncio.gather(*(w.task for w in self.watches.values()), return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/stats", self.stats_json)
        app.router.add_get("/metrics", self.metrics)
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

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.stats.prometheus_text(), content_type="text/plain")

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

    async def completions(self, request: web.Request) -> web.StreamResponse:
        request_id = request.headers.get(REQUEST_ID_HEADER) or str(uuid.uuid4())
        body = await request.read()
        model = model_of(body)
        if model is None:
            return error_response(
                400,
                "invalid_request_error",
                'the body must be a JSON object with a "model" string',
                request_id,
            )
        table, problem = await self._table(model)
        if table is None:
            self.stats.refused += 1
            log.warning("request %s: model %s: no routing table: %s", request_id, model, problem)
            return error_response(
                503,
                "no_worker",
                f"no routing table for model {model!r}: {problem}",
                request_id,
                retry_after=True,
            )
        headers = upstream_headers(request.headers, request_id)
        tried: list[str] = []
        refusals: list[str] = []
        cuts = 0
        for attempt in range(self.attempts + self.max_continuations):
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
                answer = await self._exchange(request, table, route, body, headers, request_id)
            if isinstance(answer, Refusal):
                refusals.append(f"{answer.worker_id}: {answer.why}")
                if len(refusals) >= self.attempts:
                    break
                continue
            if isinstance(answer, Cut):
                if cuts < self.max_continuations:
                    # Nothing reached the client: the whole request goes to another worker.
                    cuts += 1
                    self.stats.resent_after_cut += 1
                    log.info(
                        "request %s: worker %s cut the answer before it began; sending it to "
                        "another worker",
                        request_id,
                        answer.worker_id,
                    )
                    continue
                self.stats.failed("max_continuations")
                self.stats.interrupted += 1
                return answer.answer
            return answer
        self.stats.refused += 1
        why = "; ".join(refusals) if refusals else "none is ready"
        log.warning("request %s: no worker of %s took it (%s)", request_id, model, why)
        return error_response(
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
        table: ModelRoutes,
        route: Route,
        body: bytes,
        headers: CIMultiDict[str],
        request_id: str,
    ) -> web.StreamResponse | Refusal | Cut:
        assert self._session is not None
        url = f"http://{route.address}{request.path}"
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
                return await self._relay_stream(
                    request, table, route, upstream, body, headers, request_id
                )
            try:
                data = await upstream.read()
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                # The worker had the request and its answer is lost: interrupted, unless its
                # worker is draining and another may answer it whole.
                self.stats.upstream_errors += 1
                log.warning(
                    "request %s: worker %s broke its answer: %r", request_id, route.worker_id, e
                )
                broken = error_response(
                    502,
                    "interrupted",
                    "the connection to the worker broke mid-answer; the answer is incomplete",
                    request_id,
                    worker_id=route.worker_id,
                )
                if self.max_continuations and route.worker_id not in table.routes:
                    return Cut(route.worker_id, broken)
                self.stats.interrupted += 1
                return broken
            return self._answer_or_cut(route, upstream, data, request_id)
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
        kind = error_type(data)
        if try_elsewhere(upstream.status, kind):
            log.info(
                "request %s: worker %s on %s refused (%d %s); trying another",
                request_id,
                route.worker_id,
                route.node_id,
                upstream.status,
                kind,
            )
            return Refusal(route.worker_id, kind or f"HTTP {upstream.status}")
        return self._answer_or_cut(route, upstream, data, request_id)

    def _answer_or_cut(
        self, route: Route, upstream: aiohttp.ClientResponse, data: bytes, request_id: str
    ) -> web.Response | Cut:
        """The worker's whole answer; a Cut when the gate cut it and it may go elsewhere."""
        if self.max_continuations and upstream.status >= 500 and error_type(data) == "interrupted":
            return Cut(route.worker_id, self._whole(route, upstream, data, request_id, False))
        return self._whole(route, upstream, data, request_id)

    def _whole(
        self,
        route: Route,
        upstream: aiohttp.ClientResponse,
        data: bytes,
        request_id: str,
        count: bool = True,
    ) -> web.Response:
        if not count:
            pass  # a cut answer the caller may send elsewhere: counted when it decides
        elif upstream.status >= 500 and error_type(data) == "interrupted":
            self.stats.interrupted += 1  # the gate cut it before its answer began
        else:
            self.stats.completed += 1
        return web.Response(
            status=upstream.status,
            reason=upstream.reason,
            body=data,
            headers=client_headers(upstream.headers, route.worker_id, request_id),
        )

    async def _relay_stream(
        self,
        request: web.Request,
        table: ModelRoutes,
        route: Route,
        upstream: aiohttp.ClientResponse,
        body: bytes,
        headers: CIMultiDict[str],
        request_id: str,
    ) -> web.StreamResponse:
        """Relay as it comes (spotdrain.http.relay). From the first byte sent the request is the
        client's: never sent again as it was, but continued elsewhere when its worker cut it."""
        response = web.StreamResponse(
            status=upstream.status,
            reason=upstream.reason,
            headers=client_headers(upstream.headers, route.worker_id, request_id),
        )
        await response.prepare(request)
        transcript = Transcript.of(request.path, body) if self.max_continuations else None
        clock = Clock(transcript)
        relay = StreamRelay(request, response, upstream, edit=clock if transcript else None)
        ending = await relay.run()
        self._note_break(relay, route, request_id)
        if ending is Ending.CLIENT_GONE:
            log.info("request %s: the client went away mid-stream", request_id)
            return response
        if transcript is not None and self.continuer.was_cut(
            relay, ending, table, route, transcript
        ):
            if await self.continuer.continue_stream(
                request, response, table, route, transcript, clock, headers, request_id
            ):
                return response
        elif ending is Ending.COMPLETE:
            self.stats.completed += 1
        else:
            self._count_interrupted(ending, route, request_id)
        if transcript is not None and transcript.held_error:
            await end_with(request, response, transcript.held_error)
            return response
        await relay.end(
            "the connection to the worker broke mid-stream; the answer is incomplete", request_id
        )
        return response

    def _note_break(self, relay: StreamRelay, route: Route, request_id: str) -> None:
        if relay.broken is not None:
            self.stats.upstream_errors += 1
            log.warning(
                "request %s: stream from worker %s on %s broke: %r",
                request_id,
                route.worker_id,
                route.node_id,
                relay.broken,
            )

    def _count_interrupted(self, ending: Ending, route: Route, request_id: str) -> None:
        # The gate's own interrupted event, when it is the last, is already the client's
        # explicit error; otherwise the relay ends the stream with ours (invariant 7).
        self.stats.interrupted += 1
        if ending is Ending.UPSTREAM_CUT:
            log.warning(
                "request %s: stream from worker %s ended without [DONE]; told the client",
                request_id,
                route.worker_id,
            )
