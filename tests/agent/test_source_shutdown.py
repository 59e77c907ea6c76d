"""The shutdown source (agent/notices/shutdown.py) against a real, private dbus-daemon and a fake
logind of the test's own on that bus (tests/fakes/fakelogind.py): Inhibit hands out the write end of
a pipe whose read end the test watches, so "the lock is released" is the kernel's end-of-file, not a
flag; the fake sends PrepareForShutdown and answers the properties the source reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from dbus_fast import Message
from dbus_fast.aio import MessageBus

from fakes.fakelogind import DELAY_S, FakeLogind, PrivateBus, start_bus
from fakes.waiting import eventually
from spotdrain.agent.core.notice import Notice
from spotdrain.agent.notices import shutdown
from spotdrain.agent.notices.base import DOWN_AFTER, Advisory, Health
from spotdrain.runtime.cli import UsageError

T0 = 1_900_000_000.0  # the fake clock's now


# --- the bus ----------------------------------------------------------------------------------


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[PrivateBus]:
    private = start_bus(tmp_path / "dbus")
    yield private
    private.stop()


# --- a fake logind ------------------------------------------------------------------------------


@pytest.fixture
async def logind(bus: PrivateBus) -> AsyncIterator[FakeLogind]:
    fake = await FakeLogind.start(bus.address)
    yield fake
    await fake.stop()


# --- a fake sink --------------------------------------------------------------------------------


class FakeSink:
    """The hub's side, recording: notices, health changes; settled(key) returns when the test
    says."""

    def __init__(self) -> None:
        self.notices: list[Any] = []
        self.health: list[tuple[str, bool, str]] = []
        self.settle_waits: list[str] = []
        self._outcomes: dict[str, asyncio.Future[str]] = {}

    def notice(self, parsed: Any) -> None:
        self.notices.append(parsed)

    def advisory(self, advisory: Advisory) -> None:
        raise AssertionError(f"the shutdown source sends no advisory: {advisory}")

    def record(self, source: str, kind: str, details: dict[str, Any]) -> None:
        raise AssertionError(f"unexpected event {kind} from {source}")

    def health_changed(self, health: Health) -> None:
        self.health.append((health.source, health.up, health.error))

    def _outcome(self, key: str) -> asyncio.Future[str]:
        return self._outcomes.setdefault(key, asyncio.get_running_loop().create_future())

    async def settled(self, key: str) -> str:
        self.settle_waits.append(key)
        return await asyncio.shield(self._outcome(key))

    def settle(self, key: str, outcome: str = "drained") -> None:
        self._outcome(key).set_result(outcome)


@contextlib.asynccontextmanager
async def running(source: shutdown.Source) -> AsyncIterator[asyncio.Task]:
    task = asyncio.create_task(source.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert task.cancelled(), "run() ended on its own"


def source_for(address: str, sink: FakeSink, clock=lambda: T0, **cfg: Any) -> shutdown.Source:
    return shutdown.Source(shutdown.Config(bus=address, **cfg), sink, clock)


KEY = "shutdown:" + Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def shutdown_notice(terminate_at: float) -> Notice:
    return Notice(
        key=KEY, notice_id=KEY, action="terminate", terminate_at=terminate_at, source="shutdown"
    )


# --- scenarios ----------------------------------------------------------------------------------


async def test_the_agent_holds_a_delay_lock_for_shutdown_from_the_start(bus, logind):
    """An agent starts on a host: it takes logind's shutdown delay lock, keeps it, reports
    nothing, and the source is up."""
    sink = FakeSink()
    source = source_for(bus.address, sink)
    async with running(source):
        lock = await eventually(lambda: logind.locks and logind.locks[0], "the lock")
        assert (lock.what, lock.who, lock.mode) == ("shutdown", "spotdrain-agent", "delay")
        assert lock.why  # shown by `systemd-inhibit --list`
        await eventually(lambda: source.delay_s is not None, "the delay read")
        assert source.delay_s == DELAY_S
        assert (lock.released, sink.notices, sink.health) == (False, [], [])
        assert source.health.up and source.health.last_ok == T0
    assert lock.released, "the lock outlived the source"


async def test_poweroff_is_a_notice_with_logind_delay_and_waits_for_the_drain(bus, logind):
    """`systemctl poweroff`: logind sends PrepareForShutdown(true). The source reports a
    terminate notice with D = now + InhibitDelayMaxUSec, keyed on this boot, and holds the lock
    until the reclamation settles; then it lets the shutdown go."""
    sink = FakeSink()
    source = source_for(bus.address, sink)
    async with running(source):
        lock = await eventually(lambda: logind.locks and logind.locks[0], "the lock")
        await eventually(lambda: source.delay_s is not None, "the delay read")
        logind.delay_usec = int(45 * 1e6)  # reloaded since: the delay at the shutdown counts
        await logind.prepare_for_shutdown(True)
        await eventually(lambda: sink.notices, "the notice")
        assert sink.notices == [shutdown_notice(T0 + 45.0)]
        await eventually(lambda: sink.settle_waits, "the source to wait for the reclamation")
        assert sink.settle_waits == [KEY]
        assert not lock.released, "released before the reclamation settled"
        sink.settle(KEY, "drained")
        await lock.wait_released(5)
        assert len(logind.locks) == 1 and not source.locked
        assert sink.notices == [shutdown_notice(T0 + 45.0)]


async def test_delay_s_caps_the_deadline(bus, logind):
    """With delay_s = 12 and logind granting 30 s, D = T0 + 12."""
    sink = FakeSink()
    source = source_for(bus.address, sink, delay_s=12.0)
    async with running(source):
        await eventually(lambda: source.delay_s is not None, "the lock")
        await logind.prepare_for_shutdown(True)
        await eventually(lambda: sink.notices, "the notice")
        assert sink.notices == [shutdown_notice(T0 + 12.0)]


async def test_a_shutdown_logind_calls_off_after_the_drain_gets_the_lock_back(bus, logind):
    """The drain settled and the lock went; then logind sends PrepareForShutdown(false) (the
    shutdown could not go ahead): the source takes a new lock for the next shutdown."""
    sink = FakeSink()
    source = source_for(bus.address, sink)
    async with running(source):
        first = await eventually(lambda: logind.locks and logind.locks[0], "the lock")
        await logind.prepare_for_shutdown(True)
        await eventually(lambda: sink.settle_waits, "the wait for the reclamation")
        sink.settle(KEY)
        await first.wait_released(5)
        await logind.prepare_for_shutdown(False)
        second = await eventually(lambda: len(logind.locks) == 2 and logind.locks[1], "a new lock")
        await eventually(lambda: source.locked, "the new lock held")
        assert (second.mode, second.released) == ("delay", False)
        assert len(sink.notices) == 1


async def test_a_shutdown_called_off_during_the_drain_keeps_the_lock(bus, logind):
    """PrepareForShutdown(false) while the drain is still going: the source stops waiting
    and keeps the lock it holds (the reclamation itself goes on at the hub). A second
    shutdown later is reported again, the same lock still held, no second one taken."""
    sink = FakeSink()
    source = source_for(bus.address, sink)
    async with running(source):
        lock = await eventually(lambda: logind.locks and logind.locks[0], "the lock")
        await logind.prepare_for_shutdown(True)
        await eventually(lambda: sink.settle_waits, "the wait for the reclamation")
        await logind.prepare_for_shutdown(False)
        await logind.prepare_for_shutdown(True)
        # The second notice proves the first wait ended and (false) was handled before it.
        await eventually(lambda: len(sink.notices) == 2, "the second notice")
        assert (lock.released, len(logind.locks)) == (False, 1)
        assert sink.notices == [shutdown_notice(T0 + DELAY_S)] * 2
        sink.settle(KEY)
        await lock.wait_released(5)


async def test_the_lock_goes_when_logind_delay_runs_out_even_if_the_drain_has_not_settled(
    bus, logind
):
    """logind waits InhibitDelayMaxUSec at most, then shuts down anyway: the source lets go of
    the lock by D even though the reclamation never settled."""
    logind.delay_usec = 400_000
    sink = FakeSink()
    source = source_for(bus.address, sink, clock=time.time)
    async with running(source):
        lock = await eventually(lambda: logind.locks and logind.locks[0], "the lock")
        await eventually(lambda: source.delay_s is not None, "the delay read")
        asked = time.time()
        await logind.prepare_for_shutdown(True)
        released_at = await lock.wait_released(5)
        (notice,) = sink.notices
        assert asked <= notice.terminate_at - 0.4 <= released_at
        assert notice.terminate_at - 0.05 <= released_at <= notice.terminate_at + 0.5
        assert sink.settle_waits == [KEY]


async def test_an_agent_started_during_a_shutdown_reports_it_at_once(bus, logind):
    """The agent (re)starts while the host is already going down: logind refuses a new lock
    (OperationInProgress) and PreparingForShutdown is true. The source reports the same
    boot's notice at once, so the hub's dedup keeps the first reclamation; the source is up.
    When the shutdown is called off, it takes the lock."""
    logind.in_progress = True
    logind.preparing = True
    sink = FakeSink()
    source = source_for(bus.address, sink)
    async with running(source):
        await eventually(lambda: sink.notices, "the notice")
        assert sink.notices == [shutdown_notice(T0 + DELAY_S)]
        assert (logind.locks, source.health.up, sink.health) == ([], True, [])
        await eventually(lambda: sink.settle_waits, "the wait for the reclamation")
        sink.settle(KEY, "drained")
        logind.in_progress = False
        await logind.prepare_for_shutdown(False)
        lock = await eventually(lambda: logind.locks and logind.locks[0], "the lock")
        assert not lock.released


async def test_a_prepare_for_shutdown_from_anyone_but_logind_is_ignored(bus, logind):
    """Any local user on the system bus can send a signal that looks like logind's, addressed
    to the agent: only the owner of org.freedesktop.login1 is believed. logind restarting
    (a new owner) is followed, and the source takes a lock from the new one."""
    sink = FakeSink()
    source = source_for(bus.address, sink)
    async with running(source):
        lock = await eventually(lambda: logind.locks and logind.locks[0], "the lock")
        spoofer = await MessageBus(bus_address=bus.address).connect()
        try:
            fake = Message.new_signal(
                shutdown.LOGIND_PATH, shutdown.MANAGER, "PrepareForShutdown", "b", [True]
            )
            fake.destination = lock.caller
            await spoofer.send(fake)
            # A round trip through the daemon: the spoof is on its way to the source first.
            await spoofer.call(
                Message(
                    destination="org.freedesktop.DBus",
                    path="/org/freedesktop/DBus",
                    interface="org.freedesktop.DBus",
                    member="GetId",
                )
            )
            # logind restarts: the source sees the name change after the spoof, in order.
            await logind.bus.release_name(shutdown.LOGIND)
            second = await FakeLogind.start(bus.address)
            try:
                new_lock = await eventually(lambda: second.locks and second.locks[0], "a new lock")
                assert sink.notices == []
                await eventually(lambda: lock.released, "the old lock closed after the new one")
                assert not new_lock.released
                # The new logind is believed.
                await second.prepare_for_shutdown(True)
                await eventually(lambda: sink.notices, "the notice")
                assert sink.notices == [shutdown_notice(T0 + DELAY_S)]
            finally:
                await second.stop()
        finally:
            spoofer.disconnect()


async def test_no_bus_and_no_logind_is_down_then_up(tmp_path):
    """The system bus is not there (dbus stopped, or the socket path wrong), then it is but
    logind does not answer, then logind is back: the source retries with backoff, is reported
    down once after DOWN_AFTER failures and up once when it holds the lock; it never ends."""
    directory = tmp_path / "dbus"
    address = f"unix:path={directory / 'bus'}"
    sink = FakeSink()
    source = source_for(address, sink, clock=time.time)
    async with running(source):
        await eventually(lambda: sink.health, "the source reported down")
        assert source.health.failures == DOWN_AFTER
        [(name, up, error)] = sink.health
        assert (name, up) == ("shutdown", False)
        assert str(directory / "bus") in error and "FileNotFoundError" in error, error
        private = start_bus(directory)
        try:
            await eventually(lambda: "ServiceUnknown" in source.health.error, "logind's absence")
            assert "org.freedesktop.login1" in source.health.error
            assert [up for _, up, _ in sink.health] == [False]
            fake = await FakeLogind.start(private.address)
            try:
                lock = await eventually(lambda: fake.locks and fake.locks[0], "the lock", 15)
                await eventually(lambda: len(sink.health) == 2, "the source reported up")
                assert sink.health[1] == ("shutdown", True, "")
                assert not lock.released
            finally:
                await fake.stop()
        finally:
            private.stop()


async def test_the_lock_is_kept_while_the_bus_is_away_and_taken_again_after(tmp_path):
    """dbus-daemon dies while the agent holds the lock (the lock is a descriptor of its own,
    not the connection's): the lock stays held; when the bus and logind are back the source
    takes a new lock first and only then closes the old one."""
    directory = tmp_path / "dbus"
    private = start_bus(directory)
    first = await FakeLogind.start(private.address)
    sink = FakeSink()
    source = source_for(private.address, sink, clock=time.time)
    async with running(source):
        old = await eventually(lambda: first.locks and first.locks[0], "the lock")
        private.stop()
        await eventually(lambda: source.health.failures, "the source to notice the bus gone")
        assert not old.released
        private = start_bus(directory)
        second = await FakeLogind.start(private.address, at_inhibit=lambda: old.released)
        try:
            new = await eventually(lambda: second.locks and second.locks[0], "a new lock", 15)
            await eventually(lambda: old.released, "the old lock closed")
            assert second.seen_at_inhibit == [False], "the old lock went before a new one came"
            # The source counts itself healthy just after the swap: the old lock's end can be
            # seen here first on a busy machine.
            await eventually(lambda: source.health.failures == 0, "the source healthy again")
            assert not new.released
        finally:
            await second.stop()
            private.stop()
    await first.stop()


async def test_a_socket_that_is_no_bus_is_a_failed_read_not_a_crash(tmp_path):
    """Something else listens at the bus address and answers garbage to the authentication:
    the source counts failed reads and goes down; it never raises out of run()."""
    path = tmp_path / "not-a-bus"

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(64)
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(garbage, path=str(path))
    sink = FakeSink()
    source = source_for(f"unix:path={path}", sink, clock=time.time)
    try:
        async with running(source):
            await eventually(lambda: sink.health, "the source reported down")
            [(name, up, error)] = sink.health
            assert (name, up) == ("shutdown", False) and str(path) in error, error
            assert not source.locked
    finally:
        server.close()
        await server.wait_closed()


# --- configuration ------------------------------------------------------------------------------


WHERE = "config /etc/spotdrain/agent.toml: "


def test_config_defaults_to_the_system_bus_and_logind_delay():
    cfg = shutdown.Config.from_table({}, WHERE)
    assert cfg == shutdown.Config(bus="unix:path=/run/dbus/system_bus_socket", delay_s=None)


def test_config_takes_a_unix_bus_address_and_a_cap():
    cfg = shutdown.Config.from_table({"bus": "unix:abstract=/tmp/x", "delay_s": 25}, WHERE)
    assert (cfg.bus, cfg.delay_s) == ("unix:abstract=/tmp/x", 25.0)


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ({"bus": "tcp:host=localhost,port=1"}, "sources.shutdown.bus must be a unix D-Bus"),
        ({"bus": "unix:"}, "sources.shutdown.bus must be a unix D-Bus"),
        ({"bus": "/run/dbus/system_bus_socket"}, "sources.shutdown.bus must be a unix D-Bus"),
        ({"bus": 5}, "sources.shutdown.bus must be a unix D-Bus"),
        ({"delay_s": 0}, "sources.shutdown.delay_s must be between 1 and 86400"),
        ({"delay_s": "30"}, "sources.shutdown.delay_s must be a number"),
        ({"delay_s": True}, "sources.shutdown.delay_s must be a number"),
        ({"delay_s": math.inf}, "sources.shutdown.delay_s must be between"),
        ({"delay": 30}, "unknown setting sources.shutdown.delay"),
    ],
)
def test_config_refuses_bad_values_in_one_line(table, says):
    with pytest.raises(UsageError) as e:
        shutdown.Config.from_table(table, WHERE)
    assert str(e.value).startswith(WHERE) and says in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
