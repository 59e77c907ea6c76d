"""A node's switches and the drains they start: the taint (a notice or a pause), the owner's
workload flag, the operator's spot flag.

The critical path is `taint`: the taint, the drain's deadlines and the workers' draining state
are stored in one priority transaction before the agent is answered (it signals nothing until
then), and nothing in it grows with the fleet. Replacement and capacity decisions run after,
in the background (docs/design.md "Hard notice timeline", steps 3 to 6).
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import logging
from collections.abc import Sequence

from spotdrain.coordinator.capacity.keeper import CapacityKeeper
from spotdrain.coordinator.capacity.replacement import Replacement
from spotdrain.coordinator.core import worker_machine as wm
from spotdrain.coordinator.fleet.placer import Gate
from spotdrain.coordinator.fleet.registry import ApplyEvent, FleetState
from spotdrain.coordinator.fleet.rentals import RentalBook
from spotdrain.coordinator.store import DrainRow, NodeRow, TaintRow
from spotdrain.protocol import timing

log = logging.getLogger("spotdrain.coordinator.fleet.drains")

# A lifted drain (a resumed pause, a cancelled notice) is remembered until this long after its
# deadline D (or its lift, if later). A Taint for a reclamation the coordinator has neither in
# progress nor remembered, whose D is later than this long ago, is then new without asking the
# store: had it been lifted, it would still be remembered. Only a retry older than that (or one
# with no deadlines) reads the store, as every first Taint did before; a thousand of those
# reads in a mass reclamation queued on the store's threads ahead of the answers.
LIFTED_KEEP_S = 600.0
# ... at most this many per node (a node lifting reclamations in a loop): past it, that node's
# Taints read the store again instead of growing the memory.
LIFTED_PER_NODE = 64


def _forget_at(lifted: DrainRow) -> float:
    """When a lifted drain may be forgotten (LIFTED_KEEP_S after its D or its lift)."""
    return max(lifted.terminate_at, lifted.ended_at or 0.0) + LIFTED_KEEP_S


class SpotChangeRefused(Exception):
    def __init__(self, node_id: str, rentals: Sequence[str], render: Sequence[str] = ()) -> None:
        held = []
        if rentals:
            held.append(f"{len(rentals)} active rental(s) ({', '.join(rentals)})")
        if render:
            held.append(f"{len(render)} render job(s) ({', '.join(render)}), never run on spot")
        super().__init__(
            f"node {node_id} has {' and '.join(held)}: its spot flag cannot change until they end"
        )
        self.node_id = node_id
        self.rentals = rentals


class UnknownNode(KeyError):
    pass


@dataclasses.dataclass(frozen=True)
class TaintAnswer:
    taints: list[TaintRow]
    late: bool = False  # a retry of a reclamation already lifted: nothing was done


class Drains:
    def __init__(
        self,
        state: FleetState,
        apply: ApplyEvent,
        gate: Gate,
        rentals: RentalBook,
        replacement: Replacement,
        capacity: CapacityKeeper,
    ) -> None:
        self.store, self.events, self.clock = state.store, state.events, state.clock
        self.nodes, self.registry = state.nodes, state.registry
        self.apply = apply
        # What a drain sets off in the other concerns: the node's rentals told, a notice's
        # replacement asked for, capacity kept elsewhere, paused workers placed again.
        self.gate = gate
        self.rentals = rentals
        self.replacement = replacement
        self.capacity = capacity
        # Paused workers still draining when the owner resumed: replaced once they stop. The
        # store holds the list (rebuild reads it); this is its index of ids.
        self.replace_on_stop: set[str] = set()
        # Each node's drains in progress, as stored (rebuild reads them back): the critical
        # path reads them here, not from the store.
        self.active: dict[str, dict[str, DrainRow]] = {}
        # Drains lifted lately, by node (see LIFTED_KEEP_S); rebuild reads them back too. The
        # heap holds when each may be forgotten; nodes past LIFTED_PER_NODE read the store.
        self.lifted: dict[str, dict[str, DrainRow]] = {}
        self._forget_at: list[tuple[float, str, str]] = []
        self._lifted_overflow: set[str] = set()
        # One switch at a time per node: what a Taint read is still true when it writes.
        self._locks: dict[str, asyncio.Lock] = {}

    def lock(self, node_id: str) -> asyncio.Lock:
        lock = self._locks.get(node_id)
        if lock is None:
            lock = self._locks[node_id] = asyncio.Lock()
        return lock

    def load(self, drains: Sequence[DrainRow], lifted: Sequence[DrainRow] = ()) -> None:
        """The drains in progress and those lifted lately (`store.lifted_drains`), as stored."""
        self.active = {}
        for d in drains:
            self.active.setdefault(d.node_id, {})[d.reclaim_id] = d
        self.lifted, self._forget_at, self._lifted_overflow = {}, [], set()
        for d in lifted:
            self._remember_lifted(d)

    def _ended(self, node_id: str, reclaim_id: str, lifted: DrainRow) -> None:
        self._unstarted(node_id, reclaim_id)
        self._remember_lifted(lifted)

    def _unstarted(self, node_id: str, reclaim_id: str) -> None:
        drains = self.active.get(node_id, {})
        drains.pop(reclaim_id, None)
        if not drains:
            self.active.pop(node_id, None)

    def _remember_lifted(self, drain: DrainRow) -> None:
        node = self.lifted.setdefault(drain.node_id, {})
        if drain.reclaim_id not in node and len(node) >= LIFTED_PER_NODE:
            self._lifted_overflow.add(drain.node_id)
            return
        node[drain.reclaim_id] = drain
        heapq.heappush(self._forget_at, (_forget_at(drain), drain.node_id, drain.reclaim_id))

    def _forget_lifted(self, now: float) -> None:
        while self._forget_at and self._forget_at[0][0] < now:
            _, node_id, reclaim_id = heapq.heappop(self._forget_at)
            node = self.lifted.get(node_id, {})
            drain = node.get(reclaim_id)
            if drain is None:
                continue
            if _forget_at(drain) >= now:
                continue  # remembered again since, with a later time
            del node[reclaim_id]
            if not node:
                del self.lifted[node_id]

    async def known_drain(
        self, node_id: str, reclaim_id: str, terminate_at: float
    ) -> DrainRow | None:
        """The node's drain for `reclaim_id` (in progress or lifted), or None when there is
        none; from memory unless the Taint's own deadline D is too old for memory to be sure."""
        now = self.clock()
        self._forget_lifted(now)
        drain = self.active.get(node_id, {}).get(reclaim_id)
        if drain is None:
            drain = self.lifted.get(node_id, {}).get(reclaim_id)
        if drain is not None:
            return drain
        if terminate_at > now - LIFTED_KEEP_S and node_id not in self._lifted_overflow:
            return None
        return await self.store.drain(node_id, reclaim_id)

    def current(self, node_id: str) -> DrainRow | None:
        """The node's drain with the earliest grace deadline (its reclamation's timeline gets
        what a drain cuts)."""
        drains = self.active.get(node_id)
        return min(drains.values(), key=lambda d: d.grace_deadline) if drains else None

    def latest(self, node_id: str) -> DrainRow | None:
        """The node's current drain, else the one lifted last: what a stream a drain cut was
        continued under, when the report comes after the drain ended."""
        current = self.current(node_id)
        if current is not None:
            return current
        lifted = self.lifted.get(node_id)
        return max(lifted.values(), key=lambda d: d.started_at) if lifted else None

    # --- the taint, set and lifted -----------------------------------------------------------

    async def taint(
        self, node_id: str, reclaim_id: str, reason: str, terminate_at: float, grace: float
    ) -> TaintAnswer:
        async with self.lock(node_id):
            return await self._taint(node_id, reclaim_id, reason, terminate_at, grace)

    async def _taint(
        self, node_id: str, reclaim_id: str, reason: str, terminate_at: float, grace: float
    ) -> TaintAnswer:
        store, nodes = self.store, self.nodes
        ended = await self.known_drain(node_id, reclaim_id, terminate_at)
        if ended is not None and ended.ended_at is not None:
            # A late retry of a reclamation already lifted (a resumed pause, a cancelled
            # notice): taking it again would pause the node behind its owner's back.
            log.info(
                "node %s: ignored a late taint for %s, lifted at %.3f",
                node_id,
                reclaim_id,
                ended.ended_at,
            )
            return TaintAnswer(nodes.node_taints(node_id), late=True)
        taint = nodes.taints.get(node_id, {}).get(reclaim_id) or TaintRow(
            node_id, reclaim_id, "spotdrain.io/reclaim", "NoSchedule", reason, self.clock()
        )
        async with store.transaction(priority=True):
            await store.add_taint(node_id, reclaim_id, reason)
            # Unschedulable, then unrouted: every worker on the node leaves the routing table
            # before the agent signals anything (docs/design.md "Hard notice timeline", step 4).
            await self.begin_drain(node_id, reclaim_id, reason, terminate_at, grace, ended)
        # Committed: the taint is in force for placement from now (it was stored first).
        nodes.taint_added(taint)
        return TaintAnswer(nodes.node_taints(node_id))

    async def lift_taint(
        self, node_id: str, reclaim_id: str, reason: str, terminate_at: float, grace: float
    ) -> TaintAnswer:
        store = self.store
        async with self.lock(node_id), store.transaction(priority=True):
            await store.remove_taint(node_id, reclaim_id)
            # Remember the lift even for a reclamation never tainted here, so a Taint call
            # still in flight that lands after it is recognised as late.
            drain = await store.start_drain(node_id, reclaim_id, reason, terminate_at, grace)
            await store.end_drain(node_id, reclaim_id)
        self._ended(node_id, reclaim_id, dataclasses.replace(drain, ended_at=self.clock()))
        self.nodes.taint_removed(node_id, reclaim_id)
        await self.rentals.lift_reclaim(node_id, reclaim_id)
        return TaintAnswer(self.nodes.node_taints(node_id))

    # --- drains ------------------------------------------------------------------------------

    async def node_drain(self, node_id: str) -> wm.NodeDrain | None:
        """The drain the node is under, if any: the earliest deadlines of its active drains."""
        drains = list(self.active.get(node_id, {}).values())
        node = self.nodes.rows.get(node_id)
        if not drains:
            if node is not None and not node.workload_enabled:
                # Disabled with no recorded drain (an operator's switch): drain with no grace
                # beyond the default owner's promise.
                now = self.clock()
                return wm.NodeDrain(
                    "pause", now + timing.NOTICE_S - timing.GRACE_S, now + timing.NOTICE_S
                )
            return None
        first = min(drains, key=lambda d: d.grace_deadline)
        reason = first.reason if first.reason in wm.DRAIN_REASONS else "operator"
        terminate_at = min(d.terminate_at for d in drains)
        # G <= D by construction, whatever the records hold: a record stored with its G after
        # its D (an agent's or a fuzzer's Taint, before begin_drain clamped it) drains by D.
        return wm.NodeDrain(reason, min(first.grace_deadline, terminate_at), terminate_at)

    async def begin_drain(
        self,
        node_id: str,
        reclaim_id: str,
        reason: str,
        terminate_at: float,
        grace: float,
        known: DrainRow | None,
    ) -> None:
        """A pause or a notice: (for a pause) the flag off; every worker on the node draining.
        `known`: the drain as stored already (a retry keeps its first deadlines), or None."""
        store = self.store
        if reason == "pause" and await store.set_workload(node_id, False):
            await self._refresh(node_id)
            await self.events.record("workload_disabled", node_id, {"reclaim_id": reclaim_id}, "")
        if terminate_at <= 0:  # an agent that sent no deadlines: the defaults from now
            terminate_at = self.clock() + timing.NOTICE_S
            grace = terminate_at - timing.GRACE_S
        first = known is None
        drain = known or DrainRow(
            node_id, reclaim_id, reason, terminate_at, grace, self.clock(), None
        )
        if drain.grace_deadline > drain.terminate_at:
            # Work must be gone by D: a G after it (from the wire, or a row stored so before
            # this rule) is D itself, and is stored so.
            drain = dataclasses.replace(drain, grace_deadline=drain.terminate_at)
        if first:
            await store.add_drain(drain)
            self.active.setdefault(node_id, {})[reclaim_id] = drain
            store.on_rollback(lambda: self._unstarted(node_id, reclaim_id))
        now = self.clock()
        lost = [w for w in self.registry.live(node_id) if w.state != wm.DRAINING]
        why = reason if reason in wm.DRAIN_REASONS else "operator"
        for worker in self.registry.live(node_id):
            await self.apply(
                worker, wm.Drain(now, wm.NodeDrain(why, drain.grace_deadline, drain.terminate_at))
            )
        # The renters are told when their containers stop: the grace deadline, so the node is
        # still verified empty by D.
        await self.rentals.reclaim(node_id, drain.reclaim_id, reason, drain.grace_deadline)
        if first and reason == "notice":
            models = tuple(sorted({w.model for w in lost}))
            await self.replacement.request(node_id, drain.reclaim_id, drain.terminate_at, models)
        # Replacements start now, elsewhere, in parallel with this drain: the node is already
        # unschedulable (tainted or disabled), so the gate sends them to other nodes. In the
        # background: the Taint answer, which the agent waits for before signalling, does not.
        self.capacity.wanted()

    async def end_pause(self, node_id: str, reclaim_id: str) -> bool:
        """The owner's resume: flag on, pause drains ended, paused workers placed again.
        Returns the flag as it is now."""
        store = self.store
        ended = []
        async with self.lock(node_id), store.transaction(priority=True):
            for drain in await store.active_drains(node_id):
                if drain.reason == "pause" and (not reclaim_id or drain.reclaim_id == reclaim_id):
                    await store.end_drain(node_id, drain.reclaim_id)
                    lifted = dataclasses.replace(drain, ended_at=self.clock())
                    self._ended(node_id, drain.reclaim_id, lifted)
                    ended.append(drain)
            # The pause's taints go, including one whose drain ended before (a repeated resume).
            for taint in await store.taints(node_id):
                drain = await store.drain(node_id, taint.reclaim_id)
                if taint.reason == "pause" and (drain is None or drain.ended_at is not None):
                    await store.remove_taint(node_id, taint.reclaim_id)
                    self.nodes.taint_removed(node_id, taint.reclaim_id)
            # The owner's flag is the owner's: back on once no pause holds it (a provider's
            # notice in progress keeps the node tainted, not disabled).
            pauses = [d for d in await store.active_drains(node_id) if d.reason == "pause"]
            enabled = not pauses and await store.set_workload(node_id, True)
        await self._refresh(node_id)
        for drain in ended:
            await self.rentals.lift_reclaim(node_id, drain.reclaim_id)
        if enabled:
            await self.events.record("workload_enabled", node_id, {"reclaim_id": reclaim_id}, "")
        # The workers this pause took away come back, through the one gate. Only in the call
        # that ends the pause, so a repeated resume places nothing twice.
        graces = {d.grace_deadline for d in ended}
        for doc in await store.worker_docs(node_id=node_id):
            worker = wm.Worker.from_json(doc)
            if worker.drain_reason != "pause" or worker.grace_deadline not in graces:
                continue
            live = self.registry.get(worker.worker_id)
            if live is not None and live.state != wm.STOPPED:
                # Still draining: it holds its GPU until it stops; place the new one then.
                await store.add_replace_on_stop(worker.worker_id, doc)
                self.replace_on_stop.add(worker.worker_id)
                continue
            await self.replace(worker)
        row = self.nodes.rows.get(node_id)
        return bool(row and row.workload_enabled)

    async def stopped(self, worker: wm.Worker) -> None:
        """A worker stopped: if a resume was waiting for its GPU, its replacement goes now."""
        if worker.worker_id not in self.replace_on_stop:
            return
        self.replace_on_stop.discard(worker.worker_id)
        doc = await self.store.pop_replace_on_stop(worker.worker_id)
        if doc is not None:
            await self.replace(wm.Worker.from_json(doc))

    async def replace(self, worker: wm.Worker) -> None:
        """A paused worker placed again on its node after the resume, unless the model has
        enough elsewhere by now."""
        if not await self.capacity.enough(worker.model):
            await self.gate.place_again(worker, "resume")

    async def _refresh(self, node_id: str) -> None:
        row = await self.store.node(node_id)
        if row is not None:
            self.nodes.put(row)

    # --- the spot flag -----------------------------------------------------------------------

    async def set_spot(self, node_id: str, spot: bool) -> NodeRow:
        """An operator's (the dashboard's) change of a node's spot flag. Refused while the node
        has an active rental, so no provider can switch to spot mid-rental (invariant 9)."""
        node = await self.store.node(node_id)
        if node is None:
            raise UnknownNode(node_id)
        active = [r.rental_id for r in await self.rentals.list(node_id, active_only=True)]
        # Render is never on spot: a node with render jobs cannot become one under them.
        render = [w.worker_id for w in self.render_jobs(node_id)] if spot else []
        if (active or render) and node.spot != spot:
            await self.events.record(
                "spot_change_refused",
                node_id,
                {"spot": spot, "active_rentals": active, "render_jobs": render},
                "",
            )
            raise SpotChangeRefused(node_id, active, render)
        await self.store.set_spot(node_id, spot)
        if node.spot != spot:
            await self.events.record(
                "node_spot_changed", node_id, {"spot": spot, "was": node.spot}, ""
            )
        await self._refresh(node_id)
        return self.nodes.rows[node_id]

    def render_jobs(self, node_id: str) -> list[wm.Worker]:
        return [w for w in self.registry.live(node_id) if w.kind == "render"]
