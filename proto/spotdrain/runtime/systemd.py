"""systemd integration for both daemons: sd_notify and the journal. No dependency but the
standard library: both speak systemd's datagram protocols themselves, so a pip install needs
no libsystemd headers and no compiler.

sd_notify (sd_notify(3)): one datagram of newline-separated `KEY=value` fields to the
AF_UNIX socket named by $NOTIFY_SOCKET. The name is a filesystem path, or an abstract name
written with a leading `@` that stands for the NUL byte of Linux's abstract namespace (the case
cloud-init once got wrong). Not under systemd means no $NOTIFY_SOCKET: every call returns
False and does nothing, so the daemons call these helpers unconditionally.

Journal: under systemd, `configure_logging` sends structured entries with `JournalHandler`,
which speaks journald's native protocol (https://systemd.io/JOURNAL_NATIVE_PROTOCOL/): one
datagram an entry to /run/systemd/journal/socket, with NODE_ID and RECLAIM_ID fields (see
`ContextFilter`); otherwise plain text to stderr.
"""

from __future__ import annotations

import array
import asyncio
import errno
import fcntl
import logging
import os
import re
import socket
import stat
import struct
import sys
from collections.abc import Callable
from pathlib import Path

from spotdrain.runtime.printable import printable

log = logging.getLogger("spotdrain.runtime.systemd")

JOURNAL_SOCKET = Path("/run/systemd/journal/socket")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"

# --- sd_notify -------------------------------------------------------------------------------


def notify(*fields: str) -> bool:
    """Send `fields` ("READY=1", "STATUS=...") as one datagram to $NOTIFY_SOCKET.

    True when the datagram was sent. False when not under systemd (no or an unsupported
    socket name) or when the send failed: a notification is never worth crashing for.
    """
    name = os.environ.get("NOTIFY_SOCKET", "")
    if name.startswith("@"):
        address = "\0" + name[1:]  # Linux abstract namespace
    elif name.startswith("/"):
        address = name
    else:  # unset, or a form we do not speak (vsock:...)
        return False
    payload = "\n".join(fields).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(payload)
    except OSError as e:
        log.debug("sd_notify to %s failed: %s", name, e)
        return False
    return True


def ready(status_text: str = "") -> bool:
    fields = ["READY=1"]
    if status_text:
        fields.append(_status_field(status_text))
    return notify(*fields)


def status(text: str) -> bool:
    return notify(_status_field(text))


def stopping() -> bool:
    return notify("STOPPING=1")


def watchdog() -> bool:
    return notify("WATCHDOG=1")


def _status_field(text: str) -> str:
    # One field a line: a newline inside the text would start a bogus field.
    return "STATUS=" + " ".join(text.splitlines())


def watchdog_interval() -> float | None:
    """The watchdog timeout in seconds ($WATCHDOG_USEC), or None when there is no watchdog
    for this process: unset, malformed or not positive, or $WATCHDOG_PID names another
    process (the variables were inherited from a parent)."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    try:
        interval = int(usec)
        if pid and int(pid) != os.getpid():
            return None
    except ValueError:
        return None
    return interval / 1e6 if interval > 0 else None


async def keep_watchdog(healthy: Callable[[], bool], interval_s: float | None = None) -> None:
    """Send WATCHDOG=1 every half interval while `healthy()` says so; return at once when
    there is no watchdog. A blocked event loop sends nothing either, which is the point."""
    interval = watchdog_interval() if interval_s is None else interval_s
    if interval is None:
        return
    while True:
        if healthy():
            watchdog()
        else:
            log.warning("supervisor unhealthy: withholding the systemd watchdog ping")
        await asyncio.sleep(interval / 2)


async def keep_status(
    describe: Callable[[], str], every_s: float = 2.0, last: str | None = None
) -> None:
    """Send STATUS= whenever `describe()` changes (from `last`, the text already sent),
    checked every `every_s`."""
    while True:
        text = describe()
        if text != last:
            status(text)
            last = text
        await asyncio.sleep(every_s)


# --- the journal -----------------------------------------------------------------------------


class PrintableFormatter(logging.Formatter):
    """Every daemon's log line with what it quotes escaped (spotdrain.runtime.printable): a report's
    file name, a container's name, what a job wrote may hold ESC sequences, a newline that
    would start a forged line, or bytes that are not UTF-8. The traceback that may follow the
    line is the daemon's own and keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        return printable(super().formatMessage(record))


class ContextFilter(logging.Filter):
    """Gives every record the journal fields NODE_ID and RECLAIM_ID.

    `JournalHandler` sends a record's attributes whose names are valid journal field names
    (upper case, digits, `_`) as fields; so `extra={"node_id": ...}` alone would not be sent,
    and this filter copies it to NODE_ID (likewise reclaim_id). Where a record has no
    node_id, the daemon's own
    (`ContextFilter(node_id=...)`) is used. The agent's log lines follow the pattern
    "node %s reclamation %s: ...", and their arguments fill the fields when no extra does.
    Attached to the handler, so it sees records from every logger.
    """

    def __init__(self, node_id: str = "") -> None:
        super().__init__()
        self.node_id = node_id

    def filter(self, record: logging.LogRecord) -> bool:
        node_id = getattr(record, "node_id", "") or ""
        reclaim_id = getattr(record, "reclaim_id", "") or ""
        args = record.args if isinstance(record.args, tuple) else ()
        if isinstance(record.msg, str) and record.msg.startswith("node %s") and args:
            node_id = node_id or str(args[0])
            if record.msg.startswith("node %s reclamation %s") and len(args) > 1:
                reclaim_id = reclaim_id or str(args[1])
        node_id = node_id or self.node_id
        if node_id:
            record.NODE_ID = node_id
        if reclaim_id:
            record.RECLAIM_ID = reclaim_id
        return True


def journal_reachable() -> bool:
    """Whether this process runs under systemd with its log meant for the journal.

    $JOURNAL_STREAM (device:inode) is set by systemd when stdout/stderr go to the journal, and
    inherited by children that may have redirected stderr elsewhere (a test harness writing a
    log file from a CI runner's unit): so it counts only when it still names our stderr, as
    systemd.exec(5) advises. Without it, $INVOCATION_ID (set for every unit's processes) counts
    only when stderr goes nowhere useful (closed, /dev/null, a tty): a unit with
    StandardError=file: or a pipe keeps the plain text its operator asked for.
    """
    if not JOURNAL_SOCKET.exists():
        return False
    try:
        st = os.fstat(2)
    except OSError:
        st = None
    stream = os.environ.get("JOURNAL_STREAM", "")
    if stream:
        return st is not None and stream == f"{st.st_dev}:{st.st_ino}"
    if not os.environ.get("INVOCATION_ID"):
        return False
    return st is None or stat.S_ISCHR(st.st_mode)


# journald's native protocol: an entry is a run of fields, each `NAME=value\n`, or, for a value
# that holds a newline (a traceback, a multi-line message), `NAME\n`, the value's length as a
# 64-bit little-endian integer, the value and `\n`. Names: upper case, digits and `_`, not
# starting with `_` (those are the fields journald itself vouches for), at most 64 characters.
_FIELD_NAME = re.compile(r"[A-Z0-9][A-Z0-9_]{0,63}")
# syslog(3) levels, as systemd-python's JournalHandler maps them.
_PRIORITIES = (
    (logging.CRITICAL, 2),
    (logging.ERROR, 3),
    (logging.WARNING, 4),
    (logging.INFO, 6),
)
_DEBUG_PRIORITY = 7


def journal_field(name: str, value: object) -> bytes:
    """One field of a native journal entry, in the binary-safe form when the value needs it."""
    data = value if isinstance(value, bytes) else str(value).encode("utf-8", "replace")
    key = name.encode("ascii")
    if b"\n" in data:
        return key + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
    return key + b"=" + data + b"\n"


def syslog_priority(levelno: int) -> int:
    return next((p for level, p in _PRIORITIES if levelno >= level), _DEBUG_PRIORITY)


class JournalHandler(logging.Handler):
    """Structured log entries to journald over its native datagram protocol, standard library
    only (the compiled systemd-python binding needs libsystemd's headers and a compiler).

    Each record is one entry: MESSAGE (the formatted record, traceback included), PRIORITY,
    SYSLOG_IDENTIFIER, LOGGER, THREAD_NAME, PROCESS_NAME, CODE_FILE, CODE_LINE, CODE_FUNC,
    CODE_ARGS and EXCEPTION_TEXT where there are any, and every attribute of the record whose
    name is a valid field name (NODE_ID and RECLAIM_ID from `ContextFilter`, a MESSAGE_ID given
    through `extra=`). The socket is unconnected and non-blocking: a journald that is
    restarting or behind never holds up a drain; the line goes to stderr instead, which under
    systemd is the unit's journal stream. An entry too big for one datagram travels in a
    sealed memfd, as the protocol provides.
    """

    def __init__(self, identifier: str, socket_path: Path | str = JOURNAL_SOCKET) -> None:
        super().__init__()
        self.identifier = identifier
        self.socket_path = str(socket_path)
        self._sock = socket.socket(
            socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
        )
        self.setFormatter(PrintableFormatter())
        self._fallback = logging.StreamHandler(sys.stderr)
        self._fallback.setFormatter(PrintableFormatter(TEXT_FORMAT))

    def entry(self, record: logging.LogRecord) -> bytes:
        """The datagram's payload for `record`."""
        fields: dict[str, object] = {
            "MESSAGE": self.format(record),
            "PRIORITY": syslog_priority(record.levelno),
            "SYSLOG_IDENTIFIER": self.identifier,
            "LOGGER": record.name,
            "THREAD_NAME": record.threadName,
            "PROCESS_NAME": record.processName,
            "CODE_FILE": record.pathname,
            "CODE_LINE": record.lineno,
            "CODE_FUNC": record.funcName,
        }
        if record.args:
            fields["CODE_ARGS"] = str(record.args)
        if record.exc_text:  # set by format() when there is exc_info
            fields["EXCEPTION_TEXT"] = record.exc_text
        for name, value in vars(record).items():
            if _FIELD_NAME.fullmatch(name) and value is not None:
                fields[name] = value
        return b"".join(journal_field(name, value) for name, value in fields.items())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            payload = self.entry(record)
        except Exception:  # a log line must never raise into the daemon
            self.handleError(record)
            return
        try:
            self._send(payload)
        except OSError:
            self._fallback.handle(record)

    def _send(self, payload: bytes) -> None:
        try:
            self._sock.sendto(payload, self.socket_path)
        except OSError as e:
            if e.errno != errno.EMSGSIZE:
                raise
            self._send_memfd(payload)

    def _send_memfd(self, payload: bytes) -> None:
        # Too big for a datagram: the entry goes in a memfd, sealed so journald can trust that
        # it no longer changes, passed alone (empty payload) with SCM_RIGHTS.
        fd = os.memfd_create("spotdrain-journal", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.write(fd, payload)
            fcntl.fcntl(
                fd,
                fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL,
            )
            self._sock.sendmsg(
                [],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))],
                0,
                self.socket_path,
            )
        finally:
            os.close(fd)

    def close(self) -> None:
        self._sock.close()
        super().close()


def journald_handler(
    identifier: str, *, socket_path: Path | str | None = None
) -> JournalHandler | None:
    """A handler writing structured entries to journald, or None when not running under
    systemd with the journal reachable. `socket_path` replaces journald's socket (tests), and
    skips the reachability check."""
    if socket_path is None:
        if not journal_reachable():
            return None
        socket_path = JOURNAL_SOCKET
    return JournalHandler(identifier, socket_path)


def configure_logging(program: str, level: str, node_id: str = "") -> logging.Handler:
    """Root logging for a daemon: the journal under systemd (falling back to stderr when it
    cannot be used), plain text on stderr otherwise. Returns the handler installed."""
    handler = journald_handler(program)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(PrintableFormatter(TEXT_FORMAT))
    handler.addFilter(ContextFilter(node_id=node_id))
    root = logging.getLogger()
    root.setLevel(level.upper())
    root.addHandler(handler)
    return handler
