"""Nodes at risk: an agent reported an advisory (a rebalance recommendation, scheduled
maintenance, a live migration). Nothing on the node is drained; the gate places nothing new
there (`at_risk`), and the capacity keeper stops counting its workers, so their replacements
start elsewhere at once while they keep serving. A hard notice that follows drains the node
with the replacements already up.

The advisory's window is the agent's (`expires_at`, absolute, stored once); it ends there or
when the agent reports it lifted. What is in force lives in memory and in `node_risks`, which
rebuild() reads back.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from spotdrain.coordinator.fleet.registry import FleetState
from spotdrain.coordinator.store import NewEvent

log = logging.getLogger("spotdrain.coordinator.capacity.risks")

# However long an agent asks for, an advisory keeps a node out of placements at most this long.
MAX_RISK_S = 7 * 24 * 3600.0
MAX_KEY = 256


class Risks:
    def __init__(
        self,
        state: FleetState,
        wanted: Callable[[str], None],
    ) -> None:
        self.store, self.clock, self.nodes = state.store, state.clock, state.nodes
        # A capacity pass asked for (the capacity keeper's `wanted`): the node's workers stop
        # counting, or count again.
        self.wanted = wanted

    def load(self, rows: list[tuple[str, str, str, str, float]]) -> None:
        self.nodes.risks = {}
        for node_id, key, _source, _reason, until in rows:
            self.nodes.risks.setdefault(node_id, {})[key] = until

    async def received(self, ev: NewEvent) -> None:
        """`advisory_received` from a node's agent (stored already, and only the first time)."""
        now = self.clock()
        details = ev.details if isinstance(ev.details, dict) else {}
        key, source, reason = (details.get(k) for k in ("key", "source", "reason"))
        until = details.get("expires_at")
        if details.get("action") != "prepare":
            return  # drain opens a reclamation of its own; ignore is only a record
        if not all(isinstance(v, str) and 0 < len(v) <= MAX_KEY for v in (key, source, reason)):
            log.warning("node %s: advisory without a usable key/source/reason ignored", ev.node_id)
            return
        if (
            isinstance(until, bool)
            or not isinstance(until, int | float)
            or not math.isfinite(until)
        ):
            log.warning("node %s: advisory %s without a usable expiry ignored", ev.node_id, key)
            return
        until = min(float(until), now + MAX_RISK_S)
        if until <= now:
            return  # over before it arrived (an outbox that was offline for the whole window)
        if key in self.nodes.risks.get(ev.node_id, {}):
            return
        await self.store.set_risk_later(ev.node_id, key, source, reason, until)
        self.nodes.risks.setdefault(ev.node_id, {})[key] = until  # once the write is queued
        log.info(
            "node %s at risk (%s from %s) until %.0f: replacing its workers elsewhere",
            ev.node_id,
            reason,
            source,
            until,
        )
        self.wanted("recovery")

    async def lifted(self, ev: NewEvent) -> None:
        details = ev.details if isinstance(ev.details, dict) else {}
        key = details.get("key")
        risks = self.nodes.risks.get(ev.node_id, {})
        if not isinstance(key, str) or key not in risks:
            return
        del risks[key]
        if not risks:
            self.nodes.risks.pop(ev.node_id, None)
        await self.store.clear_risk_later(ev.node_id, key)
        log.info("node %s: advisory %s lifted (%s)", ev.node_id, key, details.get("why", ""))
        self.wanted("recovery")
