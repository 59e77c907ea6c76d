"""Watch the provider's notice file: inotify on its directory, a slow poll only as a fallback.

The directory is watched rather than the file, because relays replace the file by rename (a new
inode each time). CLOSE_WRITE and MOVED_TO fire once a write is complete, so a relay that writes
in place is read after it closes the file, not halfway through.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

from spotdrain.agent.core.notice import Notice, NoticeInvalid, content_hash, parse_notice
from spotdrain.agent.workloads.status_dirs import Refused, read_regular_file

log = logging.getLogger("spotdrain.agent.core.notice")

MAX_NOTICE_BYTES = 64 * 1024


def read_notice(path: Path) -> Notice | NoticeInvalid | None:
    """The file's parse. Only a regular file is read: its type is known before it is opened
    for reading (status_dirs.read_regular_file), so a FIFO, a device or a link at the notice
    path is a `NoticeInvalid` at once, never a read that never ends or a device's open."""
    try:
        raw = read_regular_file(path, MAX_NOTICE_BYTES + 1)
    except FileNotFoundError:
        return None
    except Refused as e:
        if stat.S_ISLNK(e.info.st_mode):
            return _unreadable(path, f"cannot read {path}: a symbolic link", None)
        return _unreadable(path, f"{path} is not a regular file ({_kind(e.info.st_mode)})", e.info)
    except OSError as e:
        return _unreadable(path, f"cannot read {path}: {e.strerror}", None)
    if len(raw) > MAX_NOTICE_BYTES:
        return NoticeInvalid(
            reason=f"larger than {MAX_NOTICE_BYTES} bytes", content_hash=content_hash(raw)
        )
    return parse_notice(raw)


def _unreadable(path: Path, reason: str, info: os.stat_result | None) -> NoticeInvalid:
    """Nothing to hash but what it is: the reason and, when known, which inode and when it
    changed, so two different bad inputs are two reports and the same one stays one."""
    stamp = f"{info.st_ino}:{info.st_mtime_ns}:{info.st_mode}" if info is not None else ""
    return NoticeInvalid(reason=reason, content_hash=content_hash(f"{reason}\0{stamp}".encode()))


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a file"


async def watch(
    path: Path, poll_s: float, ready: asyncio.Event | None = None
) -> AsyncIterator[Notice | NoticeInvalid]:
    """Yield each new parse of the notice file (the same bytes twice are yielded once).

    `ready` is set once the watch is in place: a notice written after that is never missed.
    The directory deleted, moved away or made again: it is made again if missing and watched
    anew, and the file read once, so the agent never goes deaf.
    """
    last: Notice | NoticeInvalid | None = None

    def fresh() -> Notice | NoticeInvalid | None:
        nonlocal last
        result = read_notice(path)
        if result is None or result == last:
            return None
        last = result
        return result

    try:
        from asyncinotify import Inotify, Mask  # noqa: PLC0415
    except ImportError as e:
        Inotify = None  # noqa: N806
        log.warning("inotify unavailable for %s (%s); polling every %.1f s", path, e, poll_s)
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        inotify = None
        if Inotify is not None:
            try:
                inotify = Inotify()
                # The watch goes in before the first read, so nothing falls between the two.
                inotify.add_watch(
                    path.parent,
                    Mask.CLOSE_WRITE
                    | Mask.MOVED_TO
                    | Mask.CREATE
                    | Mask.DELETE_SELF
                    | Mask.MOVE_SELF,
                )
            except OSError as e:
                if inotify is not None:
                    inotify.close()
                inotify = None
                log.warning(
                    "inotify cannot watch %s (%s); polling every %.1f s", path.parent, e, poll_s
                )
        if ready is not None:
            ready.set()
        first = fresh()  # a notice written while the agent was down, or while the watch was off
        if first is not None:
            yield first
        if inotify is None:
            while True:
                await asyncio.sleep(poll_s)
                if not path.parent.is_dir():
                    path.parent.mkdir(parents=True, exist_ok=True)
                result = fresh()
                if result is not None:
                    yield result
        with inotify:
            async for event in inotify:
                if event.mask & (Mask.DELETE_SELF | Mask.MOVE_SELF | Mask.IGNORED):
                    log.warning("%s was removed or moved: watching it again", path.parent)
                    break
                if event.name is None or event.name.name != path.name:
                    continue
                result = fresh()
                if result is not None:
                    yield result
