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
from typing import TYPE_CHECKING

from spotdrain.coordinator.store import NewEvent

if TYPE_CHECKING:
    from spotdrain.coordinator.fleet.wiring import Fleet

log = logging.getLogger("spotdrain.coordinator.fleet.risks")

# However long an agent asks for, an advisory keeps a node out of placements at most this long.
MAX_RISK_S = 7 * 24 * 3600.0
MAX_KEY = 256


class Risks:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def load(self, rows: list[tuple[str, str, str, str, float]]) -> None:
        self.fleet.nodes.risks = {}
        for node_id, key, _source, _reason, until in rows:
            self.fleet.nodes.risks.setdefault(node_id, {})[key] = until

    async def received(self, ev: NewEvent) -> None:
        """`advisory_received` from a node's agent (stored already, and only the first time)."""
        fleet = self.fleet
        now = fleet.clock()
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
        if key in fleet.nodes.risks.get(ev.node_id, {}):
            return
        await fleet.store.set_risk_later(ev.node_id, key, source, reason, until)
        fleet.nodes.risks.setdefault(ev.node_id, {})[key] = until  # once the write is queued
        log.info(
            "node %s at risk (%s from %s) until %.0f: replacing its workers elsewhere",
            ev.node_id,
            reason,
            source,
            until,
        )
        fleet.capacity.wanted("recovery")

    async def lifted(self, ev: NewEvent) -> None:
        fleet = self.fleet
        details = ev.details if isinstance(ev.details, dict) else {}
        key = details.get("key")
        risks = fleet.nodes.risks.get(ev.node_id, {})
        if not isinstance(key, str) or key not in risks:
            return
        del risks[key]
        if not risks:
            fleet.nodes.risks.pop(ev.node_id, None)
        await fleet.store.clear_risk_later(ev.node_id, key)
        log.info("node %s: advisory %s lifted (%s)", ev.node_id, key, details.get("why", ""))
        fleet.capacity.wanted("recovery")
