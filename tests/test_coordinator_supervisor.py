"""The coordinator's supervisor: a failed task ends the process non-zero (systemd restarts
it), the stop signal ends it cleanly, a helper that returns early (the systemd pings, when not
under systemd) is no failure, and every task is gone when it returns."""

from __future__ import annotations

import asyncio

from spotdrain.runtime.supervisor import supervise


async def forever(started: list[str], name: str, cancelled: list[str]) -> None:
    started.append(name)
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        cancelled.append(name)
        raise


async def test_a_failing_background_task_ends_the_coordinator_non_zero():
    started, cancelled = [], []

    async def recovery() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("the store went away for good")

    rc = await supervise({
        "recovery": recovery(),
        "loop-lag": forever(started, "loop-lag", cancelled),
        "stop": asyncio.Event().wait(),
    }, essential=("recovery",))
    assert rc == 1
    assert cancelled == ["loop-lag"]


async def test_the_stop_signal_ends_it_cleanly_after_early_helpers_returned():
    started, cancelled = [], []
    stop = asyncio.Event()

    async def not_under_systemd() -> None:
        return None

    async def signal_later() -> None:
        await asyncio.sleep(0.01)
        stop.set()

    asyncio.get_running_loop().create_task(signal_later())
    rc = await supervise({
        "watchdog": not_under_systemd(),
        "recovery": forever(started, "recovery", cancelled),
        "stop": stop.wait(),
    }, essential=("recovery",))
    assert rc == 0
    assert started == ["recovery"] and cancelled == ["recovery"]


async def test_an_essential_loop_that_returns_is_a_failure():
    async def recovery_that_stopped() -> None:
        return None

    rc = await supervise({"recovery": recovery_that_stopped(), "stop": asyncio.Event().wait()},
                         essential=("recovery",))
    assert rc == 1
