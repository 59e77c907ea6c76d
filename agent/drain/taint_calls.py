"""The node's taint calls to the coordinator, each reporting back as an event for its
reclamation: the first call with its 800 ms answer deadline, the background retry after a local
taint, and the lift once a cancel or a resume ends the drain."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from spotdrain.agent.core.reclamation import Reclamation
from spotdrain.agent.core.reclamation_events import (
    Event,
    TaintAnswered,
    TaintsLifted,
    TaintUnanswered,
)
from spotdrain.agent.drain.link import CoordinatorLink, TaintError

Spawn = Callable[[Coroutine[Any, Any, None]], "asyncio.Task[None]"]


class TaintCalls:
    def __init__(
        self,
        link: CoordinatorLink,
        feed: Callable[[str, Event], None],
        spawn: Spawn,
        clock: Callable[[], float],
        rounds_lock: asyncio.Lock,
    ) -> None:
        self.link = link
        self._feed = feed
        self._spawn = spawn
        self._clock = clock
        # The signal rounds' lock: a retry waits for the round its step started.
        self._rounds_lock = rounds_lock
        self._calls: dict[str, asyncio.Task[None]] = {}
        self._retries: dict[str, asyncio.Task[None]] = {}

    def request(self, rec: Reclamation, answer_by: float) -> None:
        self._calls[rec.reclaim_id] = self._spawn(self._request(rec, answer_by))

    def retry(self, rec: Reclamation) -> None:
        running = self._retries.get(rec.reclaim_id)
        if running is None or running.done():
            self._retries[rec.reclaim_id] = self._spawn(self._retry(rec))

    def lift(self, rec: Reclamation) -> None:
        self._spawn(self._lift(rec))

    async def _request(self, rec: Reclamation, answer_by: float) -> None:
        if rec.lifted:
            return
        try:
            await self.link.taint(
                rec.reclaim_id,
                rec.reason,
                timeout=answer_by - self._clock(),
                terminate_at=rec.terminate_at,
                grace_deadline=rec.grace_deadline,
            )
        except TaintError as e:
            self._feed(rec.reclaim_id, TaintUnanswered(self._clock(), str(e)))
            return
        self._feed(rec.reclaim_id, TaintAnswered(self._clock()))

    async def _lift(self, rec: Reclamation) -> None:
        # A background retry of the taint must stop, or it could land after the lift and taint
        # (for a pause: disable) the node again; a Taint call still in flight (a frozen
        # coordinator) likewise: let it finish first, then lift.
        retry = self._retries.pop(rec.reclaim_id, None)
        if retry is not None:
            retry.cancel()
        pending = self._calls.pop(rec.reclaim_id, None)
        if pending is not None:
            await asyncio.gather(pending, return_exceptions=True)
        if rec.reason == "pause":
            await self.link.resume_until_answered(rec.reclaim_id)
        else:
            await self.link.taint_until_answered(rec.reclaim_id, rec.reason, remove=True)
        self._feed(rec.reclaim_id, TaintsLifted(self._clock()))

    async def _retry(self, rec: Reclamation) -> None:
        # After the SIGTERMs the same step asked for: the coordinator has had its 800 ms, and a
        # call started beside the kill calls competes with them for the loop and the GIL.
        await asyncio.sleep(0)  # the round spawned in the same step takes the lock first
        async with self._rounds_lock:
            pass
        await self.link.taint_until_answered(
            rec.reclaim_id,
            rec.reason,
            terminate_at=rec.terminate_at,
            grace_deadline=rec.grace_deadline,
        )
        self._feed(rec.reclaim_id, TaintAnswered(self._clock()))
