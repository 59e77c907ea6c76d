"""The host's own shutdown, through logind: an ACPI soft-off from the provider, `systemctl
poweroff`, an owner pressing the power button.

The agent holds a `delay` inhibitor lock for `shutdown` (logind's Inhibit returns the write end
of a FIFO; holding it open is holding the lock). logind announces a shutdown with
PrepareForShutdown(true) and then waits until every delay lock is released, or until its
InhibitDelayMaxUSec has passed, before it starts the shutdown. So on PrepareForShutdown(true)
the agent reports a hard notice with D = now + that delay and keeps the lock until the
reclamation has settled (verified empty, or past its overrun check O): the host goes down right
after the drain, not before it and not later (docs/design.md, "Hard notice timeline").

One notice per boot: the key is the kernel's boot id, so an agent restarted during the shutdown
reports the same notice again and the hub's dedup makes it the same reclamation, with its first
deadlines (invariant 2). A shutdown that logind calls off (PrepareForShutdown(false)) leaves that
reclamation as it is (its workloads were signalled at T0) and the lock held, or taken again.

The package's logind drop-in (packaging/systemd/logind.conf.d/spotdrain-agent.conf) sets the delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from spotdrain.agent.core.notice import Notice
from spotdrain.agent.core.reclamation import Margins
from spotdrain.agent.notices.base import Health, Sink
from spotdrain.agent.notices.settings import check_keys, number
from spotdrain.runtime.cli import UsageError

log = logging.getLogger("spotdrain.agent.notices.shutdown")

SYSTEM_BUS = "unix:path=/run/dbus/system_bus_socket"
LOGIND = "org.freedesktop.login1"
LOGIND_PATH = "/org/freedesktop/login1"
MANAGER = "org.freedesktop.login1.Manager"
PROPERTIES = "org.freedesktop.DBus.Properties"
BUS_NAME = "org.freedesktop.DBus"
BUS_PATH = "/org/freedesktop/DBus"
# logind refuses a new lock while the shutdown it would delay is already under way.
IN_PROGRESS = "org.freedesktop.login1.OperationInProgress"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
WHO = "spotdrain-agent"
WHY = "drain the workload containers before the host goes down"
# One bus call, logind's activation included. A call that takes longer counts as a failed read.
CALL_TIMEOUT_S = 5.0
# At PrepareForShutdown the delay is read again, in case logind's configuration was reloaded
# since the lock was taken; if logind does not answer within this, the value read then stands.
FRESH_DELAY_TIMEOUT_S = 0.25
MAX_DELAY_S = 24 * 3600.0
# Under this, a workload is killed as soon as the shutdown starts: G = D - grace_s <= T0.
SHORT_DELAY_S = Margins().grace_s

PREPARE_RULE = (
    f"type='signal',sender='{LOGIND}',path='{LOGIND_PATH}',interface='{MANAGER}',"
    "member='PrepareForShutdown'"
)
OWNER_RULE = (
    f"type='signal',sender='{BUS_NAME}',path='{BUS_PATH}',interface='{BUS_NAME}',"
    f"member='NameOwnerChanged',arg0='{LOGIND}'"
)


@dataclass(frozen=True)
class Config:
    bus: str = SYSTEM_BUS  # a unix D-Bus address: the lock is a file descriptor, passed over it
    delay_s: float | None = None  # cap on D - T0; None: the delay logind grants

    @classmethod
    def from_table(cls, table: dict[str, Any], where: str) -> Config:
        check_keys(table, {"bus", "delay_s"}, where, "shutdown")
        bus = table.get("bus", SYSTEM_BUS)
        if not isinstance(bus, str) or not _is_unix_address(bus):
            raise UsageError(
                f"{where}sources.shutdown.bus must be a unix D-Bus address "
                f"(unix:path=PATH or unix:abstract=NAME; the lock is a file descriptor and "
                f"only a unix socket carries one), got {bus!r}"
            )
        delay = table.get("delay_s")
        if delay is not None:
            delay = number(delay, f"{where}sources.shutdown.delay_s", 1.0, MAX_DELAY_S)
        return cls(bus=bus, delay_s=delay)


def _is_unix_address(address: str) -> bool:
    """One unix: address with a path or an abstract name (a list of fallbacks is not taken)."""
    transport, sep, options = address.partition(":")
    if transport != "unix" or not sep or ";" in options:
        return False
    pairs = dict(kv.partition("=")[::2] for kv in options.split(",") if kv)
    return bool(pairs.get("path") or pairs.get("abstract"))


class BusTrouble(Exception):
    """The system bus or logind did not do what was asked: a failed read, retried."""


class Source:
    name = "shutdown"

    def __init__(self, cfg: Config, sink: Sink, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.sink = sink
        self.clock = clock
        self.health = Health(self.name, sink, clock)
        self.lock_fd: int | None = None  # open: logind waits for us (up to its delay)
        self.delay_s: float | None = None  # InhibitDelayMaxUSec, as last read
        self._logind: str | None = None  # logind's unique name: only it may announce a shutdown

    @property
    def locked(self) -> bool:
        return self.lock_fd is not None

    async def run(self) -> None:
        """Hold the lock and answer shutdowns until cancelled. The bus or logind away is a
        failed read (health), retried with backoff; the lock, once held, stays held meanwhile,
        since it is a file descriptor of ours, not a part of the connection."""
        try:
            while True:
                try:
                    await self._connected()
                except (OSError, TimeoutError, BusTrouble) as e:
                    wait = self.health.failed(_describe(e, self.cfg.bus))
                    log.warning(
                        "notice source shutdown: %s; again in %.1f s", self.health.error, wait
                    )
                    await asyncio.sleep(wait)
        finally:
            self._release("the agent is stopping")

    # --- one connection ------------------------------------------------------------------------

    async def _connected(self) -> None:
        boot_id = read_boot_id()
        bus = MessageBus(bus_address=self.cfg.bus, negotiate_unix_fd=True)
        try:
            await asyncio.wait_for(bus.connect(), CALL_TIMEOUT_S)
        except (OSError, TimeoutError):
            raise
        except Exception as e:  # refused authentication, a bad address, a garbled answer
            raise BusTrouble(f"{self.cfg.bus}: {e.__class__.__name__}: {e}") from e
        events: asyncio.Queue[tuple[str, Message | BaseException | None]] = asyncio.Queue()

        def on_message(msg: Message) -> None:
            # Called by the bus reader for every message; judged in order by the loop below,
            # which knows who logind is by then.
            if msg.message_type is MessageType.SIGNAL:
                events.put_nowait(("signal", msg))

        async def watch_disconnect() -> None:
            try:
                await bus.wait_for_disconnect()
            except Exception as e:  # the bus reader's own failure: it ends the connection
                events.put_nowait(("disconnected", e))
            else:
                events.put_nowait(("disconnected", None))

        bus.add_message_handler(on_message)
        watcher = asyncio.create_task(watch_disconnect())
        try:
            for rule in (OWNER_RULE, PREPARE_RULE):
                await self._call(bus, BUS_NAME, BUS_PATH, BUS_NAME, "AddMatch", "s", [rule])
            in_progress = not await self._take_lock(bus)
            self.health.ok()
            if in_progress or await self._preparing(bus):
                # Started (or restarted) while the host is already going down.
                await self._shutting_down(bus, events, boot_id)
            while True:
                kind, item = await events.get()
                if kind == "disconnected":
                    why = f" ({item.__class__.__name__}: {item})" if item else ""
                    raise BusTrouble(f"{self.cfg.bus}: disconnected{why}")
                assert isinstance(item, Message)
                if self._owner_changed(item):
                    await self._take_lock(bus)  # a new logind: hold a lock there too
                    continue
                start = self._prepare_for_shutdown(item)
                if start is True:
                    await self._shutting_down(bus, events, boot_id)
                elif start is False and not self.locked:
                    await self._take_lock(bus)
        finally:
            watcher.cancel()
            bus.remove_message_handler(on_message)
            bus.disconnect()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher

    def _owner_changed(self, msg: Message) -> bool:
        """NameOwnerChanged for logind, from the bus itself: remember who logind is. True when
        a new logind took the name (restarted, or started by activation)."""
        if msg.sender != BUS_NAME or msg.member != "NameOwnerChanged" or msg.path != BUS_PATH:
            return False
        name, _old, new = msg.body
        if name != LOGIND:
            return False
        self._logind = new or None
        return bool(new)

    def _prepare_for_shutdown(self, msg: Message) -> bool | None:
        """PrepareForShutdown's argument, when logind itself sent it; None for anything else.
        Any peer on the bus can send a signal that looks like logind's (to us directly, past
        the match rule): only the current owner of the name is believed."""
        if (msg.member, msg.interface, msg.path) != ("PrepareForShutdown", MANAGER, LOGIND_PATH):
            return None
        if self._logind is None or msg.sender != self._logind or msg.signature != "b":
            log.warning(
                "notice source shutdown: PrepareForShutdown from %s ignored (logind is %s)",
                msg.sender,
                self._logind,
            )
            return None
        return bool(msg.body[0])

    # --- the lock ------------------------------------------------------------------------------

    async def _take_lock(self, bus: MessageBus) -> bool:
        """Take a delay lock; the one held before (if any) is closed only after, so there is
        no moment without one. False when logind says the shutdown is already under way."""
        reply = await self._call(
            bus,
            LOGIND,
            LOGIND_PATH,
            MANAGER,
            "Inhibit",
            "ssss",
            ["shutdown", WHO, WHY, "delay"],
            expect_error=IN_PROGRESS,
        )
        self._logind = reply.sender  # whoever answers for the name is logind
        if reply.message_type is MessageType.ERROR:
            return False
        fds = list(reply.unix_fds)
        try:
            index = reply.body[0] if reply.signature == "h" else -1
            if not 0 <= index < len(fds):
                raise BusTrouble(
                    f"logind's Inhibit gave no file descriptor (signature {reply.signature!r}, "
                    f"{len(fds)} descriptors): is unix fd passing refused on {self.cfg.bus}?"
                )
            fd = fds.pop(index)
        finally:
            for extra in fds:
                os.close(extra)
        old, self.lock_fd = self.lock_fd, fd
        if old is not None:
            os.close(old)
        self.delay_s = await self._delay(bus)
        log.info(
            "notice source shutdown: holding logind's shutdown delay lock (logind grants %.1f s%s)",
            self.delay_s,
            "" if self.cfg.delay_s is None else f", capped at {self.cfg.delay_s:g} s",
        )
        if self.delay_s <= SHORT_DELAY_S:
            log.warning(
                "notice source shutdown: logind's InhibitDelayMaxSec is only %.1f s: a shutdown "
                "leaves workloads no time before the grace deadline (is the package's "
                "logind.conf.d drop-in overridden?)",
                self.delay_s,
            )
        return True

    def _release(self, why: str) -> None:
        fd, self.lock_fd = self.lock_fd, None
        if fd is not None:
            os.close(fd)
            log.info("notice source shutdown: delay lock released: %s", why)

    async def _delay(self, bus: MessageBus, timeout: float = CALL_TIMEOUT_S) -> float:
        reply = await self._call(
            bus,
            LOGIND,
            LOGIND_PATH,
            PROPERTIES,
            "Get",
            "ss",
            [MANAGER, "InhibitDelayMaxUSec"],
            timeout=timeout,
        )
        usec = _variant(reply, "t", "InhibitDelayMaxUSec")
        return usec / 1e6

    async def _preparing(self, bus: MessageBus) -> bool:
        reply = await self._call(
            bus, LOGIND, LOGIND_PATH, PROPERTIES, "Get", "ss", [MANAGER, "PreparingForShutdown"]
        )
        return bool(_variant(reply, "b", "PreparingForShutdown"))

    # --- a shutdown ----------------------------------------------------------------------------

    async def _shutting_down(
        self,
        bus: MessageBus,
        events: asyncio.Queue[tuple[str, Message | BaseException | None]],
        boot_id: str,
    ) -> None:
        """Report the notice, then hold the lock until the reclamation settles, or until
        logind's delay is over (it goes ahead then anyway), or until logind calls it off."""
        t0 = self.clock()
        try:
            delay = await self._delay(bus, FRESH_DELAY_TIMEOUT_S)
        except (TimeoutError, BusTrouble) as e:
            log.warning(
                "notice source shutdown: delay not read again (%s); %s s stands", e, self.delay_s
            )
            delay = self.delay_s
        if delay is None:  # no lock was taken in this process: the shutdown was under way
            delay = await self._delay(bus)
        if self.cfg.delay_s is not None:
            delay = min(delay, self.cfg.delay_s)
        deadline = t0 + delay
        key = f"shutdown:{boot_id}"
        log.info("notice source shutdown: the host is shutting down; D in %.1f s", delay)
        self.sink.notice(
            Notice(
                key=key, notice_id=key, action="terminate", terminate_at=deadline, source=self.name
            )
        )
        settled = asyncio.ensure_future(self.sink.settled(key))
        connected = True
        try:
            while True:
                next_event = asyncio.ensure_future(events.get()) if connected else None
                await asyncio.wait(
                    {settled} if next_event is None else {settled, next_event},
                    timeout=max(deadline - self.clock(), 0.0),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if next_event is not None and next_event.done():
                    # Events first: one that came with the outcome is still handled.
                    kind, item = next_event.result()
                    if kind == "disconnected":
                        # The lock is ours, not the connection's: wait on for the drain; the
                        # caller sees the disconnect again afterwards and reconnects.
                        events.put_nowait((kind, item))
                        connected = False
                    elif isinstance(item, Message) and self._owner_changed(item):
                        await self._take_lock(bus)
                    elif isinstance(item, Message) and self._prepare_for_shutdown(item) is False:
                        log.warning(
                            "notice source shutdown: logind called the shutdown off; the "
                            "reclamation goes on, a lock is held for the next shutdown"
                        )
                        if not self.locked:  # none could be had while it was under way
                            await self._take_lock(bus)
                        return
                    continue
                if next_event is not None:
                    next_event.cancel()  # an item not yet taken stays in the queue
                why = (
                    f"reclamation {settled.result()}"
                    if settled.done()
                    else ("logind's delay is over")
                )
                break
        finally:
            settled.cancel()
        self._release(why)

    # --- calls ---------------------------------------------------------------------------------

    async def _call(
        self,
        bus: MessageBus,
        destination: str,
        path: str,
        interface: str,
        member: str,
        signature: str,
        body: list[Any],
        *,
        timeout: float = CALL_TIMEOUT_S,
        expect_error: str = "",
    ) -> Message:
        """One method call; an error reply raises BusTrouble, except `expect_error`, which is
        returned."""
        msg = Message(
            destination=destination,
            path=path,
            interface=interface,
            member=member,
            signature=signature,
            body=body,
        )
        try:
            reply = await asyncio.wait_for(bus.call(msg), timeout)
        except TimeoutError:
            raise
        except Exception as e:  # what ended the connection: EOFError, OSError, a bad message
            raise BusTrouble(f"{destination} {member}: {e.__class__.__name__}: {e}") from e
        if reply.message_type is MessageType.ERROR:
            for fd in reply.unix_fds:
                os.close(fd)
            if reply.error_name == expect_error:
                return reply
            text = reply.body[0] if reply.body and isinstance(reply.body[0], str) else ""
            raise BusTrouble(f"{destination} {member}: {reply.error_name}: {text}".rstrip(": "))
        return reply


def read_boot_id() -> str:
    """This boot's id (a UUID the kernel makes at boot): the same for every agent process
    until the host reboots. /proc, so it never blocks."""
    return BOOT_ID.read_text().strip()


def _variant(reply: Message, signature: str, what: str) -> Any:
    value = reply.body[0] if reply.body else None
    if getattr(value, "signature", None) != signature:
        raise BusTrouble(f"logind's {what} is not of type {signature!r}: {value!r}")
    return value.value


def _describe(error: BaseException, bus: str) -> str:
    if isinstance(error, BusTrouble):
        return str(error)
    if isinstance(error, TimeoutError):
        return f"{bus}: no answer within {CALL_TIMEOUT_S:g} s"
    return f"{bus}: {error.__class__.__name__}: {error}".rstrip(": ")
