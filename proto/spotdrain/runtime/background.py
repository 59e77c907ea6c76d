"""Tasks a component starts and does not await (a container's exit watch, a start, an
acquisition): kept referenced until they finish, since the event loop holds only weak references
to tasks, and cancelled together when the component closes.

A task that fails is never dropped silently: its exception goes to `on_error` (by default, a
logged traceback), so a component can decide that a failed helper is fatal (the drain runner
stops the agent's supervisor) or only worth a line.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger("spotdrain.runtime.background")


class Background:
    def __init__(self, on_error: Callable[[BaseException], None] | None = None) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._on_error = on_error or _log_error

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._on_error(task.exception())  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self) -> None:
        """Cancel every task still running and wait for them to end."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _log_error(error: BaseException) -> None:
    log.error("a background task failed", exc_info=error)
