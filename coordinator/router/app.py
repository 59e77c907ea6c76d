"""spotdrain-router: the reference router, an OpenAI-compatible HTTP front over slot gates.

The platform brings its own router (docs/design.md "Components"); this one is for the demo
and the tests, and shows how a router consumes the coordinator's routing API:

- Per model, a local table fed by `Routes.WatchRoutes`: a snapshot, then versioned changes.
  The watch starts with the model's first request (which waits, at most SNAPSHOT_WAIT_S, for
  the snapshot), reconnects with backoff and re-snapshots on reconnect. Versions only go up: a
  snapshot older than the table (a new leader's, say) is held aside, with the changes that
  follow it, until it is newer than the table; only then is it the table. While the coordinator
  is away the last table stays in use: a worker that drains meanwhile is refused by its own
  gate (503), and the request goes to another worker (the owner's promise does not depend on
  the coordinator, docs/design.md "Owner pause timeline").
- Several coordinator replicas (`--coordinator a:7443,b:7443`): the watch goes to the leader
  (spotdrain.net.leader: where a follower's refusal points, else the next address) and moves on
  when it goes.
- `POST /v1/chat/completions` goes to the least-loaded ready worker: slots in use over capacity
  from the table, plus this router's own requests in flight there. The upstream request carries
  `X-Route-Version`, the table version the pick was made from: a worker removed at version V
  never gets a request stamped V or later. A gate's refusal (503 draining, 429 busy, 502 worker
  unreachable) or a connection error before any response byte sends the request to another
  worker, never the same one twice, up to `--attempts`; then 503 `no_worker`.
- Streams are relayed chunk by chunk, unchanged, the gate's `interrupted` error event included.
  Once a response byte went to the client the request is never retried. A gate connection that
  breaks mid-stream ends the client's stream as the gate would (invariant 7): an SSE `error`
  event with an `interrupted` error and no `[DONE]`.

Other endpoints: `GET /v1/models` (models with a ready worker), `GET /stats` (counters),
`GET /routes` (each watched model's table and version, for operators and tests).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import signal
import sys
import uuid
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict, dataclass

import aiohttp
import grpc
from aiohttp import hdrs, web
from multidict import CIMultiDict, CIMultiDictProxy

from spotdrain.http import sse
from spotdrain.http.relay import Ending, StreamRelay, is_stream
from spotdrain.net.leader import Replicas, addresses, from_replica
from spotdrain.net.security import channel_credentials, warn_insecure
from spotdrain.protocol.limits import MAX_ADMIN_MESSAGE_BYTES
from spotdrain.runtime.cli import ArgumentParser, UsageError, fail_usage, host_port
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

PROG = "spotdrain-router"
log = logging.getLogger("spotdrain.router")

REQUEST_ID_HEADER = "X-Request-Id"
ROUTE_VERSION_HEADER = "X-Route-Version"
WORKER_ID_HEADER = "X-Worker-Id"

SNAPSHOT_WAIT_S = 2.0  # a model's first request waits this long for its routing table
WATCH_BACKOFF_MIN_S = 0.1
WATCH_BACKOFF_MAX_S = 5.0
PROBE_TIMEOUT_S = 3.0
GATE_CONNECT_TIMEOUT_S = 3.0
# Below the gate's (aiohttp's) 75 s keep-alive, so a pooled connection is rarely one the gate
# is closing; when it is, that is a connection error before any byte, and another worker is
# tried.
GATE_KEEPALIVE_S = 15.0
MAX_MODELS = 256  # watches are per model, and the model name comes from the client
MAX_BODY_BYTES = 64 << 20
RETRY_AFTER_S = "1"

# What the coordinator says when this router's identity may not read routes: permanent, so the
# router says so at start (exit 1) and requests do not wait for a snapshot that cannot come.
REFUSED_CODES = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)

# Beyond the shared hop-by-hop set: aiohttp recomputes Content-Length on the way back.
_NOT_FORWARDED = frozenset({"content-length"})


# --- the core: one model's routing table ------------------------------------------------------


@dataclass(frozen=True)
class Route:
    worker_id: str
    node_id: str
    address: str  # the slot gate, HOST:PORT
    slots_in_use: int
    capacity: int


class RouteTable:
    """One model's ready workers as the coordinator's watch last described them.

    Pure: the watch feeds it updates, the request handler asks it for picks. `version` is the
    version of the last update applied; a pick is always made from the table at that version.
    It never goes down: a snapshot older than the table (a new leader whose versions start
    lower, a coordinator restarted with its clock behind) is held aside, with the changes of
    the same watch after it, and becomes the table once its version passes the table's.
    """

    def __init__(self, model: str) -> None:
        self.model = model
        self.version = 0
        self.synced = False  # a snapshot has arrived: the table means something
        self.routes: dict[str, Route] = {}
        self._behind: tuple[int, dict[str, Route]] | None = None  # a snapshot held aside

    def apply_snapshot(self, version: int, routes: Iterable[Route]) -> bool:
        """Take a watch's snapshot (the whole truth as of `version`); False when it is older
        than the table, which stays as it is meanwhile."""
        table = {r.worker_id: r for r in routes}
        if self.synced and version < self.version:
            self._behind = (version, table)
            return False
        self._behind = None
        self.routes, self.version, self.synced = table, version, True
        return True

    def apply_change(self, version: int, upsert: Iterable[Route], removed: Iterable[str]) -> bool:
        """Apply one change; False (and the table unchanged) for one older than the table, or
        one to a snapshot held aside that is still not newer than the table."""
        if self._behind is not None:
            behind_version, table = self._behind
            if version <= behind_version:
                return False
            _change(table, upsert, removed)
            if version <= self.version:
                self._behind = (version, table)
                return False
            self._behind = None
            self.routes, self.version = table, version
            return True
        if not self.synced or version <= self.version:
            return False
        _change(self.routes, upsert, removed)
        self.version = version
        return True

    def pick(self, in_flight: Mapping[str, int], exclude: Collection[str] = ()) -> Route | None:
        """The least-loaded worker not in `exclude`: (slots in use + this router's requests in
        flight there) over capacity; ties go to fewer of ours in flight, then the worker id."""

        def load(r: Route) -> tuple[float, int, str]:
            ours = in_flight.get(r.worker_id, 0)
            return ((r.slots_in_use + ours) / max(r.capacity, 1), ours, r.worker_id)

        candidates = (r for r in self.routes.values() if r.worker_id not in exclude)
        return min(candidates, key=load, default=None)


def _change(table: dict[str, Route], upsert: Iterable[Route], removed: Iterable[str]) -> None:
    for route in upsert:
        table[route.worker_id] = route
    for worker_id in removed:
        table.pop(worker_id, None)


# --- the watch: the table kept current from the coordinator -----------------------------------


def _route(r: pb.Route) -> Route:
    return Route(r.worker_id, r.node_id, r.address, r.slots_in_use, r.capacity)


class ModelWatch:
    """`Routes.WatchRoutes(model)` for as long as the router runs: reconnects with backoff and
    takes a fresh snapshot each time, from the leader of several replicas."""

    def __init__(self, model: str, replicas: Replicas) -> None:
        self.table = RouteTable(model)
        self._replicas = replicas
        # Set once a snapshot came, or the coordinator refused this router: a request waiting
        # for the first snapshot stops waiting then.
        self.settled = asyncio.Event()
        self.problem = "no snapshot from the coordinator yet"  # "" while the watch is live
        self.task = asyncio.create_task(self._run(), name=f"watch-routes-{model}")

    async def wait_synced(self, timeout: float) -> bool:
        if not self.table.synced:
            try:
                async with asyncio.timeout(timeout):
                    await self.settled.wait()
            except TimeoutError:
                pass
        return self.table.synced

    async def _run(self) -> None:
        model = self.table.model
        delay = WATCH_BACKOFF_MIN_S
        while True:
            try:
                stub = self._replicas.stub(pb_grpc.RoutesStub)
                call = stub.WatchRoutes(pb.WatchRoutesRequest(model=model))
                async for update in call:
                    if update.snapshot:
                        taken = self.table.apply_snapshot(
                            update.version, map(_route, update.upsert)
                        )
                        self.problem = ""
                        self.settled.set()
                        delay = WATCH_BACKOFF_MIN_S
                        log.info(
                            "model %s: snapshot at version %d from %s, %d ready workers%s",
                            model,
                            update.version,
                            self._replicas.leader,
                            len(update.upsert),
                            "" if taken else
                            f": older than the table's {self.table.version}, kept aside",
                        )  # fmt: skip
                    elif self.table.apply_change(
                        update.version, map(_route, update.upsert), update.removed
                    ):
                        if update.removed:
                            log.info(
                                "model %s: version %d removed %s",
                                model,
                                update.version,
                                ", ".join(update.removed),
                            )
                self.problem = "the coordinator ended the route watch"
                log.warning("model %s: %s; reconnecting", model, self.problem)
                self._replicas.moved(None)
            except grpc.aio.AioRpcError as e:
                self.problem = f"coordinator answered {e.code().name}: {e.details()}"
                was = self._replicas.leader
                if self._replicas.moved(e) or from_replica(e):
                    # A replica named the leader, or will lead soon: no backing off.
                    delay = WATCH_BACKOFF_MIN_S
                if e.code() in REFUSED_CODES:
                    self.settled.set()
                    log.error("model %s: route watch refused: %s", model, self.problem)
                else:
                    log.warning(
                        "model %s: route watch at %s lost (%s); %s",
                        model,
                        was,
                        self.problem,
                        f"routing on version {self.table.version} meanwhile"
                        if self.table.synced
                        else "no table yet",
                    )
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, WATCH_BACKOFF_MAX_S)


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

    async def _table(self, model: str) -> tuple[RouteTable | None, str]:
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
            answer = await self._forward(request, route, body, headers, request_id)
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

    async def _forward(
        self,
        request: web.Request,
        route: Route,
        body: bytes,
        headers: CIMultiDict[str],
        request_id: str,
    ) -> web.StreamResponse | Refusal:
        self.in_flight[route.worker_id] += 1
        try:
            return await self._exchange(request, route, body, headers, request_id)
        finally:
            self.in_flight[route.worker_id] -= 1
            if self.in_flight[route.worker_id] <= 0:
                del self.in_flight[route.worker_id]

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
    drop = sse.hop_by_hop(incoming, _NOT_FORWARDED) | {ROUTE_VERSION_HEADER.lower()}
    out: CIMultiDict[str] = CIMultiDict(
        (name, value) for name, value in incoming.items() if name.lower() not in drop
    )
    out[REQUEST_ID_HEADER] = request_id
    return out


def _client_headers(
    upstream: CIMultiDictProxy[str], worker_id: str, request_id: str
) -> CIMultiDict[str]:
    drop = sse.hop_by_hop(upstream, _NOT_FORWARDED)
    out: CIMultiDict[str] = CIMultiDict(
        (name, value) for name, value in upstream.items() if name.lower() not in drop
    )
    out[WORKER_ID_HEADER] = worker_id
    out[REQUEST_ID_HEADER] = request_id
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


# --- the process ------------------------------------------------------------------------------


def parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="spotdrain reference router (OpenAI-compatible)")
    p.add_argument("--listen", required=True, help="HOST:PORT for HTTP (port 0 picks one)")
    p.add_argument(
        "--coordinator", required=True, help="the coordinator's HOST:PORT, or replicas' A:P,B:P"
    )
    p.add_argument("--insecure", action="store_true", help="plaintext gRPC, no identity")
    p.add_argument("--tls-cert", help="this router's certificate (CN router:<name>)")
    p.add_argument("--tls-key")
    p.add_argument("--ca", help="CA that signed the coordinator's certificate")
    p.add_argument("--attempts", type=int, default=3, help="workers to try per request (default 3)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


async def _refused_by_coordinator(replicas: Replicas, coordinator: str) -> str:
    """Ask once whether this identity may read routes. A refusal is permanent, so it is said at
    start; an unreachable coordinator, or one with no leader yet, is not (the watches keep
    trying)."""
    try:
        await replicas.on_leader(
            pb_grpc.RoutesStub, "PickWorker", pb.PickWorkerRequest(model=""), PROBE_TIMEOUT_S
        )
    except grpc.aio.AioRpcError as e:
        if e.code() in REFUSED_CODES:
            return (
                f"the coordinator at {coordinator} refused this router: "
                f"{e.code().name}: {e.details()}"
            )
        # Otherwise the coordinator let us in (no worker for model "") or is not reachable
        # yet: either way the watches take it from here.
        log.info("coordinator %s: probe answered %s: %s", coordinator, e.code().name, e.details())
    return ""


# A model's first WatchRoutes snapshot lists every routable worker of it: at a large fleet
# that can outgrow gRPC's 4 MiB default receive limit and fail the watch (RESOURCE_EXHAUSTED).
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_ADMIN_MESSAGE_BYTES),
    # Notice a leader that vanished (host gone, SIGSTOP) and move on, as the agent does.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


async def serve(args) -> int:  # noqa: ANN001 (argparse namespace)
    listen_host, listen_port = host_port(args.listen, "--listen")
    coordinators = addresses(args.coordinator, "--coordinator")
    if args.attempts < 1:
        raise UsageError(f"--attempts must be at least 1, got {args.attempts}")
    tls = (args.tls_cert, args.tls_key, args.ca)
    if args.insecure and any(tls):
        raise UsageError("--insecure and TLS flags exclude each other")
    if not args.insecure and not all(tls):
        raise UsageError("give --tls-cert, --tls-key and --ca, or --insecure")
    if args.insecure:
        warn_insecure(PROG)
        replicas = Replicas(
            coordinators, lambda a: grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS)
        )
    else:
        try:
            creds = channel_credentials(*tls)
        except ValueError as e:  # an unreadable certificate or key: a config error
            raise UsageError(str(e)) from e
        replicas = Replicas(
            coordinators, lambda a: grpc.aio.secure_channel(a, creds, options=CHANNEL_OPTIONS)
        )
    try:
        refused = await _refused_by_coordinator(replicas, args.coordinator)
        if refused:
            print(f"{PROG}: error: {refused}", file=sys.stderr, flush=True)
            return 1
        router = Router(replicas, args.attempts)
        await router.start()
        runner = web.AppRunner(
            router.app(),
            handle_signals=False,
            handler_cancellation=True,  # a client that goes away closes its upstream at once
            access_log=None,
            shutdown_timeout=5.0,
        )
        await runner.setup()
        try:
            await web.TCPSite(runner, listen_host, listen_port, backlog=1024).start()
        except OSError as e:
            await runner.cleanup()
            await router.close()
            raise UsageError(f"cannot listen on {args.listen}: {e.strerror}") from e
        port = runner.addresses[0][1]
        # Tests and the demo read the bound port from this line.
        print(f"{PROG}: listening on {listen_host}:{port}", flush=True)
        log.info(
            "routing for coordinator %s (%s), %d attempts per request",
            args.coordinator,
            "PLAINTEXT" if args.insecure else "mutual TLS",
            args.attempts,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping")
        await runner.cleanup()
        await router.close()
        return 0
    finally:
        await replicas.close()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        return asyncio.run(serve(args))
    except UsageError as e:
        return fail_usage(PROG, str(e))


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
