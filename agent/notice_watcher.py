"""Watch the provider's notice file: inotify on its directory, a slow poll only as a fallback.

The directory is watched rather than the file, because relays replace the file by rename (a new
inode each time). CLOSE_WRITE and MOVED_TO fire once a write is complete, so a relay that writes
in place is read after it closes the file, not halfway through.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from spotdrain.agent.notice import Notice, NoticeInvalid, parse_notice

log = logging.getLogger("spotdrain.agent.notice")

MAX_NOTICE_BYTES = 64 * 1024


def read_notice(path: Path) -> Notice | NoticeInvalid | None:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_NOTICE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        return NoticeInvalid(reason=f"cannot read {path}: {e.strerror}", content_hash="")
    if len(raw) > MAX_NOTICE_BYTES:
        return NoticeInvalid(reason=f"larger than {MAX_NOTICE_BYTES} bytes", content_hash="")
    return parse_notice(raw)


async def watch(
    path: Path, poll_s: float, ready: asyncio.Event | None = None
) -> AsyncIterator[Notice | NoticeInvalid]:
    """Yield each new parse of the notice file (the same bytes twice are yielded once).

    `ready` is set once the watch is in place: a notice written after that is never missed.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    last: Notice | NoticeInvalid | None = None

    def fresh() -> Notice | NoticeInvalid | None:
        nonlocal last
        result = read_notice(path)
        if result is None or result == last:
            return None
        last = result
        return result

    inotify = None
    try:
        from asyncinotify import Inotify, Mask  # noqa: PLC0415

        inotify = Inotify()
        # The watch goes in before the first read, so nothing falls between the two.
        inotify.add_watch(path.parent, Mask.CLOSE_WRITE | Mask.MOVED_TO | Mask.CREATE)
    except (OSError, ImportError) as e:
        log.warning("inotify unavailable for %s (%s); polling every %.1f s", path, e, poll_s)
    if ready is not None:
        ready.set()
    first = fresh()  # a notice written while the agent was down
    if first is not None:
        yield first
    if inotify is None:
        while True:
            await asyncio.sleep(poll_s)
            result = fresh()
            if result is not None:
                yield result
    with inotify:
        async for event in inotify:
            if event.name is None or event.name.name != path.name:
                continue
            result = fresh()
            if result is not None:
                yield result
