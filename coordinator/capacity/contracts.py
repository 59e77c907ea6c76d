"""Workload contracts: per image (and kind), how its reclamations ended, and the images that
cannot honour the contract.

The contract (docs/workloads.md "The workload SDK"): on SIGTERM, a workload checkpoints and
exits before the grace deadline G. Each container a reclamation SIGTERMs ends one of three ways,
decided from the agent's own events as they are stored (coordinator/core/timeline.py, counted in the
store in the same transaction, so once each): `exited` before G, `killed` (still there at G,
SIGKILLed), or `overrun` (still there at O). An image whose killed plus overrun share is above the
budget (`--contract-budget`, default 0.5 %) over at least `--contract-min` reclamations (default 20)
is flagged, once: `workload_contract_flagged`. With `--no-spot-for-flagged`, the one placement
gate keeps a flagged image off spot nodes (coordinator/core/admission.py, CONTRACT_FLAGGED).

Rentals are not counted (they are killed at G by design: reclaim_at), nor inference workers
(they drain through their slot gates, not by SIGTERM).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from spotdrain.coordinator.fleet.registry import FleetState
from spotdrain.coordinator.store import ContractRow, NewEvent

log = logging.getLogger("spotdrain.coordinator.capacity.contracts")

DEFAULT_BUDGET = 0.005
DEFAULT_MIN = 20


@dataclass(frozen=True)
class ContractPolicy:
    budget: float = DEFAULT_BUDGET  # the killed + overrun share an image may have
    min_reclamations: int = DEFAULT_MIN  # judged only once it has been reclaimed this often
    no_spot_for_flagged: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.budget) and 0 <= self.budget < 1):
            raise ValueError(f"the contract budget must be a share in [0, 1), got {self.budget}")
        if isinstance(self.min_reclamations, bool) or self.min_reclamations < 1:
            raise ValueError(
                f"the contract minimum must be at least 1 reclamation, got {self.min_reclamations}"
            )

    def breached(self, row: ContractRow) -> bool:
        return row.reclamations >= self.min_reclamations and row.failed_share > self.budget


class Contracts:
    """The fleet's view of the contracts: read back from the store at rebuild, refreshed when
    an event that can end a container's reclamation is stored."""

    def __init__(
        self,
        state: FleetState,
        policy: ContractPolicy | None = None,
    ) -> None:
        self.store, self.events, self.clock = state.store, state.events, state.clock
        self.policy = policy or ContractPolicy()
        self.rows: dict[tuple[str, str], ContractRow] = {}

    def load(self, rows: list[ContractRow]) -> None:
        self.rows = {(r.image, r.kind): r for r in rows}

    async def ended(self, ev: NewEvent) -> None:
        """A container_exited or overrun was stored (and counted): judge the images again."""
        await self.judge()

    async def judge(self) -> None:
        rows = await self.store.contracts()
        self.load(rows)
        for row in rows:
            if row.flagged_at is not None or not self.policy.breached(row):
                continue
            now = self.clock()
            if not await self.store.flag_contract(row.image, row.kind, now):
                continue  # another replica flagged it first
            flagged = ContractRow(row.image, row.kind, row.exited, row.killed, row.overrun, now)
            self.rows[(row.image, row.kind)] = flagged
            log.warning(
                "workload image %s (%s) flagged: %d of %d reclamations killed or overrun",
                row.image,
                row.kind,
                row.killed + row.overrun,
                row.reclamations,
            )
            await self.events.record(
                "workload_contract_flagged",
                "",
                {
                    "image": row.image,
                    "kind": row.kind,
                    "exited": row.exited,
                    "killed": row.killed,
                    "overrun": row.overrun,
                    "reclamations": row.reclamations,
                    "share": round(row.failed_share, 6),
                    "budget": self.policy.budget,
                },
            )

    def flagged(self, image: str, kind: str) -> bool:
        row = self.rows.get((image, kind))
        return row is not None and row.flagged_at is not None

    def keeps_off_spot(self, image: str, kind: str) -> bool:
        """Whether the gate must keep this image off spot nodes (--no-spot-for-flagged)."""
        return self.policy.no_spot_for_flagged and self.flagged(image, kind)

    def samples(self) -> list[tuple[list[str], float]]:
        """spotdrain_workload_reclamations{image, kind, end}."""
        out = []
        for (image, kind), row in sorted(self.rows.items()):
            for end, n in (
                ("exited", row.exited),
                ("killed", row.killed),
                ("overrun", row.overrun),
            ):
                out.append(([image, kind, end], float(n)))
        return out

    def flagged_samples(self) -> list[tuple[list[str], float]]:
        """spotdrain_workload_contract_flagged{image, kind}: 1 flagged, 0 not."""
        return [
            ([image, kind], 1.0 if row.flagged_at is not None else 0.0)
            for (image, kind), row in sorted(self.rows.items())
        ]
