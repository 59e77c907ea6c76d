"""systemd integration for both daemons: sd_notify and the journal. No dependency but the
standard library; systemd-python is used for the journal when it is installed.

sd_notify (sd_notify(3)): one datagram of newline-separated `KEY=value` fields to the
AF_UNIX socket named by $NOTIFY_SOCKET. The name is a filesystem path, or an abstract name
written with a leading `@` that stands for the NUL byte of Linux's abstract namespace (the case
cloud-init once got wrong). Not under systemd means no $NOTIFY_SOCKET: every call returns
False and does nothing, so the daemons call these helpers unconditionally.

Journal: under systemd, `configure_logging` sends structured entries through systemd-python's
`JournalHandler`, with NODE_ID and RECLAIM_ID fields (see `ContextFilter`); otherwise plain
text to stderr, as before.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
import sys
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("spotdrain.systemd")

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


class ContextFilter(logging.Filter):
    """Gives every record the journal fields NODE_ID and RECLAIM_ID.

    systemd-python's JournalHandler.emit passes the whole `record.__dict__` to journal.send
    as fields, unchanged, and journald keeps only valid field names (upper case, digits,
    `_`); so `extra={"node_id": ...}` alone would be dropped, and this filter copies it to
    NODE_ID (likewise reclaim_id). Where a record has no node_id, the daemon's own
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


def journald_handler(
    identifier: str, *, sender: Callable[..., None] | None = None
) -> logging.Handler | None:
    """A handler writing structured entries to journald, or None when not running under
    systemd with the journal reachable, or systemd-python is not installed. `sender`
    replaces journal.send (tests), and skips the reachability check."""
    if sender is None and not journal_reachable():
        return None
    try:
        from systemd.journal import JournalHandler  # noqa: PLC0415 (optional at run time)
    except ImportError:
        return None
    kwargs = {} if sender is None else {"sender_function": sender}
    return JournalHandler(SYSLOG_IDENTIFIER=identifier, **kwargs)


def configure_logging(program: str, level: str, node_id: str = "") -> logging.Handler:
    """Root logging for a daemon: the journal under systemd (falling back to stderr when it
    cannot be used), plain text on stderr otherwise. Returns the handler installed."""
    handler = journald_handler(program)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    handler.addFilter(ContextFilter(node_id=node_id))
    root = logging.getLogger()
    root.setLevel(level.upper())
    root.addHandler(handler)
    return handler
