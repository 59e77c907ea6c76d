"""Desired capacity per model: kept through the gate, on the least-loaded nodes that admit
it, with a backoff for a model whose workers keep failing to start.

Passes are serialised (two that both saw a shortage would both fill it). Triggers from the
critical path (a Taint, a pause) only ask for a pass (`wanted`): one runs after the answer, and
however many notices arrive meanwhile, they share the next pass.
"""

from __future__ import annotations

import asyncio
import logging

from spotdrain.coordinator.capacity import desired as capacity
from spotdrain.coordinator.core import worker_machine as wm
from spotdrain.coordinator.fleet.nodes import summarize_refusals
from spotdrain.coordinator.fleet.placer import Gate
from spotdrain.coordinator.fleet.registry import ApplyEvent, FleetState
from spotdrain.coordinator.store import ModelRow, StartBackoff
from spotdrain.runtime.background import Background

log = logging.getLogger("spotdrain.coordinator.capacity.desired")

# A worker drained because its model has more than its desired count: its open requests get
# this long to finish before its gate cuts them.
SCALE_DOWN_GRACE_S = 60.0
# A model whose workers keep failing to start (a wrong image): the next try waits 5 s, 10 s,
# ... up to this, so a broken setting does not place a new worker every recovery pass.
START_BACKOFF_MAX_S = 300.0
# A pass yields to the event loop after this many placements: a Taint arriving during a big
# pass is answered between two of them.
YIELD_EVERY = 50


class CapacityKeeper:
    def __init__(
        self,
        state: FleetState,
        gate: Gate,
        apply: ApplyEvent,
        background: Background,
    ) -> None:
        self.store, self.events, self.clock = state.store, state.events, state.clock
        self.nodes, self.registry = state.nodes, state.registry
        self.gate = gate
        self.apply = apply
        self.background = background
        self._lock = asyncio.Lock()
        self._short: set[str] = set()  # models whose desired capacity could not be met
        self.backoff: dict[str, StartBackoff] = {}  # the store's, read back by rebuild
        self._wanted = False
        self._runner: asyncio.Task[None] | None = None

    def wanted(self, path: str = "recovery") -> None:
        """Ask for a pass soon, in the background; passes asked for meanwhile are one."""
        self._wanted = True
        if self._runner is None or self._runner.done():
            self._runner = self.background.spawn(self._run(path))

    async def _run(self, path: str) -> None:
        while self._wanted:
            self._wanted = False
            await self.keep(path=path)

    def serving(self, model: str) -> list[wm.Worker]:
        """A model's workers that count toward its capacity: starting or ready, not draining,
        and not on a node at risk (an advisory): those serve on, but are replaced elsewhere.
        A scan of the model's workers: only for a model over its count (which to drain)."""
        at_risk = self.nodes.at_risk
        return [w for w in self.registry.serving(model) if not at_risk(w.node_id)]

    def serving_count(self, model: str) -> int:
        """len(serving(model)) without the scan: the registry's count, less the model's
        workers on the nodes at risk (few: those with an advisory in force). A capacity pass
        runs after every notice, and a thousand notices in a second must not each walk the
        fleet's workers."""
        registry, nodes = self.registry, self.nodes
        risky = sum(
            1
            for node_id in nodes.risky()
            for w in registry.live(node_id)
            if w.model == model and registry.is_serving(w)
        )
        return registry.serving_count(model) - risky

    async def enough(self, model: str) -> bool:
        row = await self.store.model(model)
        return row is not None and self.serving_count(model) >= row.replicas

    async def keep(self, path: str = "recovery", prefer: str = "") -> None:
        """Every model with a desired count gets it, through the gate, on the least-loaded
        nodes that admit it; a model over its count has its newest extra workers drained."""
        async with self._lock:
            await self._keep(path, prefer)

    async def _keep(self, path: str, prefer: str) -> None:
        now = self.clock()
        for model in await self.store.models():
            count = self.serving_count(model.model)
            backoff = self.backoff.get(model.model)
            missing = model.replicas - count
            if backoff is not None and now < backoff.retry_at:
                missing = 0  # its last start failed: wait before the next try
            placed = 0
            while placed < missing:
                # In chunks of one transaction each: the chunk's workers and events are one
                # trip to the store, and a Taint waits for at most one chunk.
                async with self.store.transaction():
                    short = await self._place_chunk(
                        model, min(YIELD_EVERY, missing - placed), path, prefer
                    )
                placed += YIELD_EVERY
                if short:
                    break
                await asyncio.sleep(0)
            if missing <= 0:
                self._short.discard(model.model)
            if count <= model.replicas:
                continue
            for worker in capacity.surplus(self.serving(model.model), model.replicas):
                grace = now + SCALE_DOWN_GRACE_S
                await self.apply(worker, wm.Drain(now, wm.NodeDrain("operator", grace, grace + 10)))

    async def _place_chunk(self, model: ModelRow, count: int, path: str, prefer: str) -> bool:
        """Up to `count` workers of `model`; True when no node admits another (recorded once
        per shortage, with why the nodes said no; not every pass)."""
        for _ in range(count):
            request = self.gate.request_for(model.image, "inference", path)
            node_id, refused = self.nodes.pick(request, prefer)
            if node_id is None:
                if model.model not in self._short:
                    self._short.add(model.model)
                    await self.events.record(
                        "capacity_short",
                        "",
                        {
                            "model": model.model,
                            "replicas": model.replicas,
                            "serving": self.serving_count(model.model),
                            "refused": summarize_refusals(refused),
                            "path": path,
                        },
                    )
                return True
            self._short.discard(model.model)
            await self.gate.place_worker(node_id, model.model, model.image, model.slots, path=path)
        return False

    async def started(self, model: str) -> None:
        """A worker of the model served: its backoff is over."""
        if self.backoff.pop(model, None) is not None:
            await self.store.clear_start_backoff(model)

    async def start_failed(self, worker: wm.Worker) -> None:
        """A worker of a model with a desired count stopped before it ever served: back off
        before that model's next start (5 s, doubling, at most START_BACKOFF_MAX_S)."""
        if worker.kind != "inference" or await self.store.model(worker.model) is None:
            return
        known = self.backoff.get(worker.model)
        failures = (known.failures if known else 0) + 1
        delay = min(START_BACKOFF_MAX_S, 5.0 * 2 ** (failures - 1))
        backoff = StartBackoff(worker.model, failures, self.clock() + delay)
        self.backoff[worker.model] = backoff
        await self.store.set_start_backoff(backoff.model, backoff.failures, backoff.retry_at)
        await self.events.record(
            "capacity_start_failed",
            worker.node_id,
            {
                "model": worker.model,
                "worker_id": worker.worker_id,
                "failures": failures,
                "retry_in_s": delay,
            },
            "",
        )
