"""The dashboard's HTTP server (aiohttp): pages, the SVG, the live stream, the actions.

Reads are bounded and one at a time (a page of nodes from the fleet's in-memory index, a page
of reclamations by keyset, one timeline), so a dashboard never holds the store's readers from
a Taint or a registration; actions are one at a time too, each through the API's own code
(actions.py). GET never changes anything; a POST needs the operator token in a header.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web

from spotdrain.coordinator.api import convert
from spotdrain.coordinator.api.agent_link import Coordinator
from spotdrain.coordinator.api.errors import BadRequest
from spotdrain.coordinator.dashboard import pages, static
from spotdrain.coordinator.dashboard.actions import Api, http_refusal
from spotdrain.coordinator.dashboard.auth import TOKEN_HEADER, token_matches
from spotdrain.coordinator.dashboard.live import LiveTimelines, TooManyWatchers
from spotdrain.timeline import svg as timeline_svg

log = logging.getLogger("spotdrain.coordinator.dashboard")

NODES_PER_PAGE = 100
RECLAMATIONS_PER_PAGE = 50
MAX_REQUEST_BYTES = 64 * 1024
KEEPALIVE_S = 15.0
# After the outcome, a live page's stream stays open until this long passes without a step.
LATE_STEPS_S = 10.0
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
LOOPBACK_NAMES = {"localhost", "localhost.localdomain"}


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class DashboardConfig:
    host: str
    port: int
    token: str | None = None  # None: read-only, every action refused
    public: bool = False  # a non-loopback address was asked for, explicitly


class Dashboard:
    def __init__(self, coord: Coordinator, config: DashboardConfig) -> None:
        self.coord = coord
        self.config = config
        self.api = Api(coord.ops)
        self._reads = asyncio.Semaphore(1)
        self._actions = asyncio.Lock()
        self.live = LiveTimelines(coord.events, coord.store, self._live_message)
        self._runner: web.AppRunner | None = None
        self.port = 0

    # --- serving ----------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=MAX_REQUEST_BYTES)
        app.add_routes(
            [
                web.get("/", self.fleet_page),
                web.get("/reclamations", self.reclamations_page),
                web.get("/reclamations/{rid}", self.reclamation_page),
                web.get("/reclamations/{rid}/svg", self.reclamation_svg),
                web.get("/reclamations/{rid}/live", self.reclamation_live),
                web.get("/static/dashboard.js", self._static(static.SCRIPT, "text/javascript")),
                web.get("/static/dashboard.css", self._static(static.STYLE, "text/css")),
                web.post("/api/nodes/{node}/pause", self.pause),
                web.post("/api/nodes/{node}/resume", self.resume),
                web.post("/api/nodes/{node}/spot", self.set_spot),
                web.post("/api/models/{model}/replicas", self.set_replicas),
            ]
        )
        return app

    async def start(self) -> int:
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        sockets = site._server.sockets if site._server is not None else []  # noqa: SLF001
        self.port = sockets[0].getsockname()[1] if sockets else self.config.port
        return self.port

    async def close(self) -> None:
        await self.live.close()
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        # On loopback, only loopback names: a page elsewhere that rebinds its own name to
        # 127.0.0.1 (DNS rebinding) cannot read the fleet through a visitor's browser.
        if not self.config.public and not is_loopback(request.url.host or ""):
            return web.Response(status=421, text="this dashboard answers loopback names only\n")
        try:
            response = await handler(request)
        except web.HTTPException as e:
            response = e
        for name, value in HEADERS.items():
            response.headers.setdefault(name, value)
        return response

    def _static(self, text: str, content_type: str) -> Callable[[web.Request], Awaitable[Any]]:
        async def serve(request: web.Request) -> web.Response:
            return web.Response(text=text, content_type=content_type)

        return serve

    def _html(self, title: str, body: str, status: int = 200) -> web.Response:
        page = pages.layout(title, body, actions_on=self.config.token is not None)
        return web.Response(text=page, content_type="text/html", status=status)

    async def _read(self, call: Awaitable[Any]) -> Any:
        async with self._reads:
            return await call

    # --- pages ------------------------------------------------------------------------------

    async def fleet_page(self, request: web.Request) -> web.Response:
        fleet = self.coord.fleet
        after = request.query.get("after", "")
        # The fleet's in-memory index, as ListNodes converts it; one page of it.
        ids = sorted(n for n in fleet.nodes.rows if n > after)
        page, more = ids[:NODES_PER_PAGE], len(ids) > NODES_PER_PAGE
        ops = self.coord.ops
        active = await self._read(ops.active_rentals())
        rentals_by_node = {n: active[n] for n in page if n in active}
        avoided = fleet.nodes.avoided_now()
        nodes = [
            convert.node_pb(ops.node_status(fleet.nodes.rows[n], len(rentals_by_node.get(n, []))))
            for n in page
        ]
        workers = {n: [convert.worker_pb(w) for w in fleet.live_workers(n)] for n in page}
        risks = {n: dict(fleet.nodes.risks.get(n, {})) for n in page}
        models = await self._read(self.api.models())
        body = pages.fleet(
            nodes,
            workers,
            rentals_by_node,
            risks,
            avoided,
            models,
            page[-1] if more else None,
            self.coord.clock(),
        )
        return self._html("fleet", body)

    async def reclamations_page(self, request: web.Request) -> web.Response:
        before = _cursor(request.query.get("before", ""))
        page = await self._read(
            self.coord.store.reclamations_page(before, RECLAMATIONS_PER_PAGE + 1)
        )
        more = len(page) > RECLAMATIONS_PER_PAGE
        page = page[:RECLAMATIONS_PER_PAGE]
        last = f"{page[-1][1]!r}|{page[-1][0]['reclaim_id']}" if more else None
        return self._html("reclamations", pages.reclamations([r for r, _ in page], last))

    async def _timeline(self, request: web.Request) -> Any:
        try:
            return await self._read(self.api.timeline(request.match_info["rid"]))
        except Exception as e:  # noqa: BLE001 (the API's own words: a bad id, or none such)
            status, _, message = http_refusal(e)
            if status == 400:
                raise web.HTTPBadRequest(text=f"{message}\n") from e
            raise web.HTTPNotFound(text=f"{message}\n") from e

    async def reclamation_page(self, request: web.Request) -> web.Response:
        tl = await self._timeline(request)
        drawing = timeline_svg.render(tl)
        body = pages.reclamation(tl, drawing, timeline_svg.outcome_text(tl.reclamation))
        return self._html(f"reclamation {tl.reclamation.reclaim_id}", body)

    async def reclamation_svg(self, request: web.Request) -> web.Response:
        tl = await self._timeline(request)
        return web.Response(text=timeline_svg.render(tl), content_type="image/svg+xml")

    async def _live_message(self, reclaim_id: str) -> str | None:
        tl = await self._read(self.api.timeline(reclaim_id))
        return json.dumps(
            {
                "svg": timeline_svg.render(tl),
                "outcome": timeline_svg.outcome_text(tl.reclamation),
                "steps": len(tl.events),
                "outcome_known": bool(tl.reclamation.outcome),
            }
        )

    async def reclamation_live(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: the whole drawing now, then again each time it gains a step.
        Steps still come after the outcome (a rental's container exiting, its end): the stream
        follows until LATE_STEPS_S pass without one, then says `done`. It closed at the
        outcome before, and a page missed what came a few milliseconds after it."""
        tl = await self._timeline(request)
        reclaim_id = tl.reclamation.reclaim_id
        try:
            queue = self.live.watch(reclaim_id)
        except TooManyWatchers as e:
            raise web.HTTPServiceUnavailable(text=f"{e}\n") from e
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"}
        )
        try:
            await response.prepare(request)
            message = await self._live_message(reclaim_id)
            outcome_known = False
            while True:
                if message is not None:
                    await response.write(f"event: timeline\ndata: {message}\n\n".encode())
                    outcome_known = outcome_known or json.loads(message)["outcome_known"]
                try:
                    # (asyncio.timeout: wait_for can swallow a cancel)
                    async with asyncio.timeout(LATE_STEPS_S if outcome_known else KEEPALIVE_S):
                        message = await queue.get()
                except TimeoutError:
                    if outcome_known:
                        await response.write(b"event: done\ndata: {}\n\n")
                        return response
                    message = None
                    await response.write(b": keepalive\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            return response
        finally:
            self.live.unwatch(reclaim_id, queue)

    # --- actions ----------------------------------------------------------------------------

    async def _act(
        self, request: web.Request, action: Callable[[dict[str, Any]], Awaitable[str]]
    ) -> web.Response:
        if self.config.token is None:
            return _refusal(403, "actions are off: the coordinator has no --dashboard-token-file")
        given = request.headers.get(TOKEN_HEADER)
        if not given:
            return _refusal(401, f"actions need the operator token (header {TOKEN_HEADER})")
        if not token_matches(self.config.token, given):
            log.warning("dashboard: an action with a wrong token from %s", request.remote)
            return _refusal(403, "wrong operator token")
        if request.content_type != "application/json":
            return _refusal(415, "send application/json")
        try:
            body = await request.json()
        except ValueError:
            return _refusal(400, "the body is not JSON")
        if not isinstance(body, dict):
            return _refusal(400, "the body must be a JSON object")
        try:
            async with self._actions:
                message = await action(body)
        except Exception as e:  # noqa: BLE001 (mapped as the API maps it)
            status, code, text = http_refusal(e)
            if code == grpc.StatusCode.INTERNAL:
                log.error("dashboard action %s failed", request.path, exc_info=e)
            return _refusal(status, text, code)
        log.info("dashboard: %s: %s", request.path, message)
        return web.json_response({"message": message})

    async def pause(self, request: web.Request) -> web.Response:
        node_id = request.match_info["node"]

        async def act(body: dict[str, Any]) -> str:
            reclaim_id = await self.api.pause(node_id)
            return f"node {node_id} paused ({reclaim_id})"

        return await self._act(request, act)

    async def resume(self, request: web.Request) -> web.Response:
        node_id = request.match_info["node"]

        async def act(body: dict[str, Any]) -> str:
            enabled = await self.api.resume(node_id)
            return f"node {node_id} resumed" + ("" if enabled else "; still paused by its owner")

        return await self._act(request, act)

    async def set_spot(self, request: web.Request) -> web.Response:
        node_id = request.match_info["node"]

        async def act(body: dict[str, Any]) -> str:
            spot = body.get("spot")
            if not isinstance(spot, bool):
                raise BadRequest("spot must be true or false")
            node = await self.api.set_spot(node_id, spot)
            return f"node {node.node_id} is {'spot' if node.spot else 'on-demand'}"

        return await self._act(request, act)

    async def set_replicas(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]

        async def act(body: dict[str, Any]) -> str:
            replicas, slots = body.get("replicas"), body.get("slots", 0)
            image = body.get("image", "")
            if not (_count(replicas) and _count(slots) and isinstance(image, str)):
                raise BadRequest("replicas and slots must be whole numbers, image a string")
            m = await self.api.set_replicas(model, replicas, image, slots)
            return f"model {m.model}: {m.replicas} replicas wanted, {m.ready} ready"

        return await self._act(request, act)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


def _refusal(status: int, message: str, code: grpc.StatusCode | None = None) -> web.Response:
    doc = {"error": message} | ({"code": code.name} if code is not None else {})
    return web.json_response(doc, status=status)


def _cursor(text: str) -> tuple[float, str] | None:
    """`before=STARTED_AT|RECLAIM_ID`, as the previous page's link gives it."""
    started, sep, reclaim_id = text.partition("|")
    try:
        at = float(started)
    except ValueError:
        return None
    return (at, reclaim_id) if sep and math.isfinite(at) else None
