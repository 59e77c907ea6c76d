"""The agent's side of every notice source: one `Sink` for all of them.

Notices go to the drain runner, which keeps the one persisted filter (a reclamation per notice
key, bundles on disk), so a notice seen by two reads, two sources or two agent lifetimes is one
reclamation. Advisories go through the advisory book (agent/core/advisories.py), saved in the state
directory. Health changes become `notice_source_down` / `notice_source_up` events, a metric, and
a line in `spotctl status` and the unit's STATUS.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spotdrain.agent.core.advisories import AdvisoryBook, Drain, Record
from spotdrain.agent.core.notice import Notice, NoticeInvalid
from spotdrain.agent.core.reclamation import reclaim_id_for
from spotdrain.agent.drain.runner import DrainRunner
from spotdrain.agent.drain.state import write_json
from spotdrain.agent.notices import module as source_module
from spotdrain.agent.notices.base import Advisory, Health, NoticeSource
from spotdrain.agent.notices.identity import CloudIdentity
from spotdrain.agent.notices.settings import AdvisoryPolicy

log = logging.getLogger("spotdrain.agent.notices")
# How often a settled reclamation's outbox is looked at until it is empty (bounded by O).
DELIVERY_CHECK_S = 0.02


class SourceHub:
    def __init__(
        self,
        node_id: str,
        drains: DrainRunner,
        policy: AdvisoryPolicy,
        state_dir: Path,
        clock: Callable[[], float] = time.time,
        undelivered: Callable[[], int] = lambda: 0,
    ) -> None:
        self.node_id = node_id
        self.drains = drains
        self._undelivered = undelivered
        self.clock = clock
        self._book_path = state_dir / "advisories.json"
        self.book = AdvisoryBook(policy, self._load_book())
        self.sources: dict[str, NoticeSource] = {}
        self._wake = asyncio.Event()
        # The node's cloud instance once a source has read it; `identified` is set on each new
        # one, for the agent to register again with it.
        self.cloud: CloudIdentity | None = None
        self.identified = asyncio.Event()

    def build(self, configs: dict[str, Any]) -> None:
        """One Source per configured source, in the order given."""
        for name, cfg in configs.items():
            self.sources[name] = source_module(name).Source(cfg, self, self.clock)

    # --- the Sink ----------------------------------------------------------------------------

    def notice(self, parsed: Notice | NoticeInvalid) -> None:
        self.drains.notice(parsed)

    def advisory(self, advisory: Advisory) -> None:
        self._carry_out(self.book.handle(advisory, self.clock()))

    def record(self, source: str, kind: str, details: dict[str, Any]) -> None:
        self.drains.record(kind, {"source": source, **details})

    def health_changed(self, health: Health) -> None:
        if health.up:
            down_s = self.clock() - health.down_since if health.down_since else 0.0
            log.info("node %s: notice source %s is back", self.node_id, health.source)
            self.drains.record(
                "notice_source_up", {"source": health.source, "down_s": round(down_s, 3)}
            )
        else:
            log.warning(
                "node %s: notice source %s is down: %s", self.node_id, health.source, health.error
            )
            self.drains.record(
                "notice_source_down",
                {"source": health.source, "error": health.error, "failures": health.failures},
            )

    def identity(self, identity: CloudIdentity) -> None:
        if identity != self.cloud:
            self.cloud = identity
            self.identified.set()

    async def settled(self, key: str) -> str:
        """The reclamation's outcome, once its events have also reached the coordinator (or
        its O has come): a source that lets the host go down at this point (logind's lock)
        must not take the last events with it."""
        outcome = await self.drains.settled(key)
        rid = reclaim_id_for(self.node_id, key)
        rec = self.drains.live.get(rid) or self.drains.recent.get(rid)
        until = rec.overrun_at if rec is not None else self.clock()
        # A short bounded look (at most until O) rather than a signal: the outbox is SQLite
        # written from several places, and this runs once per host shutdown.
        while self._undelivered() and self.clock() < until:  # noqa: ASYNC110
            await asyncio.sleep(DELIVERY_CHECK_S)
        return outcome

    # --- what the agent shows ----------------------------------------------------------------

    def status(self) -> list[dict[str, Any]]:
        return [s.health.describe() for s in self.sources.values()]

    def broken(self) -> list[str]:
        return [f"{s.name} ({s.health.error})" for s in self.sources.values() if not s.health.up]

    def at_risk(self) -> list[dict[str, Any]]:
        return [
            {"key": e.key, "source": e.source, "reason": e.reason, "expires_at": e.expires_at}
            for e in self.book.active()
        ]

    # --- the advisory timer ------------------------------------------------------------------

    async def keep_advisories(self) -> None:
        """Lift advisories at their expiry; sleeps until the earliest one."""
        while True:
            due = self.book.next_expiry()
            timeout = None if due is None else max(0.0, due - self.clock())
            try:
                async with asyncio.timeout(timeout):  # (wait_for can swallow a cancel)
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            self._carry_out(self.book.handle(None, self.clock()))

    def _carry_out(self, commands: list[Record | Drain]) -> None:
        if not commands:
            return
        for cmd in commands:
            match cmd:
                case Record(kind, details):
                    log.info("node %s: %s %s", self.node_id, kind, details)
                    self.drains.record(kind, details)
                case Drain(notice):
                    self.drains.notice(notice)
                case _:
                    raise TypeError(cmd)
        try:
            write_json(self._book_path, self.book.saved(), mode=0o600)
        except OSError as e:
            # A full disk stops nothing (agent/drain/state.py): the book is in memory, and the next
            # change writes it whole again.
            self.drains.health.failed(self._book_path, e)
        else:
            self.drains.health.wrote(self._book_path)
        self._wake.set()

    def _load_book(self) -> dict[str, dict[str, Any]]:
        try:
            doc = json.loads(self._book_path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning(
                "node %s: %s unreadable (%s); starting a new one", self.node_id, self._book_path, e
            )
            return {}
        return doc if isinstance(doc, dict) else {}
