"""The suite's one way to wait for something to become true: ask again until the answer is
truthy, and return it. `eventually` in async tests (the predicate may be a coroutine function),
`wait_until` in plain ones and threads. The bound only stops a broken test from hanging; it is
never the test. Never use either to prove that something did NOT happen: wait for a later event
that comes after it instead (docs/contributing.md "Tests")."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

TIMEOUT_S = 10.0


def _give_up(what: str, timeout: float, last: Any) -> TimeoutError:
    shown = repr(last)
    if len(shown) > 500:
        shown = shown[:500] + "..."
    return TimeoutError(f"timed out after {timeout} s waiting for {what} (last: {shown})")


async def eventually(
    predicate: Callable[[], Any],
    what: str = "the condition",
    timeout: float = TIMEOUT_S,
    *,
    ok: Callable[[Any], Any] = bool,
    every: float = 0.01,
) -> Any:
    """Ask predicate() (awaited when it returns an awaitable) until ok(its answer); that answer.
    `ok` judges an answer that is not itself the truth: `eventually(get_rental, ok=ended)`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise _give_up(what, timeout, value)
        await asyncio.sleep(every)


def wait_until(
    predicate: Callable[[], Any],
    timeout: float = TIMEOUT_S,
    what: str = "the condition",
    every: float = 0.05,
) -> Any:
    """Block until predicate() is truthy; that value. For threads and plain tests."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _give_up(what, timeout, value)
        time.sleep(every)
