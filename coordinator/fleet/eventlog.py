"""The lifecycle event log: what the coordinator witnesses itself, and what agents send.

Every event is stored (an agent's batch in one transaction) before it is acknowledged or
announced; watchers (WatchEvents, the metrics) learn of new ones without polling the store.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from spotdrain.coordinator.store import NewEvent, Store

log = logging.getLogger("spotdrain.coordinator.events")


class EventLog:
    def __init__(
        self,
        store: Store,
        clock: Callable[[], float],
        observe: Callable[[NewEvent], None] | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self._observe = observe or (lambda ev: None)
        self._new_event = asyncio.Condition()
        self._soon: list[tuple[float, str, str, dict[str, Any], str]] = []
        self._recorder: asyncio.Task[None] | None = None
        # What an agent's event sets in motion, by kind (an advisory: replacements elsewhere).
        self._reactions: dict[str, Callable[[NewEvent], Awaitable[None]]] = {}

    def react(self, reactions: dict[str, Callable[[NewEvent], Awaitable[None]]]) -> None:
        self._reactions.update(reactions)

    async def record(
        self, kind: str, node_id: str, details: dict[str, Any], reclaim_id: str = ""
    ) -> None:
        """An event the coordinator itself witnessed; in its reclamation's timeline when it
        belongs to one (then with its offset from T0, once the agent's T0 is known)."""
        now = self.clock()
        record = await self.store.reclamation(reclaim_id) if reclaim_id else None
        t0 = record["t0"] if record else 0.0
        event = NewEvent(
            uid=f"coordinator-{uuid.uuid4()}",
            kind=kind,
            node_id=node_id,
            reclaim_id=reclaim_id,
            wall_time=now,
            t_offset_s=now - t0 if t0 else None,
            details=details,
        )
        await self.store.add_events([event], fresh=True)
        await self.notify()

    def record_soon(
        self, kind: str, node_id: str, details: dict[str, Any], reclaim_id: str = ""
    ) -> None:
        """`record` for what nothing waits on (a replacement request's outcome): queued and
        stored by one task, many to a transaction, so a thousand notices at once cost a few
        transactions, not a thousand that would queue before the next Taint's."""
        self._soon.append((self.clock(), kind, node_id, details, reclaim_id))
        if self._recorder is None or self._recorder.done():
            self._recorder = asyncio.get_running_loop().create_task(self._record_queued())

    async def _record_queued(self) -> None:
        while self._soon:
            queued, self._soon = self._soon, []
            # One read for all of them: a mass reclamation's thousand replacement events are
            # one trip to the store, not a thousand beside the Taints'.
            records = await self.store.reclamations([q[4] for q in queued if q[4]])
            t0s = {reclaim_id: record["t0"] for reclaim_id, record in records.items()}
            events = [
                NewEvent(
                    uid=f"coordinator-{uuid.uuid4()}",
                    kind=kind,
                    node_id=node_id,
                    reclaim_id=reclaim_id,
                    wall_time=at,
                    t_offset_s=at - t0s[reclaim_id] if t0s.get(reclaim_id) else None,
                    details=details,
                )
                for at, kind, node_id, details, reclaim_id in queued
            ]
            try:
                await self.store.add_events(events, fresh=True)
            except Exception as e:  # noqa: BLE001 - a background task: say so, never die silent
                log.error(
                    "%d coordinator events (%s) not stored: %s: %s",
                    len(events),
                    ", ".join(sorted({ev.kind for ev in events})),
                    type(e).__name__,
                    e,
                )
                continue
            await self.notify()

    async def flush(self) -> None:
        """Wait until what `record_soon` queued is stored."""
        while self._recorder is not None and not self._recorder.done():
            await asyncio.shield(self._recorder)

    async def accept(self, events: Sequence[NewEvent]) -> list[str]:
        """Store an agent's batch (checked by the caller) as one transaction; the uids to
        acknowledge. A resent event is counted once, like it is stored once."""
        ids = await self.store.add_events(events)
        fresh = [ev for ev, stored in zip(events, ids, strict=True) if stored is not None]
        for ev in fresh:
            self._observe(ev)
        await self.notify()
        for ev in fresh:  # once per event, however often the agent resends it
            reaction = self._reactions.get(ev.kind)
            if reaction is None:
                continue
            try:
                await reaction(ev)
            except Exception as e:  # noqa: BLE001 - the batch is stored: its ack must go out
                # A reaction (an advisory's window, a contract's count) that failed is logged;
                # it must not end the agent's stream over events that are already stored.
                log.error(
                    "node %s: %s reaction failed: %s: %s", ev.node_id, ev.kind, type(e).__name__, e
                )
        return [ev.uid for ev in events]

    async def notify(self) -> None:
        async with self._new_event:
            self._new_event.notify_all()

    async def wait(self, timeout: float) -> None:
        async with self._new_event:
            try:
                async with asyncio.timeout(timeout):  # (wait_for can swallow a cancel)
                    await self._new_event.wait()
            except TimeoutError:
                pass
