"""The capacity keeper counts a model's serving workers without walking them (a pass runs after
every notice, and a thousand notices in a second must not each scan 10,000 workers): the count
is the registry's, less the model's workers on nodes at risk, and it always equals what the
scan would find."""

from __future__ import annotations

from spotdrain.coordinator.capacity.keeper import CapacityKeeper
from spotdrain.coordinator.core import worker_machine as wm
from spotdrain.coordinator.fleet.nodes import NodeIndex
from spotdrain.coordinator.fleet.registry import FleetState, WorkerRegistry

NOW = 1_000.0


def worker(
    i: int, node: str, model: str = "llama", state: str = wm.READY, kind: str = "inference"
) -> wm.Worker:
    return wm.Worker(f"w-{i}", node, model, "img:1", 20000 + i, 4, NOW, state=state, kind=kind)


def test_the_serving_count_is_the_scan_without_the_scan() -> None:
    """Six nodes, workers of two models in every state; one node has an advisory in force and
    another had one that expired. The count matches the scan for each model, before and after
    workers change state, and a model no worker serves counts zero."""
    registry = WorkerRegistry()
    nodes = NodeIndex(lambda: NOW, registry.count)
    # Counting reads the indexes only: no store, no event log, no placement, no pass run.
    state = FleetState(None, None, lambda: NOW, nodes, registry)  # type: ignore[arg-type]
    keeper = CapacityKeeper(state, gate=None, apply=None, background=None)  # type: ignore[arg-type]
    states = [wm.STARTING, wm.READY, wm.DRAINING, wm.READY]
    for i in range(24):
        registry.add(worker(i, f"n{i % 6}", "llama" if i % 3 else "mistral", states[i % 4]))
    registry.add(worker(99, "n1", kind="batch"))
    nodes.risks["n1"] = {"rebalance": NOW + 60}  # in force
    nodes.risks["n2"] = {"rebalance": NOW - 1}  # expired

    def agree() -> None:
        for model in ("llama", "mistral", "none"):
            assert keeper.serving_count(model) == len(keeper.serving(model)), model

    agree()
    assert keeper.serving_count("none") == 0
    on_risky = [w for w in registry.live("n1") if registry.is_serving(w)]
    assert on_risky and all(w not in keeper.serving(w.model) for w in on_risky)
    for w in registry.live("n3"):
        w.state = wm.DRAINING
        registry.changed(w)
    agree()
    del nodes.risks["n1"]
    agree()


def test_slots_in_use_are_one_total_per_model() -> None:
    """The coordinator's slots gauge: per model over its ready workers (a starting or draining
    worker's gate is not counted), never a series per worker."""
    registry = WorkerRegistry()
    for i, (model, state, used) in enumerate(
        [
            ("llama", wm.READY, 3),
            ("llama", wm.READY, 1),
            ("llama", wm.STARTING, 2),
            ("mistral", wm.READY, 4),
            ("mistral", wm.DRAINING, 2),
        ]
    ):
        w = worker(i, f"n{i}", model, state)
        w.slots_in_use = used
        registry.add(w)
    assert registry.slots_in_use_by_model() == {"llama": 4, "mistral": 4}
