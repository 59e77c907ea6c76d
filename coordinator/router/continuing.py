"""The router's continuation of a stream its worker's reclamation cut (docs/api.md "Continuing a
cut stream"): deciding it was cut, picking another ready worker, opening the continuation and
relaying it through spotdrain.http.continuation, and reporting the seam to the coordinator.

`Continuer` does this for `front.Router`; the pure bookkeeping (what to ask
for, how chunks are rewritten, usage) is spotdrain.http.continuation's, for other routers too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import grpc
from aiohttp import web
from multidict import CIMultiDict

from spotdrain.coordinator.router.answers import ROUTE_VERSION_HEADER, error_type, try_elsewhere
from spotdrain.coordinator.router.model_routes import ModelRoutes, Route
from spotdrain.coordinator.router.stats import Stats
from spotdrain.http import sse
from spotdrain.http.continuation import Carried, Transcript
from spotdrain.http.relay import Ending, StreamRelay
from spotdrain.net.leader import Replicas
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

log = logging.getLogger("spotdrain.router")

# A cut stream waits at most this long for another ready worker of its model to continue on.
CONTINUE_PICK_WAIT_S = 5.0
CONTINUE_PICK_POLL_S = 0.05
REPORT_TIMEOUT_S = 5.0


class Continuer:
    """A router's collaborator for cut streams: given the router's shared state (its stats,
    its in-flight counts, its HTTP session once started, its replicas) and the two things it
    does around every relay (counting a worker's request, noting a broken stream)."""

    def __init__(
        self,
        replicas: Replicas,
        stats: Stats,
        in_flight: Counter[str],
        session: Callable[[], aiohttp.ClientSession | None],
        counted: Callable[[str], contextlib.AbstractContextManager[None]],
        note_break: Callable[[StreamRelay, Route, str], None],
        *,
        attempts: int,
        max_continuations: int,
        continue_wait_s: float,
    ) -> None:
        self._replicas = replicas
        self.stats = stats
        self.in_flight = in_flight
        self._session_of = session
        self._counted = counted
        self._note_break = note_break
        self.attempts = attempts
        self.max_continuations = max_continuations
        self.continue_wait_s = continue_wait_s
        self._reports: set[asyncio.Task[None]] = set()  # continuations being recorded

    async def close(self) -> None:
        """Give the records still on their way to the coordinator a bounded time."""
        if self._reports:
            await asyncio.wait(self._reports, timeout=REPORT_TIMEOUT_S)

    @staticmethod
    def was_cut(
        relay: StreamRelay,
        ending: Ending,
        table: ModelRoutes,
        route: Route,
        transcript: Transcript,
    ) -> bool:
        """The worker's stream was cut by its reclamation: the gate's interrupted event, or the
        connection lost while the worker is out of the table (draining). Never a stream that
        ends inside an event: what the client holds could not be continued cleanly."""
        if relay.framer is None or relay.framer.open or ending is Ending.COMPLETE:
            return False
        if transcript.held_error:
            return True
        return (
            ending in (Ending.UPSTREAM_BROKE, Ending.UPSTREAM_CUT)
            and route.worker_id not in table.routes
        )

    async def _pick_within(
        self, table: ModelRoutes, exclude: list[str], wait_s: float
    ) -> tuple[int, Route] | None:
        """Another ready worker of the model, waiting at most wait_s for one to be ready."""
        deadline = time.monotonic() + wait_s
        while True:
            version = table.version
            route = table.pick(self.in_flight, exclude=exclude)
            if route is not None:
                return version, route
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(CONTINUE_PICK_POLL_S)

    async def continue_stream(
        self,
        request: web.Request,
        response: web.StreamResponse,
        table: ModelRoutes,
        cut: Route,
        transcript: Transcript,
        clock: Clock,
        headers: CIMultiDict[str],
        request_id: str,
    ) -> bool:
        """Continue a cut stream on other workers until it completes: True when it did (or the
        client went away); False when it could not, the client's stream left for the caller to
        end with `transcript.held_error` (or its own interrupted event). The reason goes to the
        stats and the log."""
        cut_by = [cut.worker_id]
        last_cut = cut  # the worker whose stream was cut last
        while True:
            why = transcript.continuable()
            if not why and transcript.continuations >= self.max_continuations:
                why = "cut_again" if transcript.continuations else "max_continuations"
            if why:
                return self._not_continued(why, request_id, cut_by[-1])
            cut_event = transcript.held_error
            body, carried = transcript.next_body()
            opened = await self._open_continuation(request, table, cut_by, body, headers)
            if isinstance(opened, str):
                transcript.held_error = cut_event
                return self._not_continued(opened, request_id, cut_by[-1])
            route, upstream = opened
            seam = _Seam(request_id, transcript, last_cut, route, carried, clock.last)
            following = Clock(transcript, lambda at, seam=seam: self._continued(seam, at))
            transcript.held_error = b""
            try:
                with self._counted(route.worker_id):
                    relay = StreamRelay(request, response, upstream, edit=following)
                    ending = await relay.run()
                self._note_break(relay, route, request_id)
            finally:
                upstream.close()
            if ending is Ending.CLIENT_GONE:
                return True
            if ending is Ending.COMPLETE:
                self.stats.completed += 1
                await end_with(request, response, b"")
                return True
            if not self.was_cut(relay, ending, table, route, transcript):
                self.stats.failed("broke")
                self.stats.interrupted += 1
                if relay.framer is not None and relay.framer.open:
                    sse.abort(request)  # stopped inside an event: no clean end is honest
                    return True
                if not transcript.held_error and relay.framer.ended() != "error":
                    transcript.held_error = sse.interrupted_event(
                        "the connection to the worker broke mid-stream; the answer is incomplete",
                        request_id,
                    )
                elif not transcript.held_error:
                    return True  # the worker's own error event ended the client's stream
                return False
            cut_by.append(route.worker_id)
            last_cut = route
            clock = following

    async def _open_continuation(
        self,
        request: web.Request,
        table: ModelRoutes,
        cut_by: list[str],
        body: bytes,
        headers: CIMultiDict[str],
    ) -> tuple[Route, aiohttp.ClientResponse] | str:
        """A continuation's stream from another ready worker (never one that cut this request,
        never a draining one: the table holds ready workers, a draining gate refuses); else why
        not ("no_worker", or "refused" when a worker turned the continuation down)."""
        session = self._session_of()
        assert session is not None  # the router started before it served anything
        tried = list(cut_by)
        for _ in range(self.attempts):
            picked = await self._pick_within(table, tried, self.continue_wait_s)
            if picked is None:
                return "no_worker"
            version, route = picked
            tried.append(route.worker_id)
            headers[ROUTE_VERSION_HEADER] = str(version)
            try:
                upstream = await session.post(
                    f"http://{route.address}{request.path}",
                    data=body,
                    headers=headers,
                    allow_redirects=False,
                )
            except (aiohttp.ClientError, TimeoutError, OSError):
                self.stats.upstream_errors += 1
                continue
            if upstream.status == 200 and upstream.content_type == "text/event-stream":
                return route, upstream
            detail = await _read_quietly(upstream)
            upstream.close()
            if try_elsewhere(upstream.status, error_type(detail)):
                continue
            log.warning(
                "worker %s refused a continuation: %d %r",
                route.worker_id,
                upstream.status,
                detail[:200],
            )
            return "refused"
        return "no_worker"

    def _continued(self, seam: _Seam, first_at: float) -> None:
        """The continuation's first bytes went to the client: counted, logged, and reported to
        the coordinator for the cut worker's node's timeline (in the background: the stream
        does not wait on it)."""
        gap = first_at - seam.last_at if seam.last_at is not None else 0.0
        self.stats.streams_continued += 1
        log.info(
            "request %s: continued on worker %s on %s after worker %s cut it "
            "(%d characters, %d tokens carried, gap %.1f ms)",
            seam.request_id,
            seam.to.worker_id,
            seam.to.node_id,
            seam.from_worker.worker_id,
            seam.carried.chars,
            seam.carried.tokens,
            gap * 1000,
        )
        report = pb.StreamContinued(
            request_id=seam.request_id,
            model=str(seam.transcript.request.get("model", "")),
            from_worker_id=seam.from_worker.worker_id,
            from_node_id=seam.from_worker.node_id,
            to_worker_id=seam.to.worker_id,
            chars=seam.carried.chars,
            tokens=seam.carried.tokens,
            gap_s=max(0.0, gap),
        )
        task = asyncio.create_task(self._report(report), name=f"report-{seam.request_id}")
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _report(self, report: pb.StreamContinued) -> None:
        try:
            await self._replicas.on_leader(
                pb_grpc.RoutesStub, "ReportContinuation", report, REPORT_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as e:
            # The answer went on all the same; only the timeline misses it.
            log.warning(
                "request %s: the coordinator did not take the continuation's record: %s %s",
                report.request_id,
                e.code().name,
                e.details(),
            )

    def _not_continued(self, why: str, request_id: str, worker_id: str, detail: str = "") -> bool:
        self.stats.failed(why)
        self.stats.interrupted += 1
        log.warning(
            "request %s: the stream worker %s cut is not continued (%s)%s; told the client",
            request_id,
            worker_id,
            why,
            f": {detail}" if detail else "",
        )
        return False


@dataclass(frozen=True)
class _Seam:
    """Where one continuation joins the answer: for the log and the coordinator's record."""

    request_id: str
    transcript: Transcript
    from_worker: Route
    to: Route
    carried: Carried
    last_at: float | None  # when the cut worker's last bytes went to the client


class Clock:
    """A transcript's edit for one relay, noting when its bytes went out (the gap a client sees
    at a seam is the next relay's first less this one's last) and calling `on_first` once."""

    __slots__ = ("transcript", "last", "on_first")

    def __init__(
        self, transcript: Transcript | None, on_first: Callable[[float], None] | None = None
    ) -> None:
        self.transcript = transcript
        self.last: float | None = None
        self.on_first = on_first

    def __call__(self, block: bytes) -> bytes:
        assert self.transcript is not None
        out = self.transcript.relayed(block)
        if out:
            self.last = time.monotonic()
            if self.on_first is not None:
                on_first, self.on_first = self.on_first, None
                on_first(self.last)
        return out


async def _read_quietly(upstream: aiohttp.ClientResponse) -> bytes:
    try:
        return await upstream.read()
    except (aiohttp.ClientError, TimeoutError, OSError):
        return b""


async def end_with(request: web.Request, response: web.StreamResponse, last: bytes) -> None:
    """End the client's stream with `last` (an interrupted event), bounded."""
    if not await sse.bounded(response.write_eof(last)):
        sse.abort(request)
