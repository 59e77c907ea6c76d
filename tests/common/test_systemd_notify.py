"""systemd integration: sd_notify over a real datagram socket (a filesystem path and a Linux
abstract `@` name), the watchdog, journald's native protocol to a real socket (parsed as journald
parses it), and both daemons as real processes telling a socket bound here what systemd would
hear from them."""

from __future__ import annotations

import array
import asyncio
import fcntl
import logging
import os
import re
import signal
import socket
import statistics
import struct
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fakes.dockerenv import run_workload
from fakes.harness import AgentOptions, start_agent, start_coordinator
from fakes.waiting import wait_until
from spotdrain.runtime import systemd


@dataclass
class Datagram:
    at: float  # time.monotonic() on receipt
    data: bytes
    probe: Any  # what the listener's probe said at receipt

    @property
    def fields(self) -> list[str]:
        return self.data.decode().split("\n")


class NotifyListener:
    """What systemd's end of $NOTIFY_SOCKET sees: a bound AF_UNIX datagram socket, read by a
    thread. `probe`, if given, runs at each receipt (to check what had happened by then)."""

    def __init__(self, name: str, probe: Callable[[], Any] | None = None) -> None:
        self.name = name  # as $NOTIFY_SOCKET spells it
        address = "\0" + name[1:] if name.startswith("@") else name
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.settimeout(0.1)
        self.probe = probe
        self.received: list[Datagram] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            probe = self.probe() if self.probe is not None else None
            self.received.append(Datagram(time.monotonic(), data, probe))

    def datagrams(self) -> list[bytes]:
        return [d.data for d in self.received]

    def with_field(self, prefix: str) -> list[Datagram]:
        return [d for d in list(self.received) if any(f.startswith(prefix) for f in d.fields)]

    def statuses(self) -> list[str]:
        return [
            f.removeprefix("STATUS=")
            for d in list(self.received)
            for f in d.fields
            if f.startswith("STATUS=")
        ]

    def wait_for(self, prefix: str, timeout: float = 20.0) -> Datagram:
        return wait_until(
            lambda: next(iter(self.with_field(prefix)), None), timeout, f"a datagram with {prefix}"
        )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def path_listener(tmp_path, monkeypatch):
    listener = NotifyListener(str(tmp_path / "notify.sock"))
    monkeypatch.setenv("NOTIFY_SOCKET", listener.name)
    yield listener
    listener.close()


@pytest.fixture
def abstract_listener(monkeypatch):
    listener = NotifyListener(f"@spotdrain-test-{uuid.uuid4().hex}")
    monkeypatch.setenv("NOTIFY_SOCKET", listener.name)
    yield listener
    listener.close()


def gaps(datagrams: list[Datagram]) -> list[float]:
    return [b.at - a.at for a, b in zip(datagrams, datagrams[1:], strict=False)]


# --- sd_notify -------------------------------------------------------------------------------


def test_notify_to_a_filesystem_path(path_listener):
    """A unit's $NOTIFY_SOCKET names a path: each call is one datagram, fields one a line."""
    assert systemd.notify("READY=1", "STATUS=up") is True
    assert systemd.ready("watching /run/spotdrain/notice.json") is True
    assert systemd.status("draining rcl-1:\nG in 12 s") is True
    assert systemd.watchdog() is True
    assert systemd.stopping() is True
    wait_until(lambda: len(path_listener.received) == 5, 5, "five datagrams")
    assert path_listener.datagrams() == [
        b"READY=1\nSTATUS=up",
        b"READY=1\nSTATUS=watching /run/spotdrain/notice.json",
        b"STATUS=draining rcl-1: G in 12 s",  # a newline in the text would start a field
        b"WATCHDOG=1",
        b"STOPPING=1",
    ]


def test_notify_to_an_abstract_name(abstract_listener):
    """`@name` is Linux's abstract namespace: the `@` stands for a leading NUL byte, and the
    name is not a file (the bug cloud-init once shipped)."""
    assert systemd.ready() is True
    assert systemd.status("ok") is True
    wait_until(lambda: len(abstract_listener.received) == 2, 5, "two datagrams")
    assert abstract_listener.datagrams() == [b"READY=1", b"STATUS=ok"]
    assert not Path(abstract_listener.name).exists()


@pytest.mark.parametrize("name", [None, "", "relative/notify.sock", "vsock:2:1234"])
def test_not_under_systemd_is_false_and_quiet(monkeypatch, name):
    """Run by hand or by a test harness: nothing to tell, nothing raised."""
    if name is None:
        monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    else:
        monkeypatch.setenv("NOTIFY_SOCKET", name)
    assert systemd.notify("READY=1") is False
    assert systemd.ready() is False
    assert systemd.watchdog() is False


def test_nobody_listening_is_false(tmp_path, monkeypatch):
    """systemd went away (or the name is stale): False, never an exception in the daemon."""
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    assert systemd.notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", f"@spotdrain-nobody-{uuid.uuid4().hex}")
    assert systemd.stopping() is False


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("30000000", "self", 30.0),
        ("500000", None, 0.5),
        ("30000000", "other", None),  # inherited from a parent: not ours
        ("0", "self", None),
        ("-5", None, None),
        ("soon", None, None),
        ("30000000", "nope", None),
        (None, None, None),
    ],
)
def test_watchdog_interval(monkeypatch, usec, pid, expected):
    for var, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            value = {"self": str(os.getpid()), "other": str(os.getpid() + 1)}.get(value, value)
            monkeypatch.setenv(var, value)
    assert systemd.watchdog_interval() == expected


async def test_watchdog_pings_at_half_the_interval_only_while_healthy(path_listener):
    """The supervisor pings every half interval; the moment its health check fails the pings
    stop, so systemd restarts the daemon after one whole interval."""
    healthy = True
    task = asyncio.create_task(systemd.keep_watchdog(lambda: healthy, interval_s=0.2))
    await asyncio.sleep(0.55)
    healthy = False
    stopped_at = time.monotonic()
    await asyncio.sleep(0.4)
    task.cancel()
    pings = path_listener.with_field("WATCHDOG=1")
    assert all(d.data == b"WATCHDOG=1" for d in pings)
    assert 4 <= len(pings) <= 7
    assert all(0.05 < g < 0.2 for g in gaps(pings))
    assert all(d.at <= stopped_at for d in pings)


async def test_no_watchdog_means_no_pings(path_listener, monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    await asyncio.wait_for(systemd.keep_watchdog(lambda: True), 1)
    assert path_listener.received == []


# --- the journal -----------------------------------------------------------------------------


class JournalListener:
    """What journald's end of /run/systemd/journal/socket sees: a datagram socket bound in a
    temporary directory. Each entry arrives as its payload, or as an empty datagram carrying
    one memfd (SCM_RIGHTS) for an entry too big for a datagram."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(2)

    def receive(self) -> tuple[bytes, int | None]:
        """The next entry's bytes, and the seals of the memfd it came in (None: inline)."""
        data, ancdata, _, _ = self.sock.recvmsg(1 << 20, socket.CMSG_SPACE(4))
        fds = [
            fd
            for level, kind, raw in ancdata
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
            for fd in array.array("i", raw)
        ]
        if not fds:
            return data, None
        assert data == b"" and len(fds) == 1, "an fd comes alone, with an empty payload"
        try:
            seals = fcntl.fcntl(fds[0], fcntl.F_GET_SEALS)
            # From offset 0, as journald maps it: the sender's writes left the shared offset
            # at the end.
            return os.pread(fds[0], os.fstat(fds[0]).st_size, 0), seals
        finally:
            os.close(fds[0])

    def entry(self) -> dict[str, str]:
        return parse_journal_entry(self.receive()[0])

    def close(self) -> None:
        self.sock.close()


def parse_journal_entry(data: bytes) -> dict[str, str]:
    """journald's side of the native protocol: `NAME=value\n`, or `NAME\n` followed by a
    64-bit little-endian length, that many bytes and `\n`."""
    fields: dict[str, str] = {}
    at = 0
    while at < len(data):
        eol = data.index(b"\n", at)
        line = data[at:eol]
        if b"=" in line:
            name, value = line.split(b"=", 1)
            at = eol + 1
        else:
            name = line
            (size,) = struct.unpack_from("<Q", data, eol + 1)
            value = data[eol + 9 : eol + 9 + size]
            assert data[eol + 9 + size : eol + 10 + size] == b"\n", "a value ends with a newline"
            at = eol + 10 + size
        assert re.fullmatch(rb"[A-Z0-9][A-Z0-9_]*", name), name  # journald would drop it
        fields[name.decode()] = value.decode()
    return fields


@pytest.fixture
def journal(tmp_path):
    listener = JournalListener(tmp_path / "journal.socket")
    handler = systemd.journald_handler("spotdrain-agent", socket_path=listener.path)
    assert isinstance(handler, systemd.JournalHandler)
    handler.addFilter(systemd.ContextFilter(node_id="node-a"))
    log = logging.getLogger(f"spotdrain.test.journal.{uuid.uuid4().hex}")
    log.propagate = False
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    yield log, listener
    log.removeHandler(handler)
    handler.close()
    listener.close()


def test_journal_entries_carry_node_and_reclamation_ids(journal):
    """Every agent log line reaches the journal with NODE_ID (the agent's own by default) and,
    for the lines about a reclamation, RECLAIM_ID; SYSLOG_IDENTIFIER names the daemon and
    PRIORITY is the syslog level. Sent over journald's native protocol to a real datagram
    socket, with no compiled binding, and parsed as journald parses it."""
    log, listener = journal
    log.info("plain line")
    log.info("node %s reclamation %s: notice %s", "node-a", "rcl-1", "i-0abc")
    log.warning("explicit", extra={"node_id": "node-b", "reclaim_id": "rcl-2"})
    log.debug("quiet")
    log.critical("loud")
    entries = [listener.entry() for _ in range(5)]
    assert [
        (
            e["MESSAGE"],
            e.get("NODE_ID"),
            e.get("RECLAIM_ID"),
            e["SYSLOG_IDENTIFIER"],
            e["PRIORITY"],
            e["LOGGER"],
        )
        for e in entries
    ] == [
        ("plain line", "node-a", None, "spotdrain-agent", "6", log.name),
        (
            "node node-a reclamation rcl-1: notice i-0abc",
            "node-a",
            "rcl-1",
            "spotdrain-agent",
            "6",
            log.name,
        ),
        ("explicit", "node-b", "rcl-2", "spotdrain-agent", "4", log.name),
        ("quiet", "node-a", None, "spotdrain-agent", "7", log.name),
        ("loud", "node-a", None, "spotdrain-agent", "2", log.name),
    ]
    second = entries[1]
    assert second["CODE_FILE"] == __file__
    assert second["CODE_FUNC"] == "test_journal_entries_carry_node_and_reclamation_ids"
    assert int(second["CODE_LINE"]) > 0
    assert second["CODE_ARGS"] == "('node-a', 'rcl-1', 'i-0abc')"
    assert {"THREAD_NAME", "PROCESS_NAME"} <= set(second)
    assert "CODE_ARGS" not in entries[0]


def test_multi_line_messages_and_tracebacks_arrive_whole(journal):
    """A log line's own newline (one a tenant put in a file name, say) is escaped, so it can
    never pass for a second line; a traceback keeps its lines, and a value with a newline
    would end its field early in the `NAME=value` form: it goes in the binary-safe form
    (name, length, bytes), so the traceback stays one entry and one field, and
    `journalctl -o verbose` shows it whole."""
    log, listener = journal
    log.error("first line\nsecond line = still the message")
    raw, seals = listener.receive()
    assert seals is None
    assert b"MESSAGE=first line\\x0asecond line = still the message\n" in raw
    try:
        raise ValueError("NVML said no")
    except ValueError:
        log.exception("observation failed")
    raw, _ = listener.receive()
    entry = parse_journal_entry(raw)
    text = entry["MESSAGE"].encode()
    assert b"MESSAGE\n" + struct.pack("<Q", len(text)) + text + b"\n" in raw
    assert entry["PRIORITY"] == "3"
    assert entry["MESSAGE"].startswith("observation failed\nTraceback (most recent call last):")
    assert entry["MESSAGE"].endswith("ValueError: NVML said no")
    assert entry["EXCEPTION_TEXT"].splitlines()[-1] == "ValueError: NVML said no"


def test_what_a_line_quotes_reaches_the_journal_escaped(journal):
    """A line quoting a tenant's report name (an ESC sequence that sets the terminal's title,
    BEL, a byte that is not UTF-8 as the file system hands it over) reaches the journal
    escaped: `journalctl` shows it as text, not as a blob, and no terminal acts on it."""
    log, listener = journal
    name = "\x1b]0;owned\x07" + os.fsdecode(b"\xff") + ".json"
    log.warning("status dir %s: %s ignored (%s)", "job-1", name, "not JSON")
    entry = listener.entry()
    assert entry["MESSAGE"] == "status dir job-1: \\x1b]0;owned\\x07\\xff.json ignored (not JSON)"


def test_an_entry_too_big_for_a_datagram_travels_in_a_sealed_memfd(journal):
    """4 MiB is past any datagram the kernel takes (EMSGSIZE): the entry goes in a memfd,
    sealed against change as journald requires, passed alone over the socket."""
    log, listener = journal
    big = "x" * (4 << 20)
    log.info("dump %s", big)
    raw, seals = listener.receive()
    assert seals is not None
    wanted = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
    assert seals & wanted == wanted
    assert parse_journal_entry(raw)["MESSAGE"] == "dump " + big
    log.info("small again")
    assert listener.receive()[1] is None


def test_journald_gone_sends_the_line_to_stderr(tmp_path, capsys):
    """journald restarting (its socket gone for a moment): the line is not lost and nothing
    raises into the daemon; it goes to stderr, the unit's journal stream under systemd."""
    handler = systemd.journald_handler("spotdrain-agent", socket_path=tmp_path / "gone.socket")
    assert handler is not None
    log = logging.getLogger(f"spotdrain.test.journal.{uuid.uuid4().hex}")
    log.propagate = False
    log.addHandler(handler)
    try:
        log.warning("node %s: still here", "node-a")
    finally:
        log.removeHandler(handler)
        handler.close()
    assert "WARNING node node-a: still here" in capsys.readouterr().err


def test_journald_handler_only_under_systemd(monkeypatch, tmp_path):
    """No journal to reach (run by hand, or journald's socket missing): no handler, so
    configure_logging falls back to plain text."""
    monkeypatch.setattr(systemd, "journal_reachable", lambda: False)
    assert systemd.journald_handler("spotdrain-agent") is None
    monkeypatch.setattr(systemd, "journal_reachable", lambda: True)
    monkeypatch.setattr(systemd, "JOURNAL_SOCKET", tmp_path / "journal.socket")
    handler = systemd.journald_handler("spotdrain-agent")
    assert isinstance(handler, systemd.JournalHandler)
    assert handler.socket_path == str(tmp_path / "journal.socket")
    handler.close()


def test_journal_reachable_only_when_stderr_is_the_journal(tmp_path, monkeypatch):
    """$JOURNAL_STREAM is inherited by children that log elsewhere (the test harness writes
    each daemon's stderr to a file even when CI runs under a unit): it counts only when it
    still names our stderr."""
    fake_socket = tmp_path / "journal.socket"
    fake_socket.touch()
    monkeypatch.setattr(systemd, "JOURNAL_SOCKET", fake_socket)
    st = os.fstat(2)
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    assert systemd.journal_reachable() is True
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino + 1}")
    assert systemd.journal_reachable() is False
    monkeypatch.delenv("JOURNAL_STREAM")
    assert systemd.journal_reachable() is False
    monkeypatch.setattr(systemd, "JOURNAL_SOCKET", tmp_path / "none")
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    assert systemd.journal_reachable() is False


def test_plain_text_on_stderr_when_not_under_systemd(monkeypatch):
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    try:
        handler = systemd.configure_logging("spotdrain-agent", "debug", node_id="node-a")
        assert type(handler) is logging.StreamHandler
        assert root.level == logging.DEBUG
    finally:
        root.handlers[:] = before
        root.setLevel(level)


# --- the daemons as real processes -----------------------------------------------------------


def test_coordinator_tells_systemd(tmp_path, monkeypatch):
    """The coordinator under a Type=notify unit with WatchdogSec=1: READY=1 (with its STATUS)
    once it serves, watchdog pings every half second, STOPPING=1 on SIGTERM, then exit 0."""
    listener = NotifyListener(f"@spotdrain-coord-{uuid.uuid4().hex}")
    monkeypatch.setenv("NOTIFY_SOCKET", listener.name)
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    coord = start_coordinator(tmp_path / "coordinator")
    try:
        ready = listener.wait_for("READY=1")
        assert "listening on" in coord.proc.log()
        assert ready.fields == [
            "READY=1",
            f"STATUS=serving on {coord.address}; 0 nodes connected; 0 workers",
        ]
        wait_until(lambda: len(listener.with_field("WATCHDOG=1")) >= 5, 10, "five pings")
        pings = listener.with_field("WATCHDOG=1")
        assert all(d.data == b"WATCHDOG=1" for d in pings)
        assert 0.3 < statistics.median(gaps(pings)) < 0.8
        coord.proc.signal(signal.SIGTERM)
        assert coord.proc.popen.wait(15) == 0
        stopping = listener.wait_for("STOPPING=1")
        assert stopping.data == b"STOPPING=1"
        assert listener.received.index(stopping) > listener.received.index(ready)
    finally:
        coord.proc.stop()
        listener.close()


@pytest.mark.docker
def test_agent_tells_systemd(
    tmp_path, monkeypatch, docker_engine, coordinator, gpus, nvml_lib, containers
):
    """The agent under a Type=notify unit with WatchdogSec=1, on a host whose NVML fails at
    first. It is watching notices at once but holds READY=1, with a STATUS saying it waits for
    NVML; when NVML answers, READY=1. A notice then shows up in STATUS as a drain with its
    countdown to G; the watchdog pings every half second throughout; SIGTERM gives
    STOPPING=1 and a clean exit."""
    node = "node-a"
    log_path = tmp_path / node / "agent.log"
    listener = NotifyListener(
        f"@spotdrain-agent-{uuid.uuid4().hex}",
        probe=lambda: log_path.exists() and "agent up" in log_path.read_text(errors="replace"),
    )
    monkeypatch.setenv("NOTIFY_SOCKET", listener.name)
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    gpus.fault("init_failed")
    stubborn = run_workload(
        docker_engine.client, name=containers + "stubborn", node_id=node, kind="ignores_term"
    )
    agent = start_agent(
        tmp_path,
        node,
        coordinator,
        docker_engine.host,
        gpus,
        nvml_lib,
        AgentOptions(grace_s=4.0, overrun_s=1.0),
    )
    try:
        waiting = wait_until(
            lambda: [s for s in listener.statuses() if s.startswith("starting: waiting for")],
            10,
            "a STATUS saying what the agent waits for",
        )
        assert "NVML" in waiting[0] and "Docker" not in waiting[0]
        # Another NVML failure (a lost GPU, not a missing driver): the same retry loop says so
        # in a new STATUS (sent only on a change), which comes after any wrong READY would
        # have. A barrier, not a sleep.
        gpus.faults.pop("init_failed")
        gpus.fault("gpu_lost")
        wait_until(
            lambda: [
                s
                for s in listener.statuses()
                if s.startswith("starting: waiting for NVML") and s != waiting[0]
            ],
            10,
            "a STATUS for the other NVML failure",
        )
        assert listener.with_field("READY=1") == []
        gpus.clear_faults()

        ready = listener.wait_for("READY=1", timeout=10)
        assert ready.probe is True  # "agent up" (the notice watcher) was logged before READY
        assert ready.fields[0] == "READY=1"
        assert ready.fields[1].startswith(f"STATUS=watching {agent.notice_file}; 0 workers; ")

        agent.write_notice({"id": "i-sd-1", "action": "terminate", "terminate_at": time.time() + 8})
        draining = wait_until(
            lambda: [s for s in listener.statuses() if s.startswith("draining ")],
            10,
            "a STATUS for the drain",
        )
        assert "(notice, draining): G in " in draining[0]
        assert f"watching {agent.notice_file}" in draining[0]
        coordinator.admin().wait_for("drained", node=node, timeout=30)
        stubborn.reload()
        assert stubborn.status == "exited"
        wait_until(
            lambda: listener.statuses()[-1].startswith("watching "),
            10,
            "STATUS back to watching after the drain",
        )

        pings = listener.with_field("WATCHDOG=1")
        assert len(pings) >= 10
        assert all(d.data == b"WATCHDOG=1" for d in pings)
        assert 0.3 < statistics.median(gaps(pings)) < 0.8
        assert max(gaps(pings)) < 1.0  # never a whole interval without a ping

        agent.proc.signal(signal.SIGTERM)
        assert agent.proc.popen.wait(15) == 0
        stopping = listener.wait_for("STOPPING=1")
        assert stopping.data == b"STOPPING=1"
        assert listener.received.index(stopping) > listener.received.index(ready)
    finally:
        agent.proc.stop()
        listener.close()


@pytest.mark.docker
def test_agent_without_a_watchdog_still_says_ready(
    tmp_path, monkeypatch, docker_engine, coordinator, gpus, nvml_lib
):
    """A Type=notify unit without WatchdogSec: the watchdog helper has nothing to do and
    returns at once. That is no reason to skip READY=1 (systemd would wait out its start
    timeout and kill the agent): READY still follows the notice watch, and SIGTERM is clean."""
    node = "node-nowd"
    listener = NotifyListener(f"@spotdrain-agent-{uuid.uuid4().hex}")
    monkeypatch.setenv("NOTIFY_SOCKET", listener.name)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    agent = start_agent(
        tmp_path, node, coordinator, docker_engine.host, gpus, nvml_lib, AgentOptions()
    )
    try:
        ready = listener.wait_for("READY=1", timeout=15)
        assert ready.fields[0] == "READY=1"
        assert listener.with_field("WATCHDOG=1") == []
        agent.proc.signal(signal.SIGTERM)
        assert agent.proc.popen.wait(15) == 0
        assert listener.wait_for("STOPPING=1").data == b"STOPPING=1"
    finally:
        agent.proc.stop()
        listener.close()
