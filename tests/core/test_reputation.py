"""Reputation: the formula with small and large counts, its monotonicity, and spot left out."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spotdrain.coordinator.core.reputation import (
    ENDED_BY,
    RentalOutcome,
    Score,
    node_score,
    provider_score,
)

_ids = itertools.count()


def rental(
    ended_by: str | None,
    *,
    spot: bool = False,
    node: str = "n1",
    provider: str = "p1",
) -> RentalOutcome:
    return RentalOutcome(
        rental_id=f"r{next(_ids)}",
        node_id=node,
        provider=provider,
        started_on_spot=spot,
        ended_by=ended_by,
    )


def many(n: int, ended_by: str | None, **kw) -> list[RentalOutcome]:
    return [rental(ended_by, **kw) for _ in range(n)]


@pytest.mark.parametrize(
    ("successes", "failures", "expected"),
    [
        (0, 0, 0.8),  # no rentals: the prior
        (1, 0, 5 / 6),
        (0, 1, 4 / 6),
        (0, 2, 4 / 7),
        (5, 0, 9 / 10),
        (10, 10, 14 / 25),
        (990, 10, 994 / 1005),
        (0, 1000, 4 / 1005),
    ],
)
def test_score_table(successes: int, failures: int, expected: float) -> None:
    outcomes = many(successes, "renter") + many(failures, "provider")
    score = node_score(outcomes, "n1")
    assert score == Score(
        value=pytest.approx(expected),
        successes=successes,
        failures=failures,
        counted=successes + failures,
        excluded_spot=0,
    )


def test_one_failure_scores_below_one_success_and_neither_decides_alone() -> None:
    """A newcomer's single rental moves the score, but never to 0 or 1."""
    failed = node_score([rental("provider")], "n1").value
    succeeded = node_score([rental("renter")], "n1").value
    assert 0.5 < failed < 0.8 < succeeded < 0.9


def test_large_record_approaches_the_plain_ratio() -> None:
    """1000 rentals with 10 provider-ended: close to 99 %, and above a perfect 5-rental record."""
    veteran = node_score(many(990, "platform") + many(10, "provider"), "n1").value
    newcomer = node_score(many(5, "renter"), "n1").value
    assert veteran == pytest.approx(0.989, abs=1e-3)
    assert veteran > newcomer


def test_what_counts() -> None:
    """renter/platform succeed, provider fails, on-demand reclaim is neutral, running waits."""
    outcomes = [
        rental("renter"),
        rental("platform"),
        rental("provider"),
        rental("reclaim"),
        rental(None),
        rental("provider", spot=True),
        rental("reclaim", spot=True),
        rental(None, spot=True),
    ]
    assert node_score(outcomes, "n1") == Score(
        value=pytest.approx(6 / 8),
        successes=2,
        failures=1,
        counted=3,
        excluded_spot=3,
        neutral_reclaims=1,
    )


def test_node_and_provider_scores_select_their_own_rentals() -> None:
    """A provider's score spans all its nodes; a node's score ignores its neighbours."""
    outcomes = [
        rental("provider", node="n1", provider="alice"),
        rental("renter", node="n2", provider="alice"),
        rental("provider", node="n3", provider="bob"),
    ]
    assert node_score(outcomes, "n1").failures == 1
    assert node_score(outcomes, "n2").successes == 1
    alice = provider_score(outcomes, "alice")
    assert (alice.successes, alice.failures) == (1, 1)
    assert provider_score(outcomes, "carol") == Score(0.8, 0, 0, 0, 0)


def test_the_last_record_of_a_rental_wins() -> None:
    """A rental seen running, then ended by its provider, counts once, as ended."""
    running = RentalOutcome("r-x", "n1", "p1", False, None)
    ended = RentalOutcome("r-x", "n1", "p1", False, "provider")
    score = node_score([running, ended], "n1")
    assert (score.successes, score.failures, score.counted) == (0, 1, 1)


def test_unknown_ending_is_refused() -> None:
    with pytest.raises(ValueError, match="r-bad: ended_by must be one of"):
        RentalOutcome("r-bad", "n1", "p1", False, "owner")


def test_spot_reclaim_moves_neither_score_but_provider_ending_on_demand_lowers_both() -> None:
    """The owner reclaims a spot node mid-rental: neither the node nor its provider is marked.
    The same rental on an on-demand node, ended by its provider, lowers both."""
    history = many(3, "renter", node="n1", provider="alice")
    node_before = node_score(history, "n1")
    provider_before = provider_score(history, "alice")

    on_spot = history + [rental("reclaim", spot=True, node="n1", provider="alice")]
    assert node_score(on_spot, "n1").value == node_before.value
    assert provider_score(on_spot, "alice").value == provider_before.value
    assert node_score(on_spot, "n1").excluded_spot == 1

    on_demand = history + [rental("provider", spot=False, node="n1", provider="alice")]
    assert node_score(on_demand, "n1").value < node_before.value
    assert provider_score(on_demand, "alice").value < provider_before.value


# --- properties -------------------------------------------------------------------------------

_endings = st.sampled_from((*ENDED_BY, None))


@st.composite
def histories(draw) -> list[RentalOutcome]:
    """Rentals on two nodes of two providers, spot and not, every ending, ids unique."""
    n = draw(st.integers(0, 40))
    return [
        RentalOutcome(
            rental_id=f"h{i}",
            node_id=draw(st.sampled_from(("n1", "n2"))),
            provider=draw(st.sampled_from(("alice", "bob"))),
            started_on_spot=draw(st.booleans()),
            ended_by=draw(_endings),
        )
        for i in range(n)
    ]


def _both(outcomes: list[RentalOutcome]) -> tuple[float, float]:
    return node_score(outcomes, "n1").value, provider_score(outcomes, "alice").value


def _extra(ended_by: str | None, spot: bool, i: int = 0) -> RentalOutcome:
    return RentalOutcome(f"extra{i}", "n1", "alice", spot, ended_by)


@given(histories(), st.sampled_from(("renter", "platform")))
def test_one_more_success_never_lowers_a_score(history, ended_by) -> None:
    before = _both(history)
    after = _both(history + [_extra(ended_by, spot=False)])
    assert after[0] >= before[0] and after[1] >= before[1]


@given(histories())
def test_one_more_provider_ended_rental_never_raises_a_score(history) -> None:
    before = _both(history)
    after = _both(history + [_extra("provider", spot=False)])
    assert after[0] < before[0] and after[1] < before[1]


@given(histories(), st.lists(_endings, max_size=30))
def test_spot_rentals_never_change_either_score(history, spot_endings) -> None:
    """Invariant 9: any number of spot rentals, ended any way, leave both scores as they were."""
    extra = [_extra(e, spot=True, i=i) for i, e in enumerate(spot_endings)]
    with_spot = history + extra
    assert _both(with_spot) == _both(history)
    assert node_score(with_spot, "n1").counted == node_score(history, "n1").counted
