"""The one state-machine base (spotdrain/protocol/machine.py) that the worker, the leader lease
and the reclamation share: a table keyed on (start, finish), one InvalidTransition carrying the
story, a bounded story, and a validate() that raises even under `python -O`."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from spotdrain.agent.core import reclamation as rm
from spotdrain.agent.core.notice import Notice
from spotdrain.agent.core.reclamation_record import PHASE_TRANSITIONS
from spotdrain.agent.core.signal_ledger import LEDGER_TRANSITIONS
from spotdrain.coordinator.core import worker_machine as wm
from spotdrain.coordinator.replicas import lease as lm
from spotdrain.protocol.machine import (
    InvalidState,
    InvalidTransition,
    StateMachine,
    StoryEntry,
    Table,
)

SHUT, OPEN, JAMMED = "shut", "open", "jammed"


class Valve(StateMachine[str, str]):
    """The smallest machine: shut <-> open, and jammed (a state no move reaches)."""

    table = Table("valve", {(SHUT, OPEN): "opened", (OPEN, SHUT): "closed"})
    story_limit = 4

    def __init__(self) -> None:
        self.state = SHUT
        self.story: list[StoryEntry[str]] = []

    @property
    def ident(self) -> str:
        return "v-1"


def test_a_move_outside_the_table_raises_with_the_story_and_changes_nothing() -> None:
    """A handler that asks for a move the table lacks is a bug: the error names the machine,
    its id, the move, and tells what happened before, including the refused attempt."""
    valve = Valve()
    assert valve.move(OPEN, 1.0, "Turn") == "opened"
    valve.note(2.0, "Turn(ignored)")
    with pytest.raises(InvalidTransition) as caught:
        valve.move(OPEN, 3.0, "Turn")
    assert valve.state == OPEN
    error = caught.value
    assert (error.machine, error.ident, error.start, error.finish) == ("valve", "v-1", OPEN, OPEN)
    assert (
        error.story
        == valve.story
        == [
            (1.0, "Turn", SHUT, OPEN),
            (2.0, "Turn(ignored)", OPEN, OPEN),
            (3.0, "Turn(invalid)", OPEN, OPEN),
        ]
    )
    message = str(error)
    assert message.startswith("valve v-1: open -> open: not in the table; story:")
    assert "1.000 Turn: shut -> open" in message and "3.000 Turn(invalid)" in message


def test_the_story_keeps_only_the_most_recent_moves() -> None:
    """A machine that lives for days (a lease renewing every half second) cannot grow its story
    without bound: the oldest entries go first."""
    valve = Valve()
    for i in range(10):
        valve.move(OPEN if valve.state == SHUT else SHUT, float(i), f"Turn {i}")
    assert [cause for _, cause, _, _ in valve.story] == ["Turn 6", "Turn 7", "Turn 8", "Turn 9"]
    valve.validate()


def test_validate_names_an_unknown_state_and_an_overlong_story() -> None:
    valve = Valve()
    valve.state = JAMMED
    valve.story = [(float(i), "Seeded", SHUT, SHUT) for i in range(5)]
    with pytest.raises(InvalidState) as caught:
        valve.validate()
    assert caught.value.broken == ["unknown state 'jammed'", "story of 5 entries, above 4"]
    assert str(caught.value) == "valve v-1: unknown state 'jammed'; story of 5 entries, above 4"


def test_a_guard_that_refuses_a_tabled_move_raises_the_same_error() -> None:
    """The lease's candidate -> leader is in the table, but not at a term it already led."""
    lease = lm.Lease(2.0, 0.5)
    lease.term = 3
    lease.handle(lm.Tick(0.0))
    with pytest.raises(InvalidTransition) as caught:
        lease.handle(lm.Renewed(0.1, 3, 2.1))
    assert caught.value.why == "term 3 again"
    assert caught.value.story[-1] == (0.1, "Renewed(refused)", lm.CANDIDATE, lm.LEADER)


def reclamation() -> rm.Reclamation:
    notice = Notice("key-1", "n-1", "terminate", 1120.0, "file")
    rec, _ = rm.Reclamation.begin(notice, "gpu-7", 1000.0, rm.Margins())
    return rec


def test_all_three_machines_share_the_base() -> None:
    """One table type, one InvalidTransition, one InvalidState for the worker, the lease, the
    reclamation's phase and its signal ledger."""
    for table in (wm.TRANSITIONS, lm.TRANSITIONS, PHASE_TRANSITIONS, LEDGER_TRANSITIONS):
        assert isinstance(table, Table)
    worker = wm.Worker("w-1", "gpu-7", "m", "img", 8000, 8, 900.0)
    lease = lm.Lease(2.0, 0.5)
    rec = reclamation()
    for machine, wrong in ((worker, wm.STARTING), (lease, lm.LEADER), (rec, "tainting")):
        assert isinstance(machine, StateMachine)
        with pytest.raises(InvalidTransition):
            machine.move(wrong, 1001.0, "Test")
        machine.validate()


def test_the_reclamation_phase_moves_only_along_its_table() -> None:
    """tainting -> draining -> done, or tainting -> done; never back, never skipping the taint
    the other way round; each move told in the story (kept out of the stored bundle)."""
    assert set(PHASE_TRANSITIONS) == {
        ("tainting", "draining"),
        ("tainting", "done"),
        ("draining", "done"),
    }
    rec = reclamation()
    rec.handle(rm.TaintAnswered(1000.05))
    assert rec.phase == "draining"
    assert rec.story[0] == (1000.05, "tainted (remote)", "tainting", "draining")
    with pytest.raises(InvalidTransition, match="draining -> tainting"):
        rec.move("tainting", 1000.1, "Test")
    assert "story" not in rec.to_json()


def test_a_bundle_stored_before_the_base_loads_and_is_stored_the_same() -> None:
    """The base adds nothing to the bundle: a bundle written by the previous agent (every field
    as it stores them) loads, and is written back key for key."""
    rec = reclamation()
    rec.handle(rm.TaintAnswered(1000.05))
    stored = rec.to_json()
    assert set(stored) == STORED_FIELDS
    again = rm.Reclamation.from_json(stored)
    assert again == rec and again.to_json() == stored and again.story == []


# The bundle's fields as agents store them (agent/drain/state.py); the base adds none.
STORED_FIELDS = set(
    """
    reclaim_id node_id notice_key notice_id source reason t0 terminate_at grace_deadline
    overrun_at observe_every_s taint_answer_by taint_answer_s phase taint_mode remote_taint
    sigterm_round sigterm_round_done sigkill_round rounds_in_flight signalled names gated exited
    observing observe_again next_observe_at last_failure verified_at outcome resumed
    lift_acknowledged sigterm_at heard_action heard_terminate_at later_recorded_at
    later_unrecorded pending_reports announced sigterm_by_previous_run cancel_recorded
    lifted_by_cancel signal_announced
    """.split()
)

UNDER_O = textwrap.dedent(
    """
    from spotdrain.agent.core.advisories import AdvisoryBook, Entry
    from spotdrain.agent.core.notice import Notice
    from spotdrain.agent.core.reclamation import Margins, Reclamation
    from spotdrain.coordinator.core.worker_machine import READY, Worker
    from spotdrain.coordinator.replicas.lease import LEADER, Lease
    from spotdrain.agent.notices.settings import AdvisoryPolicy
    from spotdrain.protocol.machine import InvalidState

    assert False, "asserts run: this is not python -O"
    worker = Worker("w-1", "gpu-7", "m", "img", 8000, 8, 900.0, state=READY)  # no gate
    lease = Lease(2.0, 0.5)
    lease.state = LEADER  # no term, no expiry
    rec, _ = Reclamation.begin(Notice("k", "n", "terminate", 1120.0, "file"), "gpu-7", 1000.0,
                               Margins())
    rec.phase = "vanished"
    book = AdvisoryBook(AdvisoryPolicy())
    book.entries["a-1"] = Entry("a-1", "aws", "rebalance", 10.0, 5.0, state="lifted")
    for machine in (worker, lease, rec, book):
        try:
            machine.validate()
        except InvalidState as e:
            print(e)
        else:
            print("not raised")
    """
)


def test_validate_raises_under_python_minus_o() -> None:
    """An agent run with `python -O` (or PYTHONOPTIMIZE set by a packager) strips every
    `assert`; the machines' invariants (and the advisory book's) must still be checked."""
    result = subprocess.run(
        [sys.executable, "-O", "-c", UNDER_O], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "worker w-1: ready without a gate",
        "lease term 0: leader without a term or an expiry",
        f"reclamation {rm.reclaim_id_for('gpu-7', 'k')}: unknown state 'vanished'",
        "advisory book: a-1: lifted with lifted_at None; a-1: expires before it was received",
    ]
