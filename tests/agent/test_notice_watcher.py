"""The notice watcher: inotify on the directory, a slow poll only when inotify is unavailable."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys

from asyncinotify import Inotify, Mask

from spotdrain.agent.core.notice import Notice, NoticeInvalid
from spotdrain.agent.notices.file_watcher import read_notice, watch


def write(path, doc) -> None:
    tmp = path.with_name(".tmp")
    tmp.write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    os.replace(tmp, path)


async def collect(path, poll_s: float, writes: list, settle: float = 0.3) -> list:
    ready = asyncio.Event()
    seen: list = []

    async def consume() -> None:
        async for item in watch(path, poll_s, ready):
            seen.append(item)

    task = asyncio.create_task(consume())
    await asyncio.wait_for(ready.wait(), 5)
    for doc in writes:
        write(path, doc)
        await asyncio.sleep(settle)
    task.cancel()
    return seen


async def test_inotify_sees_renames_and_skips_repeats(tmp_path):
    path = tmp_path / "run" / "notice.json"
    seen = await collect(
        path,
        poll_s=60,
        writes=[
            {"id": "a", "action": "terminate"},
            {"id": "a", "action": "terminate"},  # the same bytes again: one result
            b"garbage",
            {"id": "b", "action": "terminate"},
        ],
    )
    assert [type(s) for s in seen] == [Notice, NoticeInvalid, Notice]
    assert [s.notice_id for s in seen if isinstance(s, Notice)] == ["a", "b"]


async def test_a_notice_written_while_the_agent_was_down_is_read_at_start(tmp_path):
    path = tmp_path / "notice.json"
    write(path, {"id": "early", "action": "terminate"})
    seen = await collect(path, poll_s=60, writes=[])
    assert [s.notice_id for s in seen] == ["early"]


async def test_without_inotify_the_file_is_polled(tmp_path, monkeypatch):
    """A kernel without inotify (or a full watch table): the slow poll is the fallback."""
    monkeypatch.setitem(sys.modules, "asyncinotify", None)
    path = tmp_path / "notice.json"
    seen = await collect(path, poll_s=0.05, writes=[{"id": "p", "action": "terminate"}])
    assert [s.notice_id for s in seen] == ["p"]


class Watcher:
    """The watcher running in the background; `next()` is its next result."""

    def __init__(self, path, poll_s: float = 60) -> None:
        self.path = path
        self.ready = asyncio.Event()
        self.results: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.create_task(self._run(poll_s))

    async def _run(self, poll_s: float) -> None:
        async for item in watch(self.path, poll_s, self.ready):
            self.results.put_nowait(item)

    async def next(self, timeout: float = 5.0):
        return await asyncio.wait_for(self.results.get(), timeout)

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def test_a_fifo_at_the_notice_path_is_invalid_at_once_and_a_notice_over_it_is_read(
    tmp_path,
):
    """A FIFO nobody writes to would block a plain open forever: the watcher reports it and
    keeps listening, and the relay's notice renamed over it is answered."""
    path = tmp_path / "notice.json"
    os.mkfifo(path)
    watcher = Watcher(path)
    try:
        first = await watcher.next()
        assert isinstance(first, NoticeInvalid) and "is not a regular file (a FIFO)" in first.reason
        write(path, {"id": "after-fifo", "action": "terminate"})
        assert (await watcher.next()).notice_id == "after-fifo"
    finally:
        await watcher.close()


async def test_a_device_at_the_notice_path_is_invalid_without_being_opened(tmp_path):
    """A character device (/dev/null's numbers, made with mknod) where the notice file should
    be: reported invalid as what it is, and never opened (some devices act when opened):
    inotify on the directory sees no open of it up to a barrier opened after the read."""
    path = tmp_path / "notice.json"
    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    (tmp_path / ".barrier").write_text("")
    with Inotify() as inotify:
        inotify.add_watch(tmp_path, Mask.OPEN)
        result = read_notice(path)
        os.close(os.open(tmp_path / ".barrier", os.O_RDONLY))
        opened = []
        async with asyncio.timeout(5):
            async for event in inotify:
                if event.name is not None and event.name.name == ".barrier":
                    break
                if event.name is not None:
                    opened.append(event.name.name)
    assert isinstance(result, NoticeInvalid)
    assert "is not a regular file (a character device)" in result.reason
    assert opened == []


async def test_two_different_unreadable_inputs_are_two_reports(tmp_path):
    """A symlink to a device, then 70 kB of '[': both reported, with different keys."""
    path = tmp_path / "notice.json"
    watcher = Watcher(path)
    try:
        await asyncio.wait_for(watcher.ready.wait(), 5)
        link = tmp_path / ".link"
        link.symlink_to("/dev/zero")
        os.replace(link, path)
        first = await watcher.next()
        write(path, b"[" * 70_000)
        second = await watcher.next()
        assert "symbolic link" in first.reason and "larger than" in second.reason
        assert first.content_hash and second.content_hash
        assert first.content_hash != second.content_hash
    finally:
        await watcher.close()


async def test_the_notice_directory_removed_and_made_again_is_watched_again(tmp_path):
    path = tmp_path / "run" / "notice.json"
    watcher = Watcher(path)
    try:
        await asyncio.wait_for(watcher.ready.wait(), 5)
        watcher.ready.clear()
        os.rmdir(path.parent)
        await asyncio.wait_for(watcher.ready.wait(), 5)  # made again, watched again
        write(path, {"id": "after-rmdir", "action": "terminate"})
        assert (await watcher.next()).notice_id == "after-rmdir"
        # Moved away and replaced by a new directory (the operator's tidy-up): the same.
        watcher.ready.clear()
        os.rename(path.parent, tmp_path / "old-run")
        await asyncio.wait_for(watcher.ready.wait(), 5)
        write(path, {"id": "after-move", "action": "terminate"})
        assert (await watcher.next()).notice_id == "after-move"
    finally:
        await watcher.close()
