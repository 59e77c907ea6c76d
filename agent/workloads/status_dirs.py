"""Workload status directories: one per container, under the agent's status root, bind-mounted
read-write into the container at $SPOTDRAIN_STATUS_DIR (docs/design.md "Workload status
directory"). The workload writes its checkpoint reports there (spotdrain.workload); the agent
watches the root and every container's directory through inotify, reads each report once,
hands it on, and removes it.

Everything in a status directory comes from the workload, so it is read as hostile input. A
file's type is known before it is opened for reading: only a regular file is ever opened (a
device node, a FIFO, a socket or a link to a host file is refused without being opened; some
devices act when opened), at most spotdrain.workload.MAX_REPORT_BYTES of it is read, and at most
INVALID_EVENTS_PER_CONTAINER malformed ones are reported per container. The rest are dropped
with a log line, at most IGNORED_LINES_PER_INTERVAL of them a container each
IGNORED_INTERVAL_S, then one line that counts the others.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotdrain.workload import MAX_REPORT_BYTES, Report, ReportInvalid, parse_report

log = logging.getLogger("spotdrain.agent.status")

# Where a container's status directory appears inside it.
CONTAINER_STATUS_DIR = "/run/spotdrain/status"
INVALID_EVENTS_PER_CONTAINER = 10
# Past those, the log's share of a container's junk: 50,000 files are a few lines, not 50,000.
IGNORED_LINES_PER_INTERVAL = 3
IGNORED_INTERVAL_S = 60.0
# A Docker container name: what a status directory may be called.
_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,127}$")

# (container name, the report) for a good one; (container name, None, file, why) for a bad one.
OnReport = Callable[[str, Report], None]
OnInvalid = Callable[[str, str, str], None]


class Refused(Exception):
    """A file that is not a regular file to read; str(): why, `info`: what fstat said of it
    (a link's own, for a link)."""

    def __init__(self, why: str, info: os.stat_result) -> None:
        super().__init__(why)
        self.info = info


def read_regular_file(path: Path, limit: int) -> bytes:
    """At most `limit` bytes of `path`, which must be a regular file and no link, checked
    before it is opened for reading. The name is opened O_PATH (no read, no device's open
    handler, no FIFO's reader) and its type taken from that handle; only a regular file is
    then opened for reading, through the handle itself (/proc/self/fd/N names that very
    inode, so a name swapped in between is never what gets opened) and without blocking (a
    lease). FileNotFoundError when the name is gone; Refused for what is not a report."""
    handle = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        known = os.fstat(handle)
        if stat.S_ISLNK(known.st_mode):
            raise Refused("a symbolic link", known)
        if not stat.S_ISREG(known.st_mode):
            raise Refused("not a regular file", known)
        # No O_NOFOLLOW here: /proc/self/fd/N is a link by design, resolved to the handle's
        # inode, never by name.
        fd = os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            opened = os.fstat(fd)
            if (opened.st_dev, opened.st_ino) != (known.st_dev, known.st_ino):
                raise Refused("changed while it was opened", opened)
            return os.read(fd, limit)
        finally:
            os.close(fd)
    finally:
        os.close(handle)


@dataclass
class _IgnoredLines:
    """A container's junk files in the log this interval: lines written, files left out."""

    since: float
    lines: int = 0
    left_out: int = 0


def make_status_dir(root: Path, name: str) -> Path:
    """The status directory of container `name` under `root`, made empty and writable by the
    workload (which may not run as root). Reports left by an earlier container of the same name
    are not this one's: removed unread."""
    if not _NAME.match(name):
        raise ValueError(f"not a container name: {name!r}")
    root.mkdir(parents=True, exist_ok=True)
    path = root / name
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    path.mkdir(exist_ok=True)
    for old in path.iterdir():
        if old.is_dir() and not old.is_symlink():
            continue  # a directory the workload made: never a report, left alone
        old.unlink(missing_ok=True)
    os.chmod(path, 0o777)
    return path


class StatusDirs:
    def __init__(
        self,
        root: Path,
        on_report: OnReport,
        on_invalid: OnInvalid,
        poll_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = root
        self.on_report = on_report
        self.on_invalid = on_invalid
        self.poll_s = poll_s
        self.clock = clock
        self._invalid_counts: dict[str, int] = {}
        self._ignored: dict[str, _IgnoredLines] = {}

    # --- reading -------------------------------------------------------------------------------

    def collect(self, name: str) -> int:
        """Read every report now in container `name`'s directory, oldest first; how many.
        Called on inotify events and before a container's exit is recorded, so a report
        written just before the exit is in the timeline before the exit is."""
        if not _NAME.match(name):
            return 0
        try:
            entries = sorted(e for e in os.listdir(self.root / name) if not e.startswith("."))
        except (FileNotFoundError, NotADirectoryError):
            return 0
        for entry in entries:
            self._read_one(name, entry)
        return len(entries)

    def collect_all(self) -> None:
        try:
            names = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return
        for name in names:
            self.collect(name)

    def _read_one(self, name: str, entry: str) -> None:
        path = self.root / name / entry
        try:
            raw = read_regular_file(path, MAX_REPORT_BYTES + 1)
        except FileNotFoundError:
            return  # read already (by a collect racing an inotify event)
        except Refused as e:
            self._invalid(name, entry, str(e), path)
            return
        except OSError as e:
            self._invalid(
                name, entry, f"unreadable ({e.strerror or errno.errorcode.get(e.errno)})", path
            )
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            return  # another reader took it first: it reports it, not us
        try:
            report = parse_report(raw)
        except ReportInvalid as e:
            self._invalid(name, entry, str(e), None)
            return
        self.on_report(name, report)

    def _invalid(self, name: str, entry: str, why: str, remove: Path | None) -> None:
        if remove is not None:
            try:
                if remove.is_dir() and not remove.is_symlink():
                    remove.rmdir()
                else:
                    remove.unlink()
            except OSError:
                pass
        count = self._invalid_counts.get(name, 0) + 1
        self._invalid_counts[name] = count
        if count > INVALID_EVENTS_PER_CONTAINER:
            self._log_ignored(name, entry, why)
            return
        self.on_invalid(name, entry[:200], why[:500])

    def _log_ignored(self, name: str, entry: str, why: str) -> None:
        now = self.clock()
        self.summarise_ignored(now)
        window = self._ignored.setdefault(name, _IgnoredLines(now))
        if window.lines >= IGNORED_LINES_PER_INTERVAL:
            window.left_out += 1
            return
        window.lines += 1
        log.warning(
            "status dir %s: %s ignored (%s); no more events for it", name, entry[:200], why[:500]
        )

    def summarise_ignored(self, now: float) -> None:
        """One line for each container whose interval has ended with files left out of the
        log, counting them; its next junk file starts a new interval."""
        for name, window in list(self._ignored.items()):
            if now - window.since < IGNORED_INTERVAL_S:
                continue
            del self._ignored[name]
            if window.left_out:
                log.warning(
                    "status dir %s: %d more files ignored in %.0f s, not logged one by one",
                    name,
                    window.left_out,
                    now - window.since,
                )

    # --- watching ------------------------------------------------------------------------------

    async def watch(self, ready: asyncio.Event | None = None) -> None:
        """Read reports as they land: inotify on the root (new container directories) and on
        each container's directory (MOVED_TO and CLOSE_WRITE: a report is complete). Without
        inotify, every `poll_s`."""
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            from asyncinotify import Inotify  # noqa: PLC0415
        except ImportError as e:  # pragma: no cover (a dependency of the package)
            log.warning("inotify unavailable for %s (%s); polling", self.root, e)
            inotify = None
        else:
            try:
                inotify = Inotify()
            except OSError as e:
                log.warning("inotify unavailable for %s (%s); polling", self.root, e)
                inotify = None
        if inotify is None:
            if ready is not None:
                ready.set()
            while True:
                self.collect_all()
                self.summarise_ignored(self.clock())
                await asyncio.sleep(self.poll_s)
        summaries = asyncio.create_task(self._summarise_every_interval())
        try:
            await self._watch_inotify(inotify, ready)
        finally:
            summaries.cancel()

    async def _summarise_every_interval(self) -> None:
        # A flood that stops still gets its count logged, without waiting for another file.
        while True:
            await asyncio.sleep(IGNORED_INTERVAL_S)
            self.summarise_ignored(self.clock())

    async def _watch_inotify(self, inotify: Any, ready: asyncio.Event | None) -> None:  # noqa: ANN401
        from asyncinotify import Mask  # noqa: PLC0415 (imported by watch() already)

        with inotify:
            dir_mask = Mask.CREATE | Mask.MOVED_TO | Mask.ONLYDIR
            file_mask = Mask.CLOSE_WRITE | Mask.MOVED_TO | Mask.ONLYDIR | Mask.DONT_FOLLOW
            inotify.add_watch(self.root, dir_mask)
            watched: dict[str, object] = {}

            def watch_dir(name: str) -> None:
                if name in watched or not _NAME.match(name):
                    return
                try:
                    watched[name] = inotify.add_watch(self.root / name, file_mask)
                except OSError:
                    return  # gone again, or not a directory
                self.collect(name)  # what landed before the watch was in place

            for name in sorted(os.listdir(self.root)):
                watch_dir(name)
            if ready is not None:
                ready.set()
            async for event in inotify:
                if Mask.IGNORED in event.mask and event.watch is not None:
                    # A container's directory went away: a new one of that name is watched anew.
                    if event.watch.path.parent == self.root:
                        watched.pop(event.watch.path.name, None)
                    continue
                if event.name is None or event.watch is None:
                    continue
                if event.watch.path == self.root:
                    if Mask.ISDIR in event.mask:
                        watch_dir(event.name.name)
                    continue
                parent = event.watch.path.name
                if parent in watched and not event.name.name.startswith("."):
                    self._read_one(parent, event.name.name)
