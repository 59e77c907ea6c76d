"""The one supervisor both daemons run under: a failed task ends them all and the process exits
non-zero (systemd restarts it), the stop signal ends it cleanly, a helper that returns early
(the systemd pings, when not under systemd) is no failure, and a second shutdown (a signal
during the first, or the daemon's own cleanup after run()) is harmless."""

from __future__ import annotations

import asyncio
import os
import signal

from spotdrain.runtime.supervisor import Supervisor


async def forever(
    started: list[str], name: str, cancelled: list[str], up: asyncio.Event | None = None
) -> None:
    started.append(name)
    if up is not None:
        up.set()
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        cancelled.append(name)
        raise


async def test_the_first_task_to_fail_ends_them_all_non_zero():
    """The recovery loop dies on a store that went away: every other loop is cancelled and
    awaited, the failure is kept for the caller, and the exit is 1."""
    started, cancelled = [], []

    async def recovery() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("the store went away for good")

    sup = Supervisor()
    sup.add("loop-lag", forever(started, "loop-lag", cancelled))
    sup.add("link", forever(started, "link", cancelled))
    sup.add("recovery", recovery())
    assert await sup.run() == 1
    assert sorted(cancelled) == ["link", "loop-lag"]
    assert isinstance(sup.failure, RuntimeError)
    assert not sup.all_running()


async def test_sigterm_ends_every_task_cleanly_after_early_helpers_returned():
    """The watchdog helper returns at once (no systemd), then a real SIGTERM arrives: the
    stop hook runs, every task is cancelled and the exit is 0."""
    started, cancelled, hooked = [], [], []

    async def not_under_systemd() -> None:
        return None

    sup = Supervisor()
    sup.install_signal_handlers(on_stop=lambda: hooked.append("STOPPING=1"))
    sup.add("watchdog", not_under_systemd())
    up = asyncio.Event()
    sup.add("recovery", forever(started, "recovery", cancelled, up), essential=True)

    async def signal_once_running() -> None:
        await up.wait()
        os.kill(os.getpid(), signal.SIGTERM)

    sender = asyncio.create_task(signal_once_running())
    assert await sup.run() == 0
    await sender
    assert hooked == ["STOPPING=1"] and cancelled == ["recovery"]
    assert sup.failure is None


async def test_an_essential_loop_that_returns_is_a_failure():
    async def recovery_that_stopped() -> None:
        return None

    sup = Supervisor()
    sup.add("recovery", recovery_that_stopped(), essential=True)
    sup.add("status", asyncio.Event().wait())
    assert await sup.run() == 1
    assert sup.failure is None


async def test_a_task_added_while_it_runs_is_supervised_too():
    """The agent starts its systemd reporter next to the others: its failure counts as well."""
    sup = Supervisor()
    sup.add("link", asyncio.Event().wait())

    async def add_later() -> None:
        async def systemd() -> None:
            raise OSError("notify socket gone")

        await asyncio.sleep(0)
        sup.add("systemd", systemd())

    sup.add("starter", add_later())
    assert await sup.run() == 1
    assert isinstance(sup.failure, OSError)


async def test_shutdown_twice_and_from_a_task_is_harmless():
    """A SIGTERM during the daemon's cleanup, or a supervised task that asks for the shutdown
    itself: the second call returns at once, no task is awaited by itself, and nothing may
    be started afterwards."""
    started, cancelled = [], []
    sup = Supervisor()
    up = asyncio.Event()
    sup.add("drains", forever(started, "drains", cancelled, up))

    async def asks_for_shutdown() -> None:
        await up.wait()
        await sup.shutdown()

    asker = sup.add("control", asks_for_shutdown())
    await asker
    assert cancelled == ["drains"]
    await asyncio.gather(sup.shutdown(), sup.shutdown())
    assert cancelled == ["drains"]
    sup.stop()
    assert await sup.run() == 0

    async def late() -> None:
        return None

    try:
        sup.add("late", late())
    except RuntimeError:
        pass
    else:
        raise AssertionError("a task was started after the shutdown")


async def test_a_task_that_ignores_its_cancellation_is_given_up_after_the_grace():
    """One wedged task does not keep the daemon from exiting (systemd would SIGKILL it)."""
    release, up = asyncio.Event(), asyncio.Event()

    async def stubborn() -> None:
        up.set()
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue

    sup = Supervisor(grace_s=0.05)
    task = sup.add("stubborn", stubborn())
    await up.wait()
    sup.stop()
    assert await sup.run() == 0
    assert not task.done()
    release.set()
    await task
