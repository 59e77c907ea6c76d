"""Finding the leader among several coordinator replicas: what the agent, spotctl and the router
share (docs/fleet.md "Several replicas").

Only the leader serves (coordinator/replicas/leadership.py). A follower refuses with UNAVAILABLE and
the trailing metadata key `spotdrain-leader`: the leader's address, or empty while it knows of none
(no leader now, or the leader is still rebuilding). A client keeps the leader as last heard:

- a unary call goes to every address at once, the leader as last heard and the list, then to a
  leader a refusal named that is not among them; only the leader can succeed (a follower does
  nothing but refuse), so this is one call's worth of effect, and a stopped replica cannot eat
  the caller's deadline (`Replicas.on_leader`);
- a stream goes to the leader as last heard; refused or broken, it goes where the refusal
  points, else to the next address (`Replicas.moved`), and the caller opens it again.

A caller that may wait for a new leader (spotctl, the router) retries refusals within a window
(`Replicas.until_leader`); the agent does not: past its 800 ms its local taint applies.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from spotdrain.runtime.cli import UsageError, host_port

LEADER_KEY = "spotdrain-leader"  # a replica's trailing metadata: the leader's address, or ""
# What a client retries elsewhere: a refusal, a replica gone, a call that ran out of time.
MOVE_ON = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
RETRY_S = (0.05, 0.1, 0.2, 0.3, 0.5)


def addresses(text: str, flag: str = "--coordinator") -> tuple[str, ...]:
    """`A:PORT` or `A:PORT,B:PORT`: every replica's address, in the order given."""
    found = tuple(dict.fromkeys(a.strip() for a in text.split(",") if a.strip()))
    if not found:
        raise UsageError(f"{flag} HOST:PORT is required")
    for address in found:
        host_port(address, flag)
    return found


def leader_hint(error: grpc.aio.AioRpcError) -> str:
    """The leader's address a follower named, or ''."""
    for key, value in error.trailing_metadata() or ():
        if key == LEADER_KEY and isinstance(value, str):
            return value
    return ""


def from_replica(error: grpc.aio.AioRpcError) -> bool:
    """A replica refused (it names the leader, or says there is none yet): one will lead."""
    return any(key == LEADER_KEY for key, _ in error.trailing_metadata() or ())


def never_reached(error: grpc.aio.AioRpcError) -> bool:
    """The call cannot have run: a replica refused it, or no connection was made."""
    details = (error.details() or "").lower()
    return from_replica(error) or (
        error.code() == grpc.StatusCode.UNAVAILABLE
        and ("failed to connect" in details or "connection refused" in details)
    )


def _first_answer(errors: list[grpc.aio.AioRpcError]) -> grpc.aio.AioRpcError:
    # The leader's own refusal says more than a follower's UNAVAILABLE or a timeout.
    return sorted(errors, key=lambda e: e.code() in MOVE_ON)[0]


class Replicas:
    """Several coordinator addresses (or one) and the leader as last heard, one channel each."""

    def __init__(
        self, addresses: Sequence[str], make_channel: Callable[[str], grpc.aio.Channel]
    ) -> None:
        if not addresses:
            raise ValueError("no coordinator address")
        self.addresses = tuple(addresses)
        self.leader = self.addresses[0]
        self._make_channel = make_channel
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[tuple[str, type], Any] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = self._make_channel(address)
        return self._channels[address]

    def stub(self, stub_class: type, address: str | None = None) -> Any:  # noqa: ANN401
        """`stub_class` (a generated stub) on `address`, the leader as last heard by default."""
        key = (address or self.leader, stub_class)
        if key not in self._stubs:
            self._stubs[key] = stub_class(self.channel(key[0]))
        return self._stubs[key]

    async def close(self) -> None:
        channels, self._channels, self._stubs = list(self._channels.values()), {}, {}
        for channel in channels:
            await channel.close(grace=None)

    def moved(self, error: grpc.aio.AioRpcError | None) -> bool:
        """A call to the leader as last heard failed (or a stream ended: None): to the leader
        a follower named, else to the next address. True when a replica named a leader (go
        there at once)."""
        hint = leader_hint(error) if error is not None else ""
        if hint:
            self.leader = hint
            return True
        if len(self.addresses) > 1 or self.leader not in self.addresses:
            i = self.addresses.index(self.leader) if self.leader in self.addresses else -1
            self.leader = self.addresses[(i + 1) % len(self.addresses)]
        return False

    async def on_leader(
        self,
        stub_class: type,
        method: str,
        request: Any,  # noqa: ANN401
        timeout: float | None,
        errors: list[grpc.aio.AioRpcError] | None = None,
    ) -> Any:  # noqa: ANN401
        """A unary call answered by the leader, within `timeout` in all (None: no deadline):
        sent to every address at once, then to a leader a follower named that is not among
        them. One address: one plain call. A failure raises the most telling error; `errors`
        gets them all."""
        deadline = None if timeout is None else time.monotonic() + timeout
        targets = list(dict.fromkeys([self.leader, *self.addresses]))
        errors = [] if errors is None else errors
        while targets:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            calls = {
                asyncio.ensure_future(
                    getattr(self.stub(stub_class, a), method)(request, timeout=left)
                ): a
                for a in targets
            }
            tried, targets = set(targets), []
            try:
                for next_done in asyncio.as_completed(calls):
                    try:
                        reply = await next_done
                    except grpc.aio.AioRpcError as e:
                        errors.append(e)
                        hint = leader_hint(e)
                        if hint and hint not in tried and hint not in targets:
                            targets.append(hint)
                        continue
                    for call, address in calls.items():
                        if call.done() and not call.cancelled() and call.exception() is None:
                            self.leader = address
                    return reply
            finally:
                for call in calls:
                    call.cancel()
            if deadline is not None and time.monotonic() >= deadline:
                break
        raise _first_answer(errors)

    def may_wait(self, error: grpc.aio.AioRpcError) -> bool:
        """Whether a failed call is worth retrying for a new leader: refused or unreachable,
        with replicas in play (several addresses, or a replica's refusal). One plain
        coordinator that is down fails at once, as it always has."""
        return error.code() in MOVE_ON and (len(self.addresses) > 1 or from_replica(error))

    async def until_leader(
        self,
        stub_class: type,
        method: str,
        request: Any,  # noqa: ANN401
        wait_s: float,
        timeout: float | None = None,
        once_only: bool = False,
    ) -> Any:  # noqa: ANN401
        """`on_leader`, retried while no leader answers, for at most `wait_s` (a leader's
        failover is a TTL and a renewal, about 2.5 s with the defaults). `once_only`: a call
        that must not take effect twice (a new worker, a new rental) is retried only when no
        leader can have run it (every replica refused it, or none was reached)."""
        give_up = time.monotonic() + wait_s
        attempt = 0
        while True:
            errors: list[grpc.aio.AioRpcError] = []
            try:
                return await self.on_leader(stub_class, method, request, timeout, errors)
            except grpc.aio.AioRpcError as e:
                pause = RETRY_S[min(attempt, len(RETRY_S) - 1)]
                if not self.may_wait(e) or time.monotonic() + pause > give_up:
                    raise
                if once_only and not all(never_reached(x) for x in errors):
                    raise
            await asyncio.sleep(pause)
            attempt += 1

    async def stream_from_leader(
        self,
        stub_class: type,
        method: str,
        request: Callable[[], Any],
        wait_s: float,
    ) -> AsyncIterator[Any]:
        """A server stream from the leader (or any replica that serves it), opened again on
        another replica when it is refused or breaks, as long as one answers within `wait_s`
        of the trouble starting. `request()` is called for each opening, so it can carry where
        the caller is (an event id, say)."""
        give_up: float | None = None  # set while no replica answers
        attempt = 0
        while True:
            try:
                async for reply in getattr(self.stub(stub_class), method)(request()):
                    give_up, attempt = None, 0
                    yield reply
                return
            except grpc.aio.AioRpcError as e:
                give_up = give_up or time.monotonic() + wait_s
                pause = 0.0 if self.moved(e) else RETRY_S[min(attempt, len(RETRY_S) - 1)]
                if not self.may_wait(e) or time.monotonic() + pause > give_up:
                    raise
            await asyncio.sleep(pause)
            attempt += 1
