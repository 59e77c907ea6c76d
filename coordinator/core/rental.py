"""A rental as the coordinator keeps it: who rents which node from whom, and how it ended.

Pure: each method takes the time and what happened, changes the record and says whether it
changed (the shell then stores it and tells the rental's watchers). No clock, no I/O.

    starting -> running   the agent started the renter's container
    starting -> ended     refused by the agent, or ended before it ran
    running  -> ended     its container stopped, or someone ended it

Who ended it (`ended_by`) is what reputation counts (coordinator/core/reputation.py):

- `renter`, `provider`, `platform`: whoever called EndRental (a renter's call is always
  `renter`). A container that exits on its own ends its rental as `renter`: the renter's
  workload finished. One refused or gone without a trace (found missing when its node came
  back) ends as `platform`: nobody can be blamed for it.
- A pause or a notice sets `reclaim_at` (the grace deadline G; the agent stops the container
  then, not before). When the container stops under that reclaim, the rental ends as `reclaim`,
  except when an owner's pause is among the reclaims of a rental that started on an on-demand
  node: the provider took back what it promised, so that is `provider` (and counts against it),
  even if a notice with an earlier G came on top. On spot, reclaiming is what spot means
  (docs/design.md invariant 9).

Several reclaims can hold a rental at once (a notice during a pause). Each is kept with its G;
`reclaim_at` is the earliest, so it only ever moves earlier while they hold (invariant 2). A
reclaim lifted before its G (a resume, a cancelled notice) leaves the others in force; one
lifted after its G is too late: the container was due to stop, and the end stays the reclaim's.

A rental ended through the API keeps its GPUs (`releasing`) until the agent reports its
container stopped, so nothing else is placed on them while it still runs.

`started_on_spot` is fixed at creation; nothing here ever changes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spotdrain.protocol.records import refuse_unknown_fields

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
    # The earliest of `reclaims` (what the renter is told), "" / None when none holds it.
    reclaim_at: float | None = None
    reclaim_id: str = ""
    reclaim_reason: str = ""  # "pause" | "notice"
    reclaims: dict[str, tuple[str, float]] = field(default_factory=dict)  # id -> (reason, G)
    container: str = ""
    exit_code: int | None = None
    detail: str = ""
    releasing: bool = False  # ended, its container not yet reported stopped

    @property
    def active(self) -> bool:
        return self.state != ENDED

    @property
    def holds_gpus(self) -> bool:
        return self.active or self.releasing

    @property
    def owner_paused(self) -> bool:
        return any(reason == "pause" for reason, _ in self.reclaims.values())

    def reclaim(self, reclaim_id: str, reason: str, grace_deadline: float) -> bool:
        """A pause or a notice on the node: the renter is told `reclaim_at` = G. Whether
        anything changed (a repeat of the same reclaim changes nothing)."""
        if not self.active or reclaim_id in self.reclaims:
            return False
        self.reclaims[reclaim_id] = (reason, grace_deadline)
        self._earliest()
        return True

    def reclaim_lifted(self, reclaim_id: str, now: float) -> bool:
        """The owner resumed (or the notice was cancelled) before its G: that reclaim goes;
        the rental goes on unless another one holds it."""
        if not self.active or reclaim_id not in self.reclaims:
            return False
        if now >= self.reclaims[reclaim_id][1]:
            return False  # too late: the container was due to stop at G
        del self.reclaims[reclaim_id]
        self._earliest()
        return True

    def _earliest(self) -> None:
        if not self.reclaims:
            self.reclaim_at, self.reclaim_id, self.reclaim_reason = None, "", ""
            return
        rid, (reason, grace) = min(self.reclaims.items(), key=lambda kv: (kv[1][1], kv[0]))
        self.reclaim_at, self.reclaim_id, self.reclaim_reason = grace, rid, reason

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
        only the exit code is filled in and its GPUs are free."""
        if not self.active:
            changed = self.releasing or (self.exit_code is None and exit_code is not None)
            self.releasing = False
            if self.exit_code is None:
                self.exit_code = exit_code
            return changed
        if self.reclaims:
            ended_by = "reclaim"
            if self.owner_paused and not self.started_on_spot:
                ended_by = "provider"
        elif self.state == STARTING or vanished:
            ended_by = "platform"  # it never ran (refused, failed to start), or it is just gone
        else:
            ended_by = "renter"  # the renter's workload exited on its own
        self._end(now, ended_by)
        self.exit_code = exit_code
        self.detail = detail or self.detail
        return True

    def lost(self, now: float, detail: str) -> bool:
        """Its node was lost without notice (coordinator/fleet/lost.py): ended as `lost`, its
        GPUs free (the node is gone; a container it still runs is stopped if it returns)."""
        if not self.active:
            return False
        self.releasing = False
        self._end(now, "lost")
        self.detail = detail
        return True

    def end(self, now: float, ended_by: str) -> bool:
        """EndRental: ended now, by `ended_by`; the shell stops the container."""
        if ended_by not in END_CALLERS:
            raise ValueError(f"ended_by must be one of {END_CALLERS}, got {ended_by!r}")
        if not self.active:
            return False
        # Its container may still run (the agent stops it now): its GPUs stay booked until
        # the agent says it stopped. One that never ran holds nothing.
        self.releasing = self.state == RUNNING
        self._end(now, ended_by)
        return True

    def _end(self, now: float, ended_by: str) -> None:
        self.state = ENDED
        self.ended_at = now
        self.ended_by = ended_by

    # --- persistence -----------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc["reclaims"] = {rid: list(v) for rid, v in self.reclaims.items()}
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Rental:
        refuse_unknown_fields(doc, (f.name for f in dataclasses.fields(cls)), "rental record")
        if doc.get("state", STARTING) not in STATES:
            raise ValueError(f"rental record has unknown state {doc['state']!r}")
        fields = dict(doc)
        fields["reclaims"] = {
            rid: (str(reason), float(grace))
            for rid, (reason, grace) in fields.get("reclaims", {}).items()
        }
        return cls(**fields)
