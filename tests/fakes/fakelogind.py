"""A private dbus-daemon and a fake logind on it, for the shutdown source
(agent/notices/shutdown.py): its tests (tests/agent/test_source_shutdown.py) and the benchmark
tests/bench/source_to_sigterm.py.

`start_bus(dir)` runs Debian's dbus-daemon on a unix socket in `dir`; `FakeLogind.start(address)`
owns org.freedesktop.login1 there: Inhibit hands out the write end of a pipe whose read end the
caller watches, so "the lock is released" is the kernel's end-of-file, not a flag; it sends
PrepareForShutdown and answers the properties the source reads.

Run alone (a benchmark's separate process): `python tests/fakes/fakelogind.py DIR [--delay-s S]`
prints the bus address, then takes one command a line on stdin and answers one JSON line each:
`prepare true|false` (sends PrepareForShutdown; answers {"sent_at": time.time() just before the
send}), `locks` ({"locks": N, "held": N, "calls": N}), `delay S`. End of input stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dbus_fast import Message, MessageType, Variant
from dbus_fast.aio import MessageBus

from spotdrain.agent.notices import shutdown

DELAY_S = 30.0  # the fake logind's InhibitDelayMaxUSec unless told


class BusError(RuntimeError):
    """dbus-daemon is missing or did not start."""


BUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""


# --- the bus ----------------------------------------------------------------------------------


# How long stop() waits for the bus to say it is closed.
STOP_WAIT_S = 5.0


@dataclass
class PrivateBus:
    socket: Path
    address: str
    process: subprocess.Popen

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


def start_bus(directory: Path) -> PrivateBus:
    """A dbus-daemon of the test's own on a unix socket in `directory` (Debian's dbus-daemon)."""
    daemon = shutil.which("dbus-daemon")
    if daemon is None:
        raise BusError("dbus-daemon not found: apt-get install dbus-daemon (tests/setup.sh)")
    directory.mkdir(parents=True, exist_ok=True)
    sock = directory / "bus"
    conf = directory / "bus.conf"
    conf.write_text(BUS_CONFIG.format(socket=sock))
    proc = subprocess.Popen(
        [daemon, f"--config-file={conf}", "--nofork", "--nopidfile", "--print-address"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 10)
    address = proc.stdout.readline().strip() if ready else ""
    if not address:
        proc.kill()
        raise BusError(f"dbus-daemon did not start: {proc.stderr.read() if proc.stderr else ''}")
    return PrivateBus(sock, f"unix:path={sock}", proc)


# --- a fake logind ------------------------------------------------------------------------------


@dataclass
class Lock:
    """One Inhibit call that got a lock: its arguments and the read end of its pipe."""

    what: str
    who: str
    why: str
    mode: str
    caller: str
    read_end: int

    @property
    def released(self) -> bool:
        """The holder closed its end (end-of-file is readable). Never blocks."""
        return bool(select.select([self.read_end], [], [], 0)[0])

    async def wait_released(self, timeout: float) -> float:
        """Wait for the release; the time.time() at which the test saw it."""
        loop = asyncio.get_running_loop()
        seen = loop.create_future()
        loop.add_reader(self.read_end, lambda: seen.done() or seen.set_result(time.time()))
        try:
            return await asyncio.wait_for(seen, timeout)
        finally:
            loop.remove_reader(self.read_end)


@dataclass
class FakeLogind:
    """org.freedesktop.login1 at /org/freedesktop/login1, as far as the source uses it."""

    bus: MessageBus
    delay_usec: int = int(DELAY_S * 1e6)
    preparing: bool = False
    in_progress: bool = False  # Inhibit answers OperationInProgress, as during a shutdown
    locks: list[Lock] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    # Called at each Inhibit, before it is answered; what it returned, in order.
    at_inhibit: Callable[[], Any] | None = None
    seen_at_inhibit: list[Any] = field(default_factory=list)
    _tasks: set[asyncio.Task] = field(default_factory=set)

    @classmethod
    async def start(cls, address: str, **kw: Any) -> FakeLogind:
        bus = await MessageBus(bus_address=address, negotiate_unix_fd=True).connect()
        fake = cls(bus, **kw)
        bus.add_message_handler(fake._handle)
        await bus.request_name(shutdown.LOGIND)
        return fake

    @property
    def unique_name(self) -> str:
        return self.bus.unique_name

    def _handle(self, msg: Message) -> bool | Message | None:
        if msg.message_type is not MessageType.METHOD_CALL or msg.path != shutdown.LOGIND_PATH:
            return None
        self.calls.append(msg.member)
        if (msg.interface, msg.member) == (shutdown.MANAGER, "Inhibit"):
            if self.in_progress:
                return Message.new_error(
                    msg,
                    shutdown.IN_PROGRESS,
                    "The operation inhibition has been requested for is already running",
                )
            if self.at_inhibit is not None:
                self.seen_at_inhibit.append(self.at_inhibit())
            read_end, write_end = os.pipe()
            self.locks.append(Lock(*msg.body, caller=msg.sender, read_end=read_end))
            task = asyncio.ensure_future(self._send_fd(msg, write_end))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return True
        if (msg.interface, msg.member) == (shutdown.PROPERTIES, "Get"):
            interface, name = msg.body
            values = {
                "InhibitDelayMaxUSec": Variant("t", self.delay_usec),
                "PreparingForShutdown": Variant("b", self.preparing),
            }
            if interface != shutdown.MANAGER or name not in values:
                return Message.new_error(msg, "org.freedesktop.DBus.Error.UnknownProperty", name)
            return Message.new_method_return(msg, "v", [values[name]])
        return Message.new_error(msg, "org.freedesktop.DBus.Error.UnknownMethod", msg.member)

    async def _send_fd(self, call: Message, write_end: int) -> None:
        # The fd must be in the socket before the fake closes its copy: then only the source
        # holds the write end, and its close is the pipe's end-of-file.
        try:
            await self.bus.send(Message.new_method_return(call, "h", [0], unix_fds=[write_end]))
        finally:
            os.close(write_end)

    async def prepare_for_shutdown(self, start: bool) -> float:
        """Send PrepareForShutdown(start); the time.time() just before the send."""
        self.preparing = start
        message = Message.new_signal(
            shutdown.LOGIND_PATH, shutdown.MANAGER, "PrepareForShutdown", "b", [start]
        )
        sent_at = time.time()
        await self.bus.send(message)
        return sent_at

    async def stop(self) -> None:
        """Bounded: a bus whose daemon is already gone may never report its end."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.bus.disconnect()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(STOP_WAIT_S):
                await self.bus.wait_for_disconnect()
        for lock in self.locks:
            with contextlib.suppress(OSError):
                os.close(lock.read_end)


# --- alone, for a benchmark process -------------------------------------------------------------


async def serve(directory: Path, delay_s: float) -> None:
    private = start_bus(directory)
    fake = await FakeLogind.start(private.address, delay_usec=int(delay_s * 1e6))
    print(private.address, flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := (await reader.readline()).decode():
            words = line.split()
            if words[:1] == ["prepare"] and words[1:] in (["true"], ["false"]):
                sent_at = await fake.prepare_for_shutdown(words[1] == "true")
                answer: dict[str, Any] = {"sent_at": sent_at}
            elif words == ["locks"]:
                held = sum(1 for lock in fake.locks if not lock.released)
                answer = {"locks": len(fake.locks), "held": held, "calls": len(fake.calls)}
            elif words[:1] == ["delay"] and len(words) == 2:
                fake.delay_usec = int(float(words[1]) * 1e6)
                answer = {"delay_usec": fake.delay_usec}
            else:
                answer = {"error": f"unknown command {line.strip()!r}"}
            print(json.dumps(answer), flush=True)
    finally:
        await fake.stop()
        private.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="A private dbus-daemon with a fake logind on it.")
    ap.add_argument("directory", type=Path, help="where the bus socket and its config go")
    ap.add_argument("--delay-s", type=float, default=DELAY_S, help="InhibitDelayMaxUSec, in s")
    args = ap.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.directory, args.delay_s))


if __name__ == "__main__":
    main()
