"""Rejected calls: every malformed request counted, and logged at most once per peer a minute.

A body that does not decode fails inside gRPC before any servicer runs (gRPC would answer
UNKNOWN and log a full traceback for each); a field out of bounds is refused by
coordinator/api/convert.py as INVALID_ARGUMENT or RESOURCE_EXHAUSTED; anything unexpected is
INTERNAL. `RejectionGuard`, a server interceptor in front of every service, sees all three: it swaps
each method's request deserializer for one that hands a `Malformed` marker to the method instead of
raising, answers it INVALID_ARGUMENT, turns any exception that still escapes a servicer into a
status code (so a call never ends UNKNOWN), and counts each rejection in
`spotdrain_rpc_rejected_total`.

A client's malformed input is its mistake, not ours: one line (peer, identity, method,
reason), never a traceback, and at most one such line per peer a minute (`LogLimiter`, pure,
with the lines it held back counted in the next one), so a client sending garbage in a loop
cannot fill the coordinator's disk with logs. An unexpected exception is ours:
coordinator/api/errors.py logs one line with its type for each, the traceback at DEBUG only.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter

from spotdrain.coordinator.api import convert
from spotdrain.coordinator.api.errors import BadRequest, end_with, one_line

log = logging.getLogger("spotdrain.coordinator.api.rejections")

# What a malformed request ends with: the codes counted.
REJECTED = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INTERNAL,
)
LOG_WINDOW_S = 60.0
MAX_LOGGED_PEERS = 4096  # peers remembered by the limiter; beyond, they share one budget
OTHER_PEERS = "(other peers)"


class LogLimiter:
    """Which rejection lines to write: at most one per key per window.

    Pure but for the injected clock. `admit(key)` is None while the key's window runs (the
    line is held back and counted), else the number of lines held back since the last one
    written (0 for a first line). Bounded memory: keys whose window ran out are forgotten when
    the table is full, and while it is still full new keys share one budget.
    """

    def __init__(
        self,
        window_s: float = LOG_WINDOW_S,
        max_keys: int = MAX_LOGGED_PEERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s = window_s
        self.max_keys = max_keys
        self.clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def admit(self, key: str) -> int | None:
        now = self.clock()
        if key not in self._last and len(self._last) >= self.max_keys:
            self._forget_before(now - self.window_s)
            if len(self._last) >= self.max_keys:
                key = OTHER_PEERS
        last = self._last.get(key)
        if last is not None and now - last < self.window_s:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._held.pop(key, 0)

    def _forget_before(self, cutoff: float) -> None:
        for key in [k for k, at in self._last.items() if at <= cutoff]:
            del self._last[key]
            self._held.pop(key, None)

    def __len__(self) -> int:
        return len(self._last)


@dataclass(frozen=True)
class Malformed:
    """What a method gets instead of a request that did not decode."""

    reason: str


class MalformedRequest(BadRequest):
    """A message of a client stream that did not decode: INVALID_ARGUMENT."""


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def decode(raw: bytes) -> Any:  # noqa: ANN401 (a message, or the marker)
        try:
            return deserialize(raw)
        except Exception as e:  # noqa: BLE001 (a client's bytes: any failure is theirs)
            return Malformed(f"undecodable body of {len(raw)} bytes ({type(e).__name__})")

    return decode


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, Malformed):
            raise MalformedRequest(request.reason)
        convert.check_request(request)
        yield request


def peer_host(peer: str) -> str:
    """`ipv4:10.0.0.7:51234` -> `ipv4:10.0.0.7`: a client reconnecting gets a new port, not a
    new log budget."""
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


def _identity(context: grpc.aio.ServicerContext) -> str:
    try:
        names = context.auth_context().get("x509_common_name") or []
    except Exception:  # noqa: BLE001 (only for the log line)
        return "?"
    return names[0].decode(errors="replace") if names else "no certificate"


class RejectionGuard(grpc.aio.ServerInterceptor):
    """In front of every service of the server: decode failures answered INVALID_ARGUMENT, no
    exception out of a servicer, every rejection counted and (rate-limited) logged."""

    def __init__(self, registry: CollectorRegistry, limiter: LogLimiter | None = None) -> None:
        self.limiter = limiter if limiter is not None else LogLimiter()
        self.rejected = Counter(
            "spotdrain_rpc_rejected_total",
            "gRPC calls refused for a malformed request (undecodable, or a field out of "
            "bounds: INVALID_ARGUMENT, RESOURCE_EXHAUSTED) or failed unexpectedly (INTERNAL).",
            ["service", "method", "code"],
            registry=registry,
        )

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:  # no such method: gRPC answers UNIMPLEMENTED
            return None
        return self.wrap(handler, handler_call_details.method)

    def wrap(self, handler: grpc.RpcMethodHandler, path: str) -> grpc.RpcMethodHandler:
        deserialize = handler.request_deserializer
        if deserialize is not None:
            deserialize = _tolerant(deserialize)
        if handler.request_streaming and handler.response_streaming:
            factory = grpc.stream_stream_rpc_method_handler
            behavior = self._responses(handler.stream_stream, path, streamed_requests=True)
        elif handler.request_streaming:
            factory = grpc.stream_unary_rpc_method_handler
            behavior = self._response(handler.stream_unary, path, streamed_requests=True)
        elif handler.response_streaming:
            factory = grpc.unary_stream_rpc_method_handler
            behavior = self._responses(handler.unary_stream, path, streamed_requests=False)
        else:
            factory = grpc.unary_unary_rpc_method_handler
            behavior = self._response(handler.unary_unary, path, streamed_requests=False)
        return factory(
            behavior,
            request_deserializer=deserialize,
            response_serializer=handler.response_serializer,
        )

    def _response(self, method: Callable, path: str, streamed_requests: bool) -> Callable:
        """A method that returns once (a unary answer, or a stream written through the
        context)."""

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: ANN401
            try:
                request = self._usable(request, streamed_requests)
                return await method(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as e:  # noqa: BLE001 (mapped, never raised into gRPC)
                self._end(context, e, path)
                return None
            finally:
                self.account(context, path)

        return call

    def _responses(self, method: Callable, path: str, streamed_requests: bool) -> Callable:
        if not inspect.isasyncgenfunction(method):
            return self._response(method, path, streamed_requests)

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:  # noqa: ANN401
            try:
                request = self._usable(request, streamed_requests)
                async with contextlib.aclosing(method(request, context)) as responses:
                    async for response in responses:
                        yield response
            except grpc.aio.AbortError:
                raise
            except Exception as e:  # noqa: BLE001
                self._end(context, e, path)
            finally:
                self.account(context, path)

        return stream

    @staticmethod
    def _usable(request: Any, streamed: bool) -> Any:  # noqa: ANN401
        if streamed:
            return _checked(request)
        if isinstance(request, Malformed):
            raise MalformedRequest(request.reason)
        convert.check_request(request)  # out of bounds: BadRequest or TooLarge, mapped below
        return request

    @staticmethod
    def _end(context: grpc.aio.ServicerContext, error: Exception, path: str) -> None:
        end_with(context, error, path, refusals=False)  # refusals: account() below

    def account(self, context: grpc.aio.ServicerContext, path: str) -> None:
        """Count the call if it was rejected; its line if the peer's budget allows."""
        code = context.code()
        if code not in REJECTED:
            return
        service, _, method = path.lstrip("/").partition("/")
        self.rejected.labels(service, method, code.name).inc()
        if code == grpc.StatusCode.INTERNAL:
            return  # ours, not the client's: coordinator/api/errors.py logged it, one line each
        peer = context.peer()
        held = self.limiter.admit(peer_host(peer))
        if held is None:
            return
        log.warning(
            "rejected %s from %s (%s): %s: %s%s",
            path,
            peer,
            _identity(context),
            code.name,
            one_line(context.details() or ""),
            f" ({held} more from this peer not logged in the last minute)" if held else "",
        )
