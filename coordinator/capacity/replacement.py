"""Replacement capacity for a hard notice: the reclaimed node's group is avoided for a while,
and another group's acquirer is asked for capacity.

Recorded at once; the whole request runs in the background, so nothing on the node (and not
the Taint answer) waits for it (docs/design.md step 6). What it reads is in memory (the fleet's
groups), never a scan of the store.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from spotdrain.coordinator.capacity.acquirer import (
    Acquirer,
    AcquisitionRequest,
    choose_target_group,
)
from spotdrain.coordinator.fleet.registry import FleetState
from spotdrain.runtime.background import Background

log = logging.getLogger("spotdrain.coordinator.capacity.replacement")


class Replacement:
    def __init__(
        self,
        state: FleetState,
        background: Background,
        acquirers: dict[str, Acquirer],
        avoid_s: float,
    ) -> None:
        self.store, self.events, self.clock = state.store, state.events, state.clock
        self.nodes = state.nodes
        self.background = background
        # Replacement capacity per node group, in the operator's order of preference.
        self.acquirers = dict(acquirers)
        self.avoid_s = avoid_s

    async def request(
        self,
        node_id: str,
        reclaim_id: str,
        terminate_at: float,
        models: Sequence[str],
        reason: str = "notice",
    ) -> None:
        """The node's group avoided now (one write: the next placement must already see it);
        the acquirer asked in the background. `reason`: a hard notice, or a node `lost`."""
        now = self.clock()
        node = self.nodes.rows.get(node_id)
        group = node.node_group if node is not None else ""
        elsewhere = (self.nodes.group_names() | set(self.acquirers)) - {group}
        # Avoiding the only group there is would stop every placement, replacements included.
        until = None
        if elsewhere:
            # Never shortened: the later of the window it has and this one.
            until = max(self.nodes.avoided.get(group, 0.0), now + self.avoid_s)
            await self.store.avoid_group_later(group, until)
            self.nodes.avoided[group] = until
        self.background.spawn(
            self._acquire(node_id, reclaim_id, terminate_at, tuple(models), until, reason)
        )

    async def _acquire(
        self,
        node_id: str,
        reclaim_id: str,
        terminate_at: float,
        models: tuple[str, ...],
        until: float | None,
        reason: str,
    ) -> None:
        now = self.clock()
        node = self.nodes.rows.get(node_id)
        group = node.node_group if node is not None else ""
        target = choose_target_group(group, list(self.acquirers), self.nodes.avoided_now(), now)
        request = AcquisitionRequest(
            request_id=f"acq-{reclaim_id}",
            reclaimed_node=node_id,
            reclaimed_group=group,
            target_group=target or "",
            gpus=len(node.gpus) if node is not None else 0,
            models=models,
            reason=reason,
            deadline=terminate_at,
        )
        details = {**request.to_dict(), "avoided_until": until}
        if target is None:
            details["detail"] = "no other node group has an acquirer that is not avoided"
            self.events.record_soon("replacement_unavailable", node_id, details, reclaim_id)
            return
        self.events.record_soon("replacement_requested", node_id, details, reclaim_id)
        result = await self.acquirers[target].request(request)
        self.events.record_soon(
            "replacement_result",
            node_id,
            {
                "request_id": result.request_id,
                "target_group": request.target_group,
                "ok": result.ok,
                "detail": result.detail,
                "duration_s": round(result.duration_s, 3),
                "response": result.response,
            },
            reclaim_id,
        )

    async def unasked(self, now: float) -> list[tuple[str, str, float]]:
        """Hard notices still in progress with no replacement request recorded: a coordinator
        that died between storing the drain and asking. (node, reclaim id, D) to ask for now."""
        handled = {"replacement_requested", "replacement_unavailable"}
        out = []
        for d in await self.store.active_drains():
            if d.reason != "notice" or now >= d.terminate_at:
                continue
            kinds = {e.kind for e in await self.store.events_of(d.reclaim_id)}
            if not handled & kinds:
                out.append((d.node_id, d.reclaim_id, d.terminate_at))
        return out
