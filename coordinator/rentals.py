"""A rental as the coordinator keeps it: who rents which node from whom, and how it ended.

Pure: each method takes the time and what happened, changes the record and says whether it
changed (the shell then stores it and tells the rental's watchers). No clock, no I/O.

    starting -> running   the agent started the renter's container
    starting -> ended     refused by the agent, or ended before it ran
    running  -> ended     its container stopped, or someone ended it

Who ended it (`ended_by`) is what reputation counts (coordinator/reputation.py):

- `renter`, `provider`, `platform`: whoever called EndRental (a renter's call is always
  `renter`). A container that exits on its own ends its rental as `renter`: the renter's
  workload finished. One refused or gone without a trace (found missing when its node came
  back) ends as `platform`: nobody can be blamed for it.
- A pause or a notice sets `reclaim_at` (the grace deadline G; the agent stops the container
  then, not before). When the container stops under that reclaim, the rental ends as `reclaim`,
  except an owner's pause of a rental that started on an on-demand node: the provider took back
  what it promised, so that is `provider` (and counts against it). On spot, reclaiming is what
  spot means (DESIGN.md invariant 9).

`started_on_spot` is fixed at creation; nothing here ever changes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

STARTING = "starting"
RUNNING = "running"
ENDED = "ended"
STATES = (STARTING, RUNNING, ENDED)
END_CALLERS = ("renter", "provider", "platform")  # who may end a rental through the API


@dataclass
class Rental:
    rental_id: str
    node_id: str
    provider: str
    renter: str
    image: str
    gpus: int
    started_at: float
    started_on_spot: bool
    state: str = STARTING
    ended_at: float | None = None
    ended_by: str = ""
    reclaim_at: float | None = None
    reclaim_id: str = ""
    reclaim_reason: str = ""  # "pause" | "notice"
    container: str = ""
    exit_code: int | None = None
    detail: str = ""

    @property
    def active(self) -> bool:
        return self.state != ENDED

    def reclaim(self, reclaim_id: str, reason: str, grace_deadline: float) -> bool:
        """A pause or a notice on the node: the renter is told `reclaim_at` = G. An earlier G
        (a notice during a pause) moves it earlier; nothing moves it later (invariant 2)."""
        if not self.active:
            return False
        if self.reclaim_at is not None and self.reclaim_at <= grace_deadline:
            return False
        self.reclaim_at = grace_deadline
        self.reclaim_id = reclaim_id
        self.reclaim_reason = reason
        return True

    def reclaim_lifted(self, reclaim_id: str) -> bool:
        """The owner resumed (or the notice was cancelled) before G: the rental goes on."""
        if not self.active or self.reclaim_id != reclaim_id:
            return False
        self.reclaim_at = None
        self.reclaim_id = ""
        self.reclaim_reason = ""
        return True

    def started(self, container: str) -> bool:
        if self.state != STARTING:
            return False
        self.state = RUNNING
        self.container = container
        return True

    def stopped(
        self, now: float, exit_code: int | None, detail: str = "", vanished: bool = False
    ) -> bool:
        """Its container stopped (or was refused, or `vanished` while the node was away: why is
        unknown, so nobody is blamed). Ends the rental if it was not ended already; otherwise
        only the exit code is filled in."""
        if not self.active:
            if self.exit_code is None and exit_code is not None:
                self.exit_code = exit_code
                return True
            return False
        if self.reclaim_at is not None:
            ended_by = "reclaim"
            if self.reclaim_reason == "pause" and not self.started_on_spot:
                ended_by = "provider"
        elif self.state == STARTING or vanished:
            ended_by = "platform"  # it never ran (refused, failed to start), or it is just gone
        else:
            ended_by = "renter"  # the renter's workload exited on its own
        self._end(now, ended_by)
        self.exit_code = exit_code
        self.detail = detail or self.detail
        return True

    def end(self, now: float, ended_by: str) -> bool:
        """EndRental: ended now, by `ended_by`; the shell stops the container."""
        if ended_by not in END_CALLERS:
            raise ValueError(f"ended_by must be one of {END_CALLERS}, got {ended_by!r}")
        if not self.active:
            return False
        self._end(now, ended_by)
        return True

    def _end(self, now: float, ended_by: str) -> None:
        self.state = ENDED
        self.ended_at = now
        self.ended_by = ended_by

    # --- persistence -----------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Rental:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(doc) - names
        if unknown:
            raise ValueError(f"rental record has unknown fields {sorted(unknown)}")
        if doc.get("state", STARTING) not in STATES:
            raise ValueError(f"rental record has unknown state {doc['state']!r}")
        return cls(**doc)
