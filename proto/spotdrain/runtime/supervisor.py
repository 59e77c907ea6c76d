"""The coordinator's one supervisor (Temporal's worker is the model): named tasks; the stop
signal ends them cleanly; the first task to fail ends them all and the process exits non-zero,
so systemd's Restart=on-failure takes over instead of a coordinator limping on without its
recovery loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Coroutine, Mapping
from typing import Any

log = logging.getLogger("spotdrain.runtime.supervisor")


async def supervise(
    tasks: Mapping[str, Coroutine[Any, Any, Any]],
    stop: str = "stop",
    essential: Collection[str] = (),
) -> int:
    """Run `tasks` until `stop` ends (0), one of them fails or an `essential` one returns (1).
    Others may return (the systemd helpers do, when not under systemd). Every task is
    cancelled and awaited before this returns."""
    running = {asyncio.create_task(coro, name=name): name for name, coro in tasks.items()}
    rc = 0
    try:
        pending = set(running)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failed = [t for t in done if not t.cancelled() and t.exception() is not None]
            for task in failed:
                log.error("%s failed", running[task], exc_info=task.exception())
            ended = [running[t] for t in done if running[t] in essential and t not in failed]
            for name in ended:
                log.error("%s ended", name)
            if failed or ended:
                rc = 1
                break
            if any(running[t] == stop for t in done):
                break
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    return rc
