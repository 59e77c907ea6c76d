"""A node's work managers as a person reads them, the same in spotctl and the dashboard."""

from __future__ import annotations

from collections.abc import Iterable

from spotdrain.v1 import spotdrain_pb2 as pb


def manager_label(m: pb.WorkManager) -> str:
    """`docker`, or `slurm:CLUSTER/NODE` for a manager that names the node its own way (`?` for
    a cluster the agent could not read at its start)."""
    if not m.node_name and not m.cluster:
        return m.name
    return f"{m.name}:{m.cluster or '?'}/{m.node_name or '?'}"


def managers_label(managers: Iterable[pb.WorkManager]) -> str:
    return ",".join(manager_label(m) for m in managers) or "-"
