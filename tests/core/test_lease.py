"""The leader lease as a pure state machine (coordinator/replicas/lease.py): events and a fake clock
in, commands out. No database, no asyncio."""

from __future__ import annotations

import pytest

from spotdrain.coordinator.replicas import lease as lm
from spotdrain.protocol.machine import InvalidTransition

TTL, RENEW = 2.0, 0.5


@pytest.fixture
def lease():
    machine = lm.Lease(TTL, RENEW)
    yield machine
    machine.validate()  # the invariants hold whatever the test did


def lead(machine: lm.Lease, now: float = 0.0, term: int = 1) -> None:
    assert machine.handle(lm.Tick(now)) == [lm.Acquire()]
    assert machine.handle(lm.Renewed(now, term, now + TTL)) == [lm.Lead(term)]


def test_a_follower_takes_a_free_lease_and_leads_at_its_term(lease):
    """A replica starts, tries, the database gives it term 7: it leads, and only inside its
    own expiry."""
    assert lease.state == lm.FOLLOWER
    assert lease.handle(lm.Tick(10.0)) == [lm.Acquire()]
    assert lease.state == lm.CANDIDATE
    assert lease.handle(lm.Tick(10.1)) == []  # one try at a time
    assert lease.handle(lm.Renewed(10.2, 7, 12.0)) == [lm.Lead(7)]
    assert lease.state == lm.LEADER and lease.term == 7
    assert lease.leads(11.9) and not lease.leads(12.0)


def test_a_held_lease_makes_a_follower_that_knows_the_leader_and_retries_at_its_expiry(lease):
    """Another replica holds the lease for 0.2 s more: this one follows it and tries again just
    after that lease would run out, not a whole renewal interval later."""
    lease.handle(lm.Tick(0.0))
    assert lease.handle(lm.Lost(0.0, "b:7443 x", 0.2)) == [lm.Follow("b:7443 x")]
    assert lease.state == lm.FOLLOWER and not lease.leads(0.0)
    assert lease.handle(lm.Tick(0.2)) == []
    assert lease.handle(lm.Tick(0.215)) == [lm.Acquire()]


def test_a_long_held_lease_is_asked_about_every_renewal_interval(lease):
    """The leader keeps renewing: a follower asks again every renew_s (to learn of a new
    leader), never waiting out a TTL it cannot see."""
    lease.handle(lm.Tick(0.0))
    lease.handle(lm.Lost(0.0, "b:7443 x", 1.9))
    assert lease.wake_at() == pytest.approx(RENEW)


def test_a_database_that_does_not_answer_leaves_a_candidate_following_no_one(lease):
    lease.handle(lm.Tick(0.0))
    assert lease.handle(lm.RenewFailed(0.5, "timeout")) == [lm.Follow("")]
    assert lease.state == lm.FOLLOWER
    assert lease.handle(lm.Tick(1.0)) == [lm.Acquire()]


def test_the_leader_renews_every_interval_and_its_expiry_moves_on(lease):
    lead(lease)
    assert lease.handle(lm.Tick(0.4)) == []
    assert lease.handle(lm.Tick(0.5)) == [lm.Renew(1)]
    assert lease.handle(lm.Tick(0.6)) == []  # that renewal is still in flight
    assert lease.handle(lm.Renewed(0.55, 1, 2.5)) == []
    assert lease.until == 2.5 and lease.leads(2.4)
    assert lease.handle(lm.Tick(1.0)) == [lm.Renew(1)]


def test_a_leader_that_cannot_renew_steps_down_by_itself_at_its_own_expiry(lease):
    """The database stops answering: the leader retries, keeps leading until its own expiry,
    and then steps down without being told, before any other replica may take the lease."""
    lead(lease)
    assert lease.handle(lm.Tick(0.5)) == [lm.Renew(1)]
    assert lease.handle(lm.RenewFailed(1.0, "no answer")) == []
    assert lease.state == lm.LEADER and lease.leads(1.0)
    assert lease.handle(lm.Tick(1.0)) == [lm.Renew(1)]  # at once, not an interval later
    assert lease.handle(lm.RenewFailed(1.9, "no answer")) == []
    [step_down] = lease.handle(lm.Tick(2.0))
    assert isinstance(step_down, lm.StepDown) and step_down.term == 1
    assert lease.state == lm.FOLLOWER and not lease.leads(2.0)


def test_a_leader_resumed_after_a_stop_steps_down_on_its_first_tick(lease):
    """SIGSTOPped at 0.3, resumed at 9.0: its first tick is past its expiry. It steps down
    before renewing anything."""
    lead(lease)
    commands = lease.handle(lm.Tick(9.0))
    assert [type(c) for c in commands] == [lm.StepDown]
    assert not any(isinstance(c, lm.Renew) for c in commands)


def test_a_renewal_answered_after_the_expiry_is_not_trusted(lease):
    lead(lease)
    lease.handle(lm.Tick(0.5))
    [step_down] = lease.handle(lm.Renewed(2.1, 1, 2.5))
    assert isinstance(step_down, lm.StepDown)


def test_a_leader_whose_term_is_gone_steps_down_and_follows_the_new_one(lease):
    """A write refused by its term, or a renewal that finds another holder."""
    lead(lease)
    lease.handle(lm.Tick(0.5))
    commands = lease.handle(lm.Lost(0.6, "b:7443 y", 1.5, "term 1 is no longer the lease's"))
    assert commands == [
        lm.StepDown(1, "term 1 is no longer the lease's"),
        lm.Follow("b:7443 y"),
    ]
    assert lease.state == lm.FOLLOWER


def test_a_new_term_must_be_higher_than_the_last(lease):
    """The term only grows: a database handing back a term this replica already led is a
    broken lease, not a leadership."""
    lead(lease, term=3)
    lease.handle(lm.Lost(0.6, "b:7443 y", 0.0))
    lease.handle(lm.Tick(1.0))
    with pytest.raises(InvalidTransition) as e:
        lease.handle(lm.Renewed(1.1, 3, 3.0))
    assert "term 3 again" in str(e.value)
    lease.state = lm.FOLLOWER  # leave it valid for the fixture's check


def test_only_the_listed_transitions_are_made():
    assert set(lm.TRANSITIONS) == {
        (lm.FOLLOWER, lm.CANDIDATE),
        (lm.CANDIDATE, lm.LEADER),
        (lm.CANDIDATE, lm.FOLLOWER),
        (lm.LEADER, lm.LEADER),
        (lm.LEADER, lm.FOLLOWER),
    }
    machine = lm.Lease(TTL, RENEW)
    with pytest.raises(InvalidTransition):
        machine.move(lm.LEADER, 0.0, "a follower cannot lead without a term")


def test_a_renewal_interval_at_or_above_the_ttl_is_refused():
    with pytest.raises(ValueError, match="below the TTL"):
        lm.Lease(2.0, 2.0)
