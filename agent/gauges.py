"""The agent's own gauges on /metrics, beside the reclamation metrics (runtime/metrics.py):
slots and workers as the gates count them, the coordinator stream, and each notice source."""

from __future__ import annotations

from spotdrain.agent.drain.link import CoordinatorLink
from spotdrain.agent.notices.hub import SourceHub
from spotdrain.agent.workloads.inference import WorkerManager
from spotdrain.runtime.metrics import CollectorRegistry, GaugeCollector


def register_gauges(
    registry: CollectorRegistry, workers: WorkerManager, link: CoordinatorLink, sources: SourceHub
) -> None:
    registry.register(
        GaugeCollector(
            "spotdrain_slots_in_use",
            "Slots in use per worker, as its gate counts them.",
            ["worker_id", "state"],
            lambda: [([w, st], float(used)) for w, used, _cap, st in workers.slots()],
        )
    )
    registry.register(
        GaugeCollector(
            "spotdrain_workers",
            "Inference workers on this node by state.",
            ["state"],
            lambda: _workers_by_state(workers),
        )
    )
    registry.register(
        GaugeCollector(
            "spotdrain_coordinator_connected",
            "1 while the stream to the coordinator is registered, 0 while it reconnects.",
            [],
            lambda: [([], float(link.connected.is_set()))],
        )
    )
    registry.register(
        GaugeCollector(
            "spotdrain_notice_source_up",
            "1 while a notice source reads its provider, 0 once it is reported down.",
            ["source"],
            lambda: [([h["source"]], float(h["up"])) for h in sources.status()],
        )
    )
    registry.register(
        GaugeCollector(
            "spotdrain_notice_source_reads",
            "Answers each notice source has read from its provider since the agent started.",
            ["source"],
            lambda: [([h["source"]], float(h["reads"])) for h in sources.status()],
        )
    )
    registry.register(
        GaugeCollector(
            "spotdrain_notice_source_last_ok_timestamp_seconds",
            "When each notice source last read its provider successfully (epoch seconds).",
            ["source"],
            lambda: [
                ([h["source"]], h["last_ok"]) for h in sources.status() if h["last_ok"] is not None
            ],
        )
    )


def _workers_by_state(workers: WorkerManager) -> list[tuple[list[str], float]]:
    counts = {"ready": 0, "draining": 0}
    for _w, _used, _cap, state in workers.slots():
        counts[state] = counts.get(state, 0) + 1
    return [([state], float(n)) for state, n in counts.items()]
