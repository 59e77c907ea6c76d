"""The rental record (coordinator/core/rental.py), pure: who ended a rental, and when the renter
is told it ends. Times are explicit numbers; nothing sleeps."""

from __future__ import annotations

import pytest

from spotdrain.coordinator.core.rental import Rental


def rental(spot: bool = False, running: bool = True) -> Rental:
    r = Rental("r-1", "node-a", "acme", "alice", "img", 1, started_at=0.0, started_on_spot=spot)
    if running:
        r.started("c-1")
    return r


def test_a_notice_during_a_pause_moves_reclaim_at_earlier_and_never_later():
    r = rental()
    assert r.reclaim("pause-1", "pause", 110.0)
    assert (r.reclaim_at, r.reclaim_id) == (110.0, "pause-1")
    assert r.reclaim("notice-1", "notice", 90.0)
    assert (r.reclaim_at, r.reclaim_id, r.reclaim_reason) == (90.0, "notice-1", "notice")
    assert r.reclaim("notice-2", "notice", 140.0)  # held too, but reclaim_at stays earlier
    assert r.reclaim_at == 90.0
    assert not r.reclaim("notice-1", "notice", 80.0)  # a repeat changes nothing


def test_lifting_one_reclaim_leaves_the_others_in_force():
    """The owner resumes while a notice still holds the node: the renter is told the
    notice's reclaim_at, not that the rental goes on."""
    r = rental()
    r.reclaim("pause-1", "pause", 110.0)
    r.reclaim("notice-1", "notice", 140.0)
    assert r.reclaim_lifted("pause-1", now=60.0)
    assert (r.reclaim_at, r.reclaim_id, r.reclaim_reason) == (140.0, "notice-1", "notice")
    assert r.reclaim_lifted("notice-1", now=61.0)
    assert (r.reclaim_at, r.reclaim_id) == (None, "")


def test_a_lift_after_its_grace_deadline_is_too_late():
    r = rental()
    r.reclaim("pause-1", "pause", 110.0)
    assert not r.reclaim_lifted("pause-1", now=110.0)
    assert r.reclaim_at == 110.0
    r.stopped(110.2, 137)
    assert r.ended_by == "provider"


@pytest.mark.parametrize(
    "spot, reclaims, ended_by",
    [
        (False, [("pause-1", "pause", 110.0)], "provider"),
        (True, [("pause-1", "pause", 110.0)], "reclaim"),
        (False, [("notice-1", "notice", 90.0)], "reclaim"),
        # A notice on top of an owner's pause (even one with an earlier G) does not turn the
        # provider's broken promise into a neutral reclaim.
        (False, [("pause-1", "pause", 110.0), ("notice-1", "notice", 90.0)], "provider"),
        (False, [], "renter"),  # its own workload exited
    ],
)
def test_who_ended_a_rental_whose_container_stopped(spot, reclaims, ended_by):
    r = rental(spot=spot)
    for rid, reason, grace in reclaims:
        r.reclaim(rid, reason, grace)
    assert r.stopped(120.0, 137)
    assert (r.state, r.ended_by, r.exit_code, r.ended_at) == ("ended", ended_by, 137, 120.0)


def test_one_that_never_ran_or_vanished_blames_nobody():
    never = rental(running=False)
    never.stopped(5.0, None, "refused: node is paused by its owner")
    assert (never.ended_by, never.detail) == ("platform", "refused: node is paused by its owner")
    gone = rental()
    gone.stopped(5.0, None, "gone", vanished=True)
    assert gone.ended_by == "platform"


def test_an_ended_rental_holds_its_gpus_until_its_container_stopped():
    r = rental()
    assert r.end(50.0, "renter")
    assert (r.active, r.releasing, r.holds_gpus) == (False, True, True)
    assert not r.end(51.0, "provider")  # ended once
    assert r.stopped(52.0, 143)
    assert (r.holds_gpus, r.exit_code, r.ended_by, r.ended_at) == (False, 143, "renter", 50.0)
    starting = rental(running=False)
    starting.end(1.0, "platform")
    assert not starting.holds_gpus  # never ran: nothing to wait for


def test_a_reclaim_or_a_lift_does_nothing_to_an_ended_rental():
    r = rental()
    r.end(50.0, "renter")
    assert not r.reclaim("pause-1", "pause", 110.0)
    assert r.reclaim_at is None


def test_the_record_survives_the_store():
    r = rental()
    r.reclaim("pause-1", "pause", 110.0)
    r.reclaim("notice-1", "notice", 90.0)
    again = Rental.from_json(r.to_json())
    assert again == r
    with pytest.raises(ValueError, match="unknown fields"):
        Rental.from_json({**r.to_json(), "bogus": 1})
    with pytest.raises(ValueError):
        r.end(1.0, "reclaim")  # a reclaim is not something anyone ends a rental with
