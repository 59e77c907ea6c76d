"""The agent's durable state in its state dir: reclamation bundles, local taints, files for
workloads. Every write is atomic (temp file, fsync, rename) so a crash leaves old or new, never
half; nothing about a drain lives only in memory (docs/design.md invariant 8).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from spotdrain.agent.reclamation import Reclamation
from spotdrain.workload import Deadline


def write_atomic(path: Path, doc: Any, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    data = json.dumps(doc, indent=1, sort_keys=True).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    os.chmod(path, mode)


class BundleStore:
    """One JSON file per reclamation under <state>/reclamations/, finished ones kept for dedup."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / "reclamations"
        self.dir.mkdir(parents=True, exist_ok=True)

    def save(self, rec: Reclamation) -> None:
        write_atomic(self.dir / f"{rec.reclaim_id}.json", rec.to_json(), mode=0o600)

    def exists(self, reclaim_id: str) -> bool:
        return (self.dir / f"{reclaim_id}.json").exists()

    def load_all(self) -> list[Reclamation]:
        recs = []
        for path in sorted(self.dir.glob("rcl-*.json")):
            try:
                recs.append(Reclamation.from_json(json.loads(path.read_text())))
            except (ValueError, TypeError) as e:
                # A bundle we cannot read is a bug or disk damage; refuse to guess its deadlines.
                raise RuntimeError(f"reclamation bundle {path} is unreadable: {e}") from e
        return recs


class LocalTaints:
    """Taints the agent applied itself because the coordinator did not answer in time.

    While one stands, the agent refuses to start any workload (docs/design.md invariant 4).
    """

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "local_taints.json"

    def current(self) -> list[str]:
        try:
            return list(json.loads(self.path.read_text()))
        except FileNotFoundError:
            return []

    def apply(self, reclaim_id: str) -> None:
        held = self.current()
        if reclaim_id not in held:
            write_atomic(self.path, [*held, reclaim_id], mode=0o600)

    def lift(self, reclaim_id: str) -> None:
        held = self.current()
        if reclaim_id in held:
            write_atomic(self.path, [r for r in held if r != reclaim_id], mode=0o600)

    def refuse_start(self) -> str | None:
        """Why a workload start must be refused now, or None."""
        held = self.current()
        return f"node is locally tainted for {', '.join(held)}" if held else None


def write_deadline_file(
    path: Path, reclaim_id: str, terminate_at: float, grace_deadline: float, reason: str
) -> None:
    # Readable by workloads (bind-mounted read-only). The format has one definition, in
    # spotdrain.workload (the module workloads read it with); `reclaim_at` is G there.
    deadline = Deadline(reclaim_id, terminate_at, grace_deadline, reason)
    write_atomic(path, deadline.to_json())
