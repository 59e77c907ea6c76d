"""The leader lease of coordinator replicas, as a pure state machine (no asyncio, no database).

One replica leads at a time: it holds the lease row in PostgreSQL at a term that only grows
(coordinator/store/postgres.py), renews it every `renew_s`, and every write it makes is fenced
by that term. The machine takes events *and the current time* (monotonic seconds) and returns
commands; the shell (coordinator/replicas/leadership.py) carries them out and feeds back what the
database said as another event.

    follower  --tick, retry due------------------------------> candidate
    candidate --renewed (took it at a new term)--------------> leader
    candidate --lost (another holds it) / renew_failed-------> follower
    leader    --renewed----------------------------------------> leader
    leader    --tick past its own expiry / lost (term gone)---> follower

A leader steps down by itself when it could not renew before its own expiry: `until` is
computed by the shell from when it *sent* the renewal (plus the TTL the database applied), so it
is never later than the expiry the database keeps, whatever the two clocks say.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spotdrain.protocol.machine import StateMachine, StoryEntry, Table

FOLLOWER = "follower"
CANDIDATE = "candidate"
LEADER = "leader"

# Every move the machine may make; anything else raises InvalidTransition.
TRANSITIONS: Table[str, str] = Table(
    "lease",
    {
        (FOLLOWER, CANDIDATE): "the lease may have run out: try to take it",
        (CANDIDATE, LEADER): "took the lease at a new term",
        (CANDIDATE, FOLLOWER): "another replica holds it, or the database did not answer",
        (LEADER, LEADER): "renewed",
        (LEADER, FOLLOWER): "lost the lease, or could not renew before its own expiry",
    },
)


# --- events ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tick:
    now: float


@dataclass(frozen=True)
class Renewed:
    """The database gave us the lease (taken or renewed) at `term`, ours until `until`."""

    now: float
    term: int
    until: float


@dataclass(frozen=True)
class RenewFailed:
    """The database did not answer (down, failing over, too slow): nothing is known."""

    now: float
    why: str


@dataclass(frozen=True)
class Lost:
    """The database says someone else holds the lease (`holder`, for `left_s` more seconds),
    or that a write of ours was refused by our term."""

    now: float
    holder: str = ""
    left_s: float = 0.0
    why: str = ""


# --- commands --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Acquire:
    """Take the lease if it has run out, at the next term."""


@dataclass(frozen=True)
class Renew:
    term: int


@dataclass(frozen=True)
class Lead:
    """Fence every write by `term`, rebuild from the store, serve."""

    term: int


@dataclass(frozen=True)
class StepDown:
    """Refuse every write and stop serving as the leader of `term`."""

    term: int
    why: str


@dataclass(frozen=True)
class Follow:
    """Send callers to `holder` (empty: no leader known)."""

    holder: str


class Lease(StateMachine[str, str]):
    table = TRANSITIONS
    story_limit = 20

    def __init__(self, ttl_s: float, renew_s: float) -> None:
        if not 0 < renew_s < ttl_s:
            raise ValueError(
                f"the renewal interval ({renew_s} s) must be below the TTL ({ttl_s} s)"
            )
        self.ttl_s = ttl_s
        self.renew_s = renew_s
        self.state = FOLLOWER
        self.term = 0  # the term this replica leads (or last led)
        self.until: float | None = None  # a leader's own expiry, monotonic
        self.renew_at = 0.0  # leader: the next renewal; follower: the next try
        self.in_flight = False  # an Acquire or Renew not answered yet
        self.holder = ""  # who leads, as the database last said
        self.story: list[StoryEntry[str]] = []

    @property
    def ident(self) -> str:
        return f"term {self.term}"

    # --- queries -----------------------------------------------------------------------------

    def leads(self, now: float) -> bool:
        """Leader and inside its own expiry: the check each call makes before acting."""
        return self.state == LEADER and self.until is not None and now < self.until

    def wake_at(self) -> float:
        """When the shell should tick next (it also ticks on every answer)."""
        if self.state == LEADER and self.until is not None:
            return min(self.renew_at, self.until)
        # A try in flight: its answer wakes the shell; else at least every renew_s.
        return self.renew_at if not self.in_flight else math.inf

    # --- the one mutator ---------------------------------------------------------------------

    def handle(self, event: Tick | Renewed | RenewFailed | Lost) -> list[object]:
        match event:
            case Tick(now=now):
                return self._tick(now)
            case Renewed(now=now, term=term, until=until):
                return self._renewed(now, term, until)
            case RenewFailed(now=now, why=why):
                return self._failed(now, why)
            case Lost(now=now, holder=holder, left_s=left_s, why=why):
                return self._lost(now, holder, left_s, why)
        raise TypeError(event)

    def _tick(self, now: float) -> list[object]:
        if self.state == LEADER:
            assert self.until is not None
            if now >= self.until:
                return self._step_down(
                    now, f"could not renew before the lease's expiry (term {self.term})"
                )
            if now >= self.renew_at and not self.in_flight:
                self.in_flight = True
                self.renew_at = now + self.renew_s
                return [Renew(self.term)]
            return []
        if self.state == FOLLOWER and now >= self.renew_at and not self.in_flight:
            self.move(CANDIDATE, now, "try")
            self.in_flight = True
            return [Acquire()]
        return []

    def _renewed(self, now: float, term: int, until: float) -> list[object]:
        self.in_flight = False
        if self.state == CANDIDATE:
            if term <= self.term:
                raise self.refuse(LEADER, now, "Renewed", f"term {term} again")
            self.term = term
            self.until = until
            self.renew_at = now + self.renew_s
            self.move(LEADER, now, f"term {term}")
            return [Lead(term)]
        if self.state == LEADER and term == self.term:
            if now >= (self.until or 0.0):
                # The answer came after our own expiry: too late to trust (tick steps down).
                return self._step_down(now, f"renewal of term {term} answered after the expiry")
            self.until = max(self.until or 0.0, until)
            self.move(LEADER, now, "renewed")
            return []
        return []  # an answer for a state we have left: nothing to do

    def _failed(self, now: float, why: str) -> list[object]:
        self.in_flight = False
        if self.state == CANDIDATE:
            self.renew_at = now + self.renew_s
            self.move(FOLLOWER, now, f"no answer: {why}")
            return [Follow("")]
        # A leader keeps leading until its own expiry and tries again at once: tick decides.
        if self.state == LEADER:
            self.renew_at = now
        return []

    def _lost(self, now: float, holder: str, left_s: float, why: str) -> list[object]:
        self.in_flight = False
        self.holder = holder
        # Try again just after its lease would run out, and at least every renew_s (to learn
        # of a new leader's address).
        retry_at = now + min(max(left_s, 0.0) + 0.01, self.renew_s)
        if self.state == LEADER:
            commands = self._step_down(
                now, why or f"term {self.term} lost to {holder or 'another'}"
            )
            self.renew_at = retry_at
            return [*commands, Follow(holder)]
        if self.state == CANDIDATE:
            self.renew_at = retry_at
            self.move(FOLLOWER, now, f"held by {holder}")
            return [Follow(holder)]
        return []

    def _step_down(self, now: float, why: str) -> list[object]:
        term = self.term
        self.until = None
        self.in_flight = False
        self.move(FOLLOWER, now, why)
        return [StepDown(term, why)]

    def move(self, to: str, at: float, cause: str = "") -> str:
        found = super().move(to, at, cause)
        self.validate()  # cheap, and a leader without a term or an expiry must never act
        return found

    def broken_invariants(self) -> list[str]:
        """The machine's invariants (checked after every move, and by the tests at teardown)."""
        broken = super().broken_invariants()
        if self.state == LEADER and (self.term <= 0 or self.until is None):
            broken.append("leader without a term or an expiry")
        if self.state != LEADER and self.until is not None:
            broken.append(f"{self.state} with a leader's expiry")
        return broken
