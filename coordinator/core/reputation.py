"""Node and provider reputation from how rentals went. Pure: outcomes in, a score out.

The score is the mean of a Beta(4, 1) prior updated with the counted rentals:

    score = (successes + 4) / (successes + failures + 5)

A node or provider with no counted rentals scores 0.8 (the prior). One failure moves a newcomer to
0.67 and one success to 0.83, so a single rental never decides a reputation; with many rentals the
score tends to the plain success ratio (1000 rentals, 10 failures: 994 / 1005 = 0.989). It is
monotone: one more success never lowers it, one more failure always lowers it.

What counts (by `ended_by` of a rental):

- started on a spot node, whatever the ending: left out of both scores entirely (docs/design.md
  invariant 9: reclaiming is what spot means). Counted in `excluded_spot`.
- `renter` or `platform`: a success; the rental ran until someone other than its provider ended it.
- `provider`: a failure, for the node and for its provider.
- `reclaim` on an on-demand node: neutral, not counted (seen in `neutral_reclaims`). On an
  on-demand node a reclaim is a notice from the host's cloud (maintenance): the platform's doing,
  not a choice the provider made or could refuse. Counting it as a success would be as wrong, since
  the renter lost the rental. The rentals layer must therefore record an owner's *pause* of an
  on-demand node as `provider`, never `reclaim`, or a provider could walk away unmarked.
- `lost` (its node vanished without notice): neutral like a reclaim, since nobody knows yet
  whose doing it was (hardware, network, the cloud's own bug).
- still running (`None`): not counted yet.

Whether a rental started on spot is fixed when it starts (`started_on_spot`), so changing a node's
spot flag later never rewrites past scores. Outcomes are keyed by `rental_id`: when one rental
appears more than once (a running record, then its end), the last one wins.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

ENDED_BY = ("renter", "provider", "platform", "reclaim", "lost")

# Beta(PRIOR_SUCCESSES, PRIOR_FAILURES): what we believe of a node before its first rental.
PRIOR_SUCCESSES = 4
PRIOR_FAILURES = 1


@dataclass(frozen=True)
class RentalOutcome:
    rental_id: str
    node_id: str
    provider: str
    started_on_spot: bool
    ended_by: str | None  # one of ENDED_BY; None while the rental is still running

    def __post_init__(self) -> None:
        if self.ended_by is not None and self.ended_by not in ENDED_BY:
            raise ValueError(
                f"rental {self.rental_id}: ended_by must be one of {ENDED_BY} or None, "
                f"got {self.ended_by!r}"
            )


@dataclass(frozen=True)
class Score:
    value: float
    successes: int
    failures: int
    counted: int  # successes + failures
    excluded_spot: int  # spot rentals seen and left out (invariant 9)
    neutral_reclaims: int = 0  # on-demand rentals ended by a reclaim: seen, not counted


def score_value(successes: int, failures: int) -> float:
    """The formula of the module docstring."""
    return (successes + PRIOR_SUCCESSES) / (successes + failures + PRIOR_SUCCESSES + PRIOR_FAILURES)


def node_score(outcomes: Iterable[RentalOutcome], node_id: str) -> Score:
    """The reputation of one node, from every rental that ran on it."""
    return _score(outcomes, lambda o: o.node_id == node_id)


def provider_score(outcomes: Iterable[RentalOutcome], provider: str) -> Score:
    """The reputation of one provider, from every rental on any of its nodes."""
    return _score(outcomes, lambda o: o.provider == provider)


def _score(outcomes: Iterable[RentalOutcome], mine: Callable[[RentalOutcome], bool]) -> Score:
    latest = {o.rental_id: o for o in outcomes}  # the last record of a rental wins
    successes = failures = spot = neutral = 0
    for o in latest.values():
        if not mine(o):
            continue
        if o.started_on_spot:
            spot += 1
        elif o.ended_by in ("renter", "platform"):
            successes += 1
        elif o.ended_by == "provider":
            failures += 1
        elif o.ended_by in ("reclaim", "lost"):
            neutral += 1
        # None: still running, not counted yet
    return Score(
        value=score_value(successes, failures),
        successes=successes,
        failures=failures,
        counted=successes + failures,
        excluded_spot=spot,
        neutral_reclaims=neutral,
    )
