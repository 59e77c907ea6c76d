"""What the node is doing, as the owner sees it: `spotctl status` (the control socket's answer)
and the unit's STATUS= line (`systemctl status`). Read only: nothing here changes a part."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from spotdrain.agent.drain.link import CoordinatorLink
from spotdrain.agent.drain.runner import DrainRunner
from spotdrain.agent.notices.hub import SourceHub
from spotdrain.agent.workloads.inference import WorkerManager
from spotdrain.agent.workloads.jobs import PlainWorkloads


@dataclass(frozen=True)
class NodeStatus:
    node_id: str
    drains: DrainRunner
    link: CoordinatorLink
    sources: SourceHub
    workers: WorkerManager
    plain: PlainWorkloads

    def status(self) -> dict[str, Any]:
        now = time.time()
        pause = self.drains.current_pause()
        live = [r for r in self.drains.live.values() if not r.finished]
        drain = None
        if live:
            rec = min(live, key=lambda r: r.grace_deadline)
            drain = {
                "reclaim_id": rec.reclaim_id,
                "reason": rec.reason,
                "phase": rec.phase,
                "outcome": rec.outcome or None,
                "terminate_at": rec.terminate_at,
                "grace_deadline": rec.grace_deadline,
                "grace_in_s": rec.grace_deadline - now,
                "deadline_in_s": rec.terminate_at - now,
            }
        if pause is not None:
            state = "paused" if pause.phase == "done" else "draining"
        elif drain is not None:
            state = "draining"
        elif self.drains.local_taints.current():
            state = "tainted"
        else:
            state = "available"
        return {
            "node": self.node_id,
            "state": state,
            "paused": pause is not None,
            "drain": drain,
            "coordinator_connected": self.link.connected.is_set(),
            "sources": self.sources.status(),
            "at_risk": self.sources.at_risk(),
            "workers": [
                {"worker_id": w, "slots_in_use": used, "capacity": cap, "state": st}
                for w, used, cap, st in self.workers.slots()
            ],
            # A rental runs until the drain's grace deadline (its reclaim_at), if one is on.
            "rentals": [
                {
                    "rental_id": r.key,
                    "container": r.name,
                    "reclaim_at": drain["grace_deadline"] if drain else None,
                }
                for r in self.plain.rentals.values()
            ],
            "jobs": [
                {"worker_id": j.key, "kind": j.kind, "container": j.name, "draining": j.draining}
                for j in self.plain.jobs.values()
            ],
        }

    def describe(self) -> str:
        """One STATUS= line: what the agent is doing, as `systemctl status` shows it."""
        s = self.status()
        watched = [
            str(src.cfg.path) if name == "file" else name
            for name, src in self.sources.sources.items()
        ]
        parts = [f"watching {', '.join(watched)}", f"{len(s['workers'])} workers"]
        broken = self.sources.broken()
        if broken:
            parts.insert(0, "notice source down: " + ", ".join(broken))
        parts.append(
            "coordinator connected" if s["coordinator_connected"] else "coordinator unreachable"
        )
        if s["paused"] and not s["drain"]:
            parts.insert(0, "paused by the owner")
        elif s["state"] == "tainted":
            parts.insert(0, "locally tainted")
        if s["drain"]:
            d = s["drain"]
            grace = f"G in {d['grace_in_s']:.0f} s" if d["grace_in_s"] > 0 else "G passed"
            parts.insert(0, f"draining {d['reclaim_id']} ({d['reason']}, {d['phase']}): {grace}")
        return "; ".join(parts)
