"""The lifecycle event log: what the coordinator witnesses itself, and what agents send.

Every event is stored (an agent's batch in one transaction) before it is acknowledged or
announced; watchers (WatchEvents, the metrics) learn of new ones without polling the store.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from spotdrain.coordinator.store import NewEvent, Store


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

    async def accept(self, events: Sequence[NewEvent]) -> list[str]:
        """Store an agent's batch (checked by the caller) as one transaction; the uids to
        acknowledge. A resent event is counted once, like it is stored once."""
        ids = await self.store.add_events(events)
        for ev, stored in zip(events, ids, strict=True):
            if stored is not None:
                self._observe(ev)
        await self.notify()
        return [ev.uid for ev in events]

    async def notify(self) -> None:
        async with self._new_event:
            self._new_event.notify_all()

    async def wait(self, timeout: float) -> None:
        async with self._new_event:
            try:
                await asyncio.wait_for(self._new_event.wait(), timeout)
            except TimeoutError:
                pass
