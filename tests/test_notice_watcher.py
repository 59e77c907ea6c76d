"""The notice watcher: inotify on the directory, a slow poll only when inotify is unavailable."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from spotdrain.agent.notice import Notice, NoticeInvalid
from spotdrain.agent.notice_watcher import watch


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
    seen = await collect(path, poll_s=60, writes=[
        {"id": "a", "action": "terminate"},
        {"id": "a", "action": "terminate"},  # the same bytes again: one result
        b"garbage",
        {"id": "b", "action": "terminate"},
    ])
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
