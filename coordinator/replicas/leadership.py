"""Coordinator replicas on PostgreSQL: the lease's thin async shell, and what a follower answers.

Opt-in: only with `--advertise HOST:PORT` (and a PostgreSQL `--db`). Without it the coordinator
is today's single process and nothing here runs.

The lease (coordinator/replicas/lease.py decides, this carries out): a replica takes the lease row
when it has run out by the database's clock, at the next term; it fences every write by that term
(coordinator/store/postgres.py), runs `rebuild(store)` (which gives every node a fresh heartbeat
TTL: the coordinator changed, not the nodes), and serves. It renews every `--lease-renew-s`. A
leader that cannot renew before its own expiry, or whose write the database refused by its
term, steps down: every write refused from then on, every call sent away, and the process ends
non-zero (as Kubernetes' leader election does) so that systemd starts it again as a clean
follower: nothing the deposed leader kept in memory is trusted again.

A follower answers the calls that need the leader's memory or write (agents' Connect and Taint,
routes, rentals, the admin verbs that list live state or change it) with UNAVAILABLE and the
leader's `--advertise` address in the trailing metadata key `spotdrain-leader`; it serves the
reads that come from the store alone (events from an id, reclamation timelines). gRPC health
reports each service SERVING only on the replica that serves it (the leader); "" is SERVING on
every live replica.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from spotdrain.coordinator.api.errors import end_call
from spotdrain.coordinator.replicas import lease as lm
from spotdrain.coordinator.store import Store, StoreError
from spotdrain.net.leader import LEADER_KEY  # trailing metadata: the leader's --advertise address
from spotdrain.runtime.cli import ArgumentParser, UsageError, add_bounded, host_port
from spotdrain.v1 import spotdrain_pb2 as pb

log = logging.getLogger("spotdrain.coordinator.replicas.leadership")

DEFAULT_TTL_S = 2.0
DEFAULT_RENEW_S = 0.5
# Route versions of a new leader start above any its predecessors published, whatever the
# replicas' clocks say: each term adds this much (2^40 us, about 12 days of clock skew).
ROUTE_TERM_STRIDE = 1 << 40
# Reads a follower serves from the store (no leader memory needed).
FOLLOWER_READS = {"Admin": ("WatchEvents", "GetTimeline")}
# A deposed leader ends within this long whatever its shutdown waits for (the graceful stop
# takes 2 s): it must not linger serving anything.
STEP_DOWN_EXIT_S = 5.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def add_arguments(p: ArgumentParser) -> None:
    p.add_argument(
        "--advertise",
        default="",
        help="HOST:PORT clients reach this replica at: runs it as one of several replicas on a "
        "PostgreSQL --db, one leading through a lease (default: a single coordinator)",
    )
    add_bounded(p, "--lease-ttl-s", 0.01, 3600, DEFAULT_TTL_S, "replicas: the leader lease's TTL")
    add_bounded(
        p,
        "--lease-renew-s",
        0.01,
        3600,
        DEFAULT_RENEW_S,
        "replicas: how often the leader renews it",
    )


def check_arguments(args: Any) -> None:  # noqa: ANN401 (argparse namespace)
    if not args.advertise:
        return
    host_port(args.advertise, "--advertise")
    if not args.db.startswith(("postgresql://", "postgres://")):
        raise UsageError("--advertise (several replicas) needs a PostgreSQL --db")
    if args.lease_renew_s >= args.lease_ttl_s:
        raise UsageError("--lease-renew-s must be below --lease-ttl-s")


class Replica:
    """One replica: its lease, and whether it serves now."""

    def __init__(
        self,
        store: Store,
        advertise: str,
        ttl_s: float = DEFAULT_TTL_S,
        renew_s: float = DEFAULT_RENEW_S,
        clock: Callable[[], float] = time.monotonic,
        step_down_exit_s: float = STEP_DOWN_EXIT_S,
        exit_deposed: Callable[[int], None] | None = None,
    ) -> None:
        self.backend = store.backend
        if not hasattr(self.backend, "acquire_lease"):
            raise StoreError("replicas need a PostgreSQL store")
        self.advertise = advertise
        # Unique per process: a restarted replica is a new holder, never its old self's term. It
        # names this process's database sessions, which a successor ends should this replica
        # stop inside a write while leading (coordinator/store/postgres.py, END_EXPIRED).
        self.holder = self.backend.holder_for(advertise)
        self.lease = lm.Lease(ttl_s, renew_s)
        self.clock = clock
        # How a deposed replica that has not stopped ends, and after how long (tests record it).
        self._step_down_exit_s = step_down_exit_s
        self._exit_deposed = exit_deposed or _exit_deposed
        self.ready = asyncio.Event()  # the leader has rebuilt: it serves
        self.leader_address = ""  # where followers send callers
        self.on_health: Callable[[bool], Awaitable[None]] = _nothing
        self._deposed = ""
        self._answers: list[lm.Renewed | lm.RenewFailed | lm.Lost] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self.backend.fence_off("a follower: not the leader")
        self.backend.on_fenced = self._fenced

    # --- what each call asks -----------------------------------------------------------------

    def serving(self) -> bool:
        return self.ready.is_set() and self.lease.leads(self.clock())

    def refusal(self) -> str:
        if self.lease.state == lm.LEADER:
            return "the leader is starting (rebuilding from the store); retry"
        return (
            f"not the leader; the leader is {self.leader_address}"
            if self.leader_address
            else "not the leader; no leader now, retry"
        )

    # --- the shell ---------------------------------------------------------------------------

    def _fenced(self, why: str) -> None:
        self._deposed = why
        self._wake.set()

    async def run(self, on_lead: Callable[[int], Awaitable[None]]) -> None:
        """Keep the lease; returns once this replica, having led, stepped down."""
        ttl = self.lease.ttl_s
        leading: asyncio.Task[None] | None = None
        try:
            while True:
                events: list[Any] = self._answers
                self._answers = []
                if self._deposed:
                    events.append(lm.Lost(self.clock(), why=self._deposed))
                    self._deposed = ""
                now = self.clock()
                events.append(lm.Tick(now))
                for event in events:
                    for command in self.lease.handle(event):
                        match command:
                            case lm.Acquire():
                                self._start(self._acquire(now, ttl))
                            case lm.Renew(term=term):
                                self._start(self._renew(now, term, ttl))
                            case lm.Lead(term=term):
                                self.backend.fence_to(term, self.holder, ttl)
                                self.leader_address = self.advertise
                                log.info("leading at term %d (%s)", term, self.holder)
                                leading = asyncio.create_task(self._lead(term, on_lead))
                            case lm.StepDown(term=term, why=why):
                                self.backend.fence_off(f"stepped down from term {term}: {why}")
                                self.ready.clear()
                                log.error("stepping down from term %d: %s", term, why)
                                asyncio.get_running_loop().call_later(
                                    self._step_down_exit_s, self._exit_deposed, term
                                )
                                await self.on_health(False)
                                return
                            case lm.Follow(holder=holder):
                                self._follow(holder)
                            case _:
                                raise TypeError(command)
                timeout = min(ttl, max(0.0, self.lease.wake_at() - self.clock()))
                self._wake.clear()
                try:
                    async with asyncio.timeout(timeout):  # (wait_for can swallow a cancel)
                        await self._wake.wait()
                except TimeoutError:
                    pass
        finally:
            for task in [*self._tasks, *([leading] if leading else [])]:
                task.cancel()

    async def _lead(self, term: int, on_lead: Callable[[int], Awaitable[None]]) -> None:
        started = time.monotonic()
        try:
            await on_lead(term)
        except Exception as e:  # noqa: BLE001 (a rebuild that failed: step down, never hold on)
            # Holding the lease without serving would keep every other replica out: step down
            # (and exit, for a clean start as a follower).
            log.error("rebuild for term %d failed: %s: %s", term, type(e).__name__, e)
            self._fenced(f"the rebuild of term {term} failed: {type(e).__name__}: {e}")
            return
        if self.lease.leads(self.clock()) and self.lease.term == term:
            self.ready.set()
            await self.on_health(True)
            log.info(
                "serving as the leader of term %d (rebuilt in %.3f s)",
                term,
                time.monotonic() - started,
            )

    def _follow(self, holder: str) -> None:
        address = holder.split(" ", 1)[0]
        if address != self.leader_address:
            log.info("following %s", address or "no leader")
        self.leader_address = address

    def _start(self, coro: Awaitable[lm.Renewed | lm.RenewFailed | lm.Lost]) -> None:
        """A lease statement in the background; its answer is an event for the loop."""

        async def answer() -> None:
            try:
                event = await coro  # (before naming the list: the loop swaps it meanwhile)
            except Exception as e:  # noqa: BLE001 (an answer must come, or the lease is stuck)
                log.error("lease statement failed: %s: %s", type(e).__name__, e)
                event = lm.RenewFailed(self.clock(), f"{type(e).__name__}: {e}")
            self._answers.append(event)
            self._wake.set()

        task = asyncio.create_task(answer())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _acquire(self, sent: float, ttl: float) -> lm.Renewed | lm.RenewFailed | lm.Lost:
        try:
            taken, term, holder, left = await self.backend.acquire_lease(
                self.holder, ttl, self.lease.renew_s
            )
        except StoreError as e:
            return lm.RenewFailed(self.clock(), str(e))
        if taken:
            return lm.Renewed(self.clock(), term, sent + min(left, ttl))
        return lm.Lost(self.clock(), holder if left > 0 else "", left)

    async def _renew(
        self, sent: float, term: int, ttl: float
    ) -> lm.Renewed | lm.RenewFailed | lm.Lost:
        until = self.lease.until or sent
        try:
            renewed = await self.backend.renew_lease(
                self.holder, term, ttl, max(0.01, until - self.clock())
            )
            if renewed:
                return lm.Renewed(self.clock(), term, sent + ttl)
            _, holder, left = await self.backend.lease_holder(self.lease.renew_s)
        except StoreError as e:
            log.warning("could not renew term %d: %s", term, e)
            return lm.RenewFailed(self.clock(), str(e))
        return lm.Lost(self.clock(), holder, left, f"term {term} is no longer the lease's")

    async def report_health(self, health_servicer: Any, services: Collection[str]) -> None:  # noqa: ANN401
        """Each service SERVING while this replica serves it (the leader, rebuilt), else
        NOT_SERVING; "" stays as the caller set it (SERVING: the process answers)."""

        async def report(serving: bool) -> None:
            status = SERVING if serving else NOT_SERVING
            for name in services:
                await health_servicer.set(name, status)

        self.on_health = report
        await report(self.serving())

    # --- servicers ---------------------------------------------------------------------------

    def guard(self, servicer: Any, service: str) -> Any:  # noqa: ANN401 (a gRPC servicer)
        """`servicer` behind this replica: its methods while it leads; otherwise the store
        reads a follower serves, and UNAVAILABLE naming the leader for the rest."""
        return _Guarded(self, servicer, service, FOLLOWER_READS.get(service, ()))


async def _nothing(_: bool) -> None:
    return None


def _exit_deposed(term: int) -> None:
    log.error("stepped down from term %d and still not stopped: exiting now", term)
    logging.shutdown()
    os._exit(1)


def taking_over(coord: Any, pauses: Any) -> Callable[[int], Awaitable[None]]:  # noqa: ANN401
    """What a replica does on taking the lease at `term`: the one startup path, rebuild from
    the store (every live worker gets a full heartbeat TTL from now), with route versions
    above any its predecessors published (a router never sees an older table)."""

    async def take_over(term: int) -> None:
        routes = coord.fleet.routes
        routes.version = max(routes.version, time.time_ns() // 1000 + term * ROUTE_TERM_STRIDE)
        await coord.fleet.recovery.rebuild()
        pauses.freeze()

    return take_over


class _Guarded:
    def __init__(self, replica: Replica, servicer: Any, service: str, reads: Collection[str]):  # noqa: ANN401
        descriptor = pb.DESCRIPTOR.services_by_name[service]
        for method in descriptor.methods:
            target = getattr(servicer, method.name)
            handler = (
                _streaming(replica, target, method.name in reads)
                if method.server_streaming
                else _unary(replica, target, method.name in reads)
            )
            setattr(self, method.name, handler)


def _send_away(replica: Replica, context: grpc.aio.ServicerContext) -> None:
    """The call refused UNAVAILABLE, naming the leader; the caller returns right after."""
    # The key even when no leader is known (empty): clients see a replica refused, so one
    # will lead, and wait for it (spotdrain.net.leader) rather than giving up as on a dead host.
    elsewhere = replica.leader_address if replica.lease.state != lm.LEADER else ""
    context.set_trailing_metadata(((LEADER_KEY, elsewhere),))
    end_call(context, grpc.StatusCode.UNAVAILABLE, replica.refusal())


def _unary(replica: Replica, target: Callable, follower_serves: bool) -> Callable:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: ANN401
        if not (follower_serves or replica.serving()):
            _send_away(replica, context)
            return None
        return await target(request, context)

    return call


def _streaming(replica: Replica, target: Callable, follower_serves: bool) -> Callable:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:  # noqa: ANN401
        if not (follower_serves or replica.serving()):
            _send_away(replica, context)
            return
        async for reply in target(request, context):
            yield reply

    return call
