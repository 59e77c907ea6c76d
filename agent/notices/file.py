"""The notice file: what a relay (or an operator, or a test) writes to /run/spotdrain/notice.json.
Watched with inotify on its directory (agent/notices/file_watcher.py), a slow poll only as a
fallback.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotdrain.agent.notices.base import Health, Sink
from spotdrain.agent.notices.file_watcher import watch
from spotdrain.agent.notices.settings import check_keys, number
from spotdrain.runtime.cli import UsageError


@dataclass(frozen=True)
class Config:
    path: Path = Path("/run/spotdrain/notice.json")
    poll_s: float = 5.0  # only when inotify cannot watch the directory

    @classmethod
    def from_table(cls, table: dict[str, Any], where: str) -> Config:
        check_keys(table, {"path", "poll_s"}, where, "file")
        path = table.get("path", str(cls.path))
        if not isinstance(path, str | Path) or not str(path):
            raise UsageError(f"{where}sources.file.path must be a path, got {path!r}")
        poll = number(table.get("poll_s", cls.poll_s), f"{where}sources.file.poll_s", 0.05, 300)
        return cls(path=Path(path), poll_s=poll)


class Source:
    name = "file"

    def __init__(self, cfg: Config, sink: Sink, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.sink = sink
        self.health = Health(self.name, sink, clock)
        # Set once the watch is in place: a notice written after that is never missed.
        self.watching = asyncio.Event()

    async def run(self) -> None:
        async for parsed in watch(self.cfg.path, self.cfg.poll_s, self.watching):
            self.health.ok()
            self.sink.notice(parsed)
