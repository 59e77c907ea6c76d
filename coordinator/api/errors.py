"""Domain errors, and the one place they become gRPC status codes.

Every servicer method is wrapped by `grpc_errors`: a domain error ends the call with its code
and its message; anything unexpected is logged in one line (its traceback at DEBUG) and
answered INTERNAL. A servicer never raises into gRPC, and never says "unreachable";
coordinator/api/rejections.py counts what was refused as malformed and logs it, rate-limited.

A refusal sets the call's status and returns; it never goes through `context.abort`. The
abort's exception is kept on the call's state while its traceback holds the handler frames,
and so the request: a reference cycle that only a full collection frees. The coordinator keeps
full collections rare (coordinator/gc_pauses.py), and the fuzz test saw +100 MiB of refused requests
kept alive that way.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from spotdrain.coordinator.fleet.drains import SpotChangeRefused, UnknownNode
from spotdrain.coordinator.fleet.placer import PlacementRefused
from spotdrain.coordinator.store import StoreError, StoreUnavailable
from spotdrain.protocol import limits

log = logging.getLogger("spotdrain.coordinator.api.errors")

F = TypeVar("F", bound=Callable[..., Any])


class Refused(Exception):
    """A call refused with a given code (identity checks: UNAUTHENTICATED, PERMISSION_DENIED)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class BadRequest(ValueError):
    """A request that is malformed or out of bounds: INVALID_ARGUMENT, nothing changed."""


class NotFound(KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "not found"


class Precondition(Exception):
    """Refused in the state things are in now (a pause already held): FAILED_PRECONDITION."""


class TooLarge(Exception):
    """Above a configured bound (proto/spotdrain/protocol/limits.py): RESOURCE_EXHAUSTED, nothing
    stored."""


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    match error:
        case Refused(code=code):
            return code, str(error)
        case BadRequest():
            return grpc.StatusCode.INVALID_ARGUMENT, str(error)
        case TooLarge():
            return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)
        case NotFound() | UnknownNode():
            return grpc.StatusCode.NOT_FOUND, str(error)
        case PlacementRefused() | SpotChangeRefused() | Precondition():
            return grpc.StatusCode.FAILED_PRECONDITION, str(error)
        case StoreUnavailable():
            return grpc.StatusCode.UNAVAILABLE, f"store unavailable, retry: {error}"
        case StoreError():
            return grpc.StatusCode.UNAVAILABLE, f"store error: {error}"
    return grpc.StatusCode.INTERNAL, f"internal error ({type(error).__name__})"


# A malformed request's line is written by coordinator/api/rejections.py, at most once per peer a
# minute.
MALFORMED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
MAX_LINE_CHARS = 200


def one_line(text: str) -> str:
    """A client's words in our log: one line, bounded."""
    text = " ".join(text.split())
    return text if len(text) <= MAX_LINE_CHARS else text[:MAX_LINE_CHARS] + "..."


def end_with(
    context: grpc.aio.ServicerContext, error: BaseException, call: str, refusals: bool = True
) -> None:
    """The error as the call's status code; the caller returns right after (see above).
    `refusals=False`: a caller that counts and logs refusals itself (the rejection
    interceptor) gets only the INTERNAL line from here."""
    code, message = status_for(error)
    if code == grpc.StatusCode.INTERNAL:
        # Ours, not the caller's: one line naming the exception; its traceback at DEBUG only.
        log.error(
            "%s from %s failed: %s: %s",
            call,
            context.peer(),
            type(error).__name__,
            one_line(str(error)),
        )
        log.debug("%s failed", call, exc_info=error)
    elif refusals and code not in MALFORMED:
        log.info("%s: %s: %s", call, code.name, one_line(message))
    end_call(context, code, message)


def end_call(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """The call's status, sent when its handler returns (no message follows)."""
    context.set_code(code)
    context.set_details(bounded(message))


def bounded(message: str) -> str:
    """A status message that fits a client's metadata limit, whatever it quotes."""
    limit = limits.MAX_STATUS_CHARS
    return message if len(message) <= limit else message[: limit - 3] + "..."


def grpc_errors(method: F) -> F:
    """Wrap a unary servicer method: domain errors become status codes."""

    @functools.wraps(method)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 (mapped, never raised into gRPC)
            end_with(context, e, method.__name__)
            return None

    return unary  # type: ignore[return-value]


def grpc_stream_errors(method: F) -> F:
    """The same for a server-streaming method (an async generator)."""

    @functools.wraps(method)
    async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
        try:
            async for item in method(self, request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001
            end_with(context, e, method.__name__)

    return stream  # type: ignore[return-value]
