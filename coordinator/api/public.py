"""The routers' servicer (the routing table, watched) and the renters' (rentals)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from spotdrain.coordinator.api import convert
from spotdrain.coordinator.api.agent_link import Coordinator
from spotdrain.coordinator.api.errors import (
    BadRequest,
    NotFound,
    Refused,
    grpc_errors,
    grpc_stream_errors,
)
from spotdrain.coordinator.core.rental import END_CALLERS, Rental
from spotdrain.coordinator.fleet.route_table import merged
from spotdrain.net.security import OPERATOR, PROVIDER, RENTER, Identity
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

MAX_ID_CHARS = 256  # a request id, a model name, a worker id: as a router sends them
MAX_GAP_S = 3600.0


class RoutesServicer(pb_grpc.RoutesServicer):
    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord

    @grpc_stream_errors
    async def WatchRoutes(  # noqa: N802
        self, request: pb.WatchRoutesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RouteUpdate]:
        self.coord.router(context)
        routes = self.coord.fleet.routes
        # Subscribe before the snapshot: no change can fall between the two.
        queue = routes.subscribe(request.model)
        try:
            version, entries = routes.snapshot(request.model)
            yield pb.RouteUpdate(
                version=version, snapshot=True, upsert=[convert.route_pb(e) for e in entries]
            )
            while True:
                if queue.empty() and routes.overflowed(queue):
                    raise Refused(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "this watch fell too far behind; watch again",
                    )
                changes = [await queue.get()]
                while not queue.empty():
                    changes.append(queue.get_nowait())
                change = merged([c for c in changes if c.version > version])
                if change is None:
                    continue
                version = change.version
                yield pb.RouteUpdate(
                    version=change.version,
                    upsert=[convert.route_pb(e) for e in change.upsert],
                    removed=list(change.removed),
                )
        finally:
            routes.unsubscribe(request.model, queue)

    @grpc_errors
    async def PickWorker(  # noqa: N802
        self, request: pb.PickWorkerRequest, context: grpc.aio.ServicerContext
    ) -> pb.Route:
        self.coord.router(context)
        entry = self.coord.fleet.routes.pick(request.model)
        if entry is None:
            raise Refused(
                grpc.StatusCode.UNAVAILABLE, f"no ready worker for model {request.model!r}"
            )
        return convert.route_pb(entry)

    @grpc_errors
    async def ReportContinuation(  # noqa: N802
        self, request: pb.StreamContinued, context: grpc.aio.ServicerContext
    ) -> pb.StreamContinuedReply:
        """A router continued a cut stream: `stream_continued` in the timeline of the cut
        worker's node (its current reclamation, or the one that ended last), which must have
        one; the values are bounded as any event's."""
        identity = self.coord.router(context)
        for name in ("request_id", "model", "from_worker_id", "to_worker_id", "from_node_id"):
            if len(getattr(request, name)) > MAX_ID_CHARS:
                raise BadRequest(f"{name} is longer than {MAX_ID_CHARS} characters")
        if not 0 <= request.gap_s <= MAX_GAP_S:
            raise BadRequest(f"gap_s must be 0 to {MAX_GAP_S}, not {request.gap_s}")
        # The worker is usually stopped, and gone from the registry, by the time the report
        # comes: then the node the router named, which must have had a drain to record it in.
        worker = self.coord.fleet.registry.get(request.from_worker_id)
        node_id = worker.node_id if worker is not None else request.from_node_id
        if worker is not None and request.from_node_id not in ("", node_id):
            raise BadRequest(
                f"worker {request.from_worker_id!r} is not on {request.from_node_id!r}"
            )
        drain = self.coord.fleet.drains.latest(node_id) if node_id else None
        if drain is None:
            raise NotFound(
                f"no drain of worker {request.from_worker_id!r}'s node {node_id!r} to record it in"
            )
        await self.coord.record(
            "stream_continued",
            node_id,
            {
                "request_id": request.request_id,
                "model": request.model,
                "worker_id": request.from_worker_id,
                "to_worker_id": request.to_worker_id,
                "chars": request.chars,
                "tokens": request.tokens,
                "gap_ms": round(request.gap_s * 1000, 1),
                "router": identity.name,
            },
            drain.reclaim_id,
        )
        return pb.StreamContinuedReply()


class RentalsServicer(pb_grpc.RentalsServicer):
    """A renter sees and ends only its own rentals; an operator acts as the platform; a
    provider may end (and see) rentals on its own nodes. Nodes and routers have no access."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord

    def _caller(self, context: grpc.aio.ServicerContext) -> Identity:
        return self.coord.caller(context, "the rentals API", OPERATOR, RENTER, PROVIDER)

    def _may_see(self, identity: Identity, rental: Rental) -> bool:
        if identity.role == RENTER:
            return rental.renter == identity.name
        if identity.role == PROVIDER:
            return rental.provider == identity.name
        return True

    async def _rental(self, identity: Identity, rental_id: str) -> Rental:
        rental = await self.coord.fleet.rentals.get(rental_id)
        # Someone else's rental is as unknown as a missing one: no probing for ids.
        if rental is None or not self._may_see(identity, rental):
            raise NotFound(f"no rental {rental_id!r}")
        return rental

    @grpc_errors
    async def CreateRental(  # noqa: N802
        self, request: pb.CreateRentalRequest, context: grpc.aio.ServicerContext
    ) -> pb.Rental:
        identity = self._caller(context)
        renter = request.renter
        if identity.role == RENTER:
            if renter and renter != identity.name:
                raise Refused(
                    grpc.StatusCode.PERMISSION_DENIED, f"{identity} may not rent as {renter!r}"
                )
            renter = identity.name
        elif identity.role != OPERATOR:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"{identity} may not create rentals")
        if not request.node_id or not request.image or not renter:
            raise BadRequest("a rental needs a node, an image and a renter")
        rental = await self.coord.fleet.rentals.create(
            request.node_id, renter, request.image, request.gpus or 1
        )
        return convert.rental_pb(rental)

    @grpc_errors
    async def GetRental(  # noqa: N802
        self, request: pb.GetRentalRequest, context: grpc.aio.ServicerContext
    ) -> pb.Rental:
        return convert.rental_pb(await self._rental(self._caller(context), request.rental_id))

    @grpc_errors
    async def EndRental(  # noqa: N802
        self, request: pb.EndRentalRequest, context: grpc.aio.ServicerContext
    ) -> pb.Rental:
        identity = self._caller(context)
        rental = await self._rental(identity, request.rental_id)
        ended_by = {RENTER: "renter", PROVIDER: "provider"}.get(
            identity.role, request.ended_by or "platform"
        )
        if ended_by not in END_CALLERS:
            raise BadRequest(f"ended_by must be one of {END_CALLERS}")
        return convert.rental_pb(await self.coord.fleet.rentals.end(rental, ended_by))

    @grpc_stream_errors
    async def WatchRental(  # noqa: N802
        self, request: pb.GetRentalRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.Rental]:
        identity = self._caller(context)
        await self._rental(identity, request.rental_id)
        book = self.coord.fleet.rentals
        # Subscribe before reading the current record: no change can fall between the two.
        queue = book.watch(request.rental_id)
        try:
            rental = await self._rental(identity, request.rental_id)
            yield convert.rental_pb(rental)
            while rental.active:
                rental = await queue.get()
                yield convert.rental_pb(rental)
        finally:
            book.unwatch(request.rental_id, queue)

    @grpc_errors
    async def ListRentals(  # noqa: N802
        self, request: pb.ListRentalsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListRentalsReply:
        identity = self._caller(context)
        rentals = await self.coord.fleet.rentals.list(request.node_id or None, request.active_only)
        return pb.ListRentalsReply(
            rentals=[convert.rental_pb(r) for r in rentals if self._may_see(identity, r)]
        )
