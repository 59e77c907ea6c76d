"""One supervisor per daemon (Temporal's worker is the model), used by the agent and the
coordinator alike: named tasks; the stop signal ends them cleanly (exit 0); the first task to
fail ends them all and the process exits non-zero, so systemd's Restart=on-failure takes over
instead of a daemon limping on without one of its loops. `shutdown()` is safe to call twice.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

log = logging.getLogger("spotdrain.runtime.supervisor")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Supervisor:
    """Run named tasks until the stop signal (rc 0), a task fails, or an essential one ends
    (rc 1). A task that is not essential may return (the systemd helpers do, when not under
    systemd). Tasks may be added while it runs; every task is cancelled and awaited before
    `run()` returns."""

    def __init__(self, label: str = "", grace_s: float = 5.0) -> None:
        self.label = label  # prefixes log lines ("node n1")
        self.grace_s = grace_s  # how long shutdown waits for a cancelled task to finish
        self.failure: BaseException | None = None  # the first task's exception, for the caller
        self._tasks: dict[asyncio.Task[Any], str] = {}
        self._essential: set[asyncio.Task[Any]] = set()
        self._judged: set[asyncio.Task[Any]] = set()
        self._wake = asyncio.Event()
        self._stop_requested = False
        self._closed = False

    def add(
        self, name: str, coro: Coroutine[Any, Any, Any], essential: bool = False
    ) -> asyncio.Task[Any]:
        if self._closed:
            coro.close()  # never awaited otherwise: a warning, and nothing to supervise
            raise RuntimeError(f"supervisor shut down: cannot start {name}")
        task = asyncio.create_task(coro, name=name)
        self._tasks[task] = name
        if essential:
            self._essential.add(task)
        task.add_done_callback(lambda _t: self._wake.set())
        self._wake.set()
        return task

    def stop(self) -> None:
        """The stop signal: end every task cleanly; `run()` returns 0."""
        self._stop_requested = True
        self._wake.set()

    def install_signal_handlers(
        self, on_stop: Callable[[], Any] | None = None, signals: Iterable[int] = STOP_SIGNALS
    ) -> None:
        """SIGTERM and SIGINT call `stop()` (after `on_stop`, e.g. systemd's STOPPING=1). They
        stay installed through the shutdown: a second SIGTERM must not kill it halfway."""
        loop = asyncio.get_running_loop()

        def handler() -> None:
            if on_stop is not None:
                on_stop()
            self.stop()

        for sig in signals:
            loop.add_signal_handler(sig, handler)

    def all_running(self) -> bool:
        """Whether every supervised task still runs (the watchdog's health check)."""
        return not any(task.done() for task in self._tasks)

    async def run(self) -> int:
        try:
            while True:
                self._wake.clear()
                rc = self._verdict()
                if rc is not None:
                    return rc
                await self._wake.wait()
        finally:
            await self.shutdown()

    def _verdict(self) -> int | None:
        rc = None
        for task, name in list(self._tasks.items()):
            if not task.done() or task in self._judged:
                continue
            self._judged.add(task)
            error = None if task.cancelled() else task.exception()
            if error is not None:
                log.error("%s%s failed", self._prefix(), name, exc_info=error)
                if self.failure is None:
                    self.failure = error
                rc = 1
            elif task in self._essential:
                log.error("%s%s ended", self._prefix(), name)
                rc = 1
        if rc is None and self._stop_requested:
            rc = 0
        return rc

    async def shutdown(self) -> None:
        """Cancel every task and wait for them, at most `grace_s`; safe to call again, or from
        a supervised task (which is left to end by itself)."""
        self._closed = True
        me = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not me]
        for task in tasks:
            task.cancel()
        if not tasks:
            return
        _, late = await asyncio.wait(tasks, timeout=self.grace_s)
        for task in late:
            log.error("%s%s ignored its cancellation", self._prefix(), self._tasks[task])
        for task in tasks:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: no "exception was never retrieved" at exit

    def _prefix(self) -> str:
        return f"{self.label}: " if self.label else ""
