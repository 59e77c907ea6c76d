"""The reference router's view of one model's ready workers, kept current from the coordinator.

- `ModelRoutes`, pure: the table a `Routes.WatchRoutes` stream feeds, a snapshot then versioned
  changes, and the least-loaded pick. Versions only go up: a snapshot older than the table (a
  new leader's, say) is held aside, with the changes that follow it, until it is newer than the
  table; only then is it the table. (Not the coordinator's own `fleet.route_table.RouteTable`,
  the table those watches are served from.)
- `ModelWatch`: the watch itself, for as long as the router runs. It reconnects with backoff and
  re-snapshots on reconnect, to the leader of several replicas (spotdrain.net.leader: where a
  follower's refusal points, else the next address). While the coordinator is away the last
  table stays in use: a worker that drains meanwhile is refused by its own gate (503), and the
  request goes to another worker (docs/design.md "Owner pause timeline").
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import grpc

from spotdrain.net.leader import Replicas, from_replica
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

log = logging.getLogger("spotdrain.router")

WATCH_BACKOFF_MIN_S = 0.1
WATCH_BACKOFF_MAX_S = 5.0

# What the coordinator says when this router's identity may not read routes: permanent, so the
# router says so at start (exit 1) and requests do not wait for a snapshot that cannot come.
REFUSED_CODES = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)


# --- the core: one model's routing table -----------------------------------------------------


@dataclass(frozen=True)
class Route:
    worker_id: str
    node_id: str
    address: str  # the slot gate, HOST:PORT
    slots_in_use: int
    capacity: int


class ModelRoutes:
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
        self.table = ModelRoutes(model)
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
                        aside = f": older than the table's {self.table.version}, kept aside"
                        log.info(
                            "model %s: snapshot at version %d from %s, %d ready workers%s",
                            model,
                            update.version,
                            self._replicas.leader,
                            len(update.upsert),
                            "" if taken else aside,
                        )
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
