"""The one base of spotdrain's pure state machines (the worker, the leader lease, the
reclamation): a transition table keyed on (start, finish), one `move` that checks it, a bounded
story of the moves, and a `validate` that raises.

As in dask's worker_state_machine: a move the table does not have is a bug in the machine, so it
raises `InvalidTransition` carrying the machine's recent story to debug it. `validate` raises
`InvalidState` naming every invariant broken; it never uses `assert`, which `python -O` strips.
Pure: no I/O, no clock (every move is given its time).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Generic, TypeVar

S = TypeVar("S", bound=Hashable)  # a state: a string, or None for "not yet" (the signal ledger)
V = TypeVar("V")  # what the table says about a move: why it happens, or what it yields
StoryEntry = tuple[float, str, S, S]  # (at, cause, start, finish)


def _line(entry: tuple[float, str, object, object]) -> str:
    at, cause, start, finish = entry
    return f"  {at:.3f} {cause}: {start} -> {finish}"


class InvalidTransition(Exception):
    """A move the machine's table does not have (or a guard refused): a bug, never the world."""

    def __init__(
        self,
        machine: str,
        ident: str,
        start: object,
        finish: object,
        story: Sequence[tuple[float, str, object, object]] = (),
        why: str = "not in the table",
    ) -> None:
        self.machine, self.ident, self.start, self.finish = machine, ident, start, finish
        self.story = list(story)
        self.why = why
        lines = "\n".join(_line(entry) for entry in self.story) or "  (empty)"
        super().__init__(f"{machine} {ident}: {start} -> {finish}: {why}; story:\n{lines}")


class InvalidState(Exception):
    """validate() found a machine breaking one of its own invariants; each one is named."""

    def __init__(self, machine: str, ident: str, broken: Sequence[str]) -> None:
        self.machine, self.ident, self.broken = machine, ident, list(broken)
        super().__init__(f"{machine} {ident}: " + "; ".join(self.broken))


class Table(Mapping[tuple[S, S], V]):
    """Every move a machine may make, keyed on (start, finish), with what each means."""

    def __init__(self, machine: str, moves: Mapping[tuple[S, S], V]) -> None:
        self.machine = machine
        self._moves = dict(moves)
        self.states: frozenset[S] = frozenset(s for move in self._moves for s in move)

    def __getitem__(self, move: tuple[S, S]) -> V:
        return self._moves[move]

    def __iter__(self) -> Iterator[tuple[S, S]]:
        return iter(self._moves)

    def __len__(self) -> int:
        return len(self._moves)

    def check(
        self,
        ident: str,
        start: S,
        finish: S,
        story: Sequence[tuple[float, str, object, object]] = (),
    ) -> V:
        """What the table says about start -> finish; InvalidTransition if it has no such move."""
        try:
            return self._moves[start, finish]
        except KeyError:
            raise InvalidTransition(self.machine, ident, start, finish, story) from None


def remember(story: list[StoryEntry[S]], entry: StoryEntry[S], limit: int) -> None:
    """Append to a story kept to its `limit` most recent entries."""
    story.append(entry)
    if len(story) > limit:
        del story[: len(story) - limit]


class StateMachine(Generic[S, V]):
    """Mixin for a machine with one state: it sets `table` (class attribute) and `story_limit`,
    holds `state` and `story`, and names itself with `ident`. Subclasses add their own invariants
    by extending `broken_invariants`."""

    table: Table[S, V]
    story_limit: int = 50
    state: S
    story: list[StoryEntry[S]]

    @property
    def ident(self) -> str:
        raise NotImplementedError

    def move(self, to: S, at: float, cause: str = "") -> V:
        """The one way the state changes: checked against the table and told in the story.

        A move the table lacks leaves the state as it was, records the attempt (`cause(invalid)`)
        and raises InvalidTransition with the story so far."""
        start = self.state
        try:
            found = self.table[start, to]
        except KeyError:
            remember(self.story, (at, f"{cause}(invalid)", start, to), self.story_limit)
            raise InvalidTransition(self.table.machine, self.ident, start, to, self.story) from None
        self.state = to
        remember(self.story, (at, cause, start, to), self.story_limit)
        return found

    def note(self, at: float, cause: str) -> None:
        """Tell the story of an event that moved nothing (ignored, absorbed, kept)."""
        remember(self.story, (at, cause, self.state, self.state), self.story_limit)

    def refuse(self, to: S, at: float, cause: str, why: str) -> InvalidTransition:
        """A move the table has but a guard forbids: recorded, and returned to be raised."""
        remember(self.story, (at, f"{cause}(refused)", self.state, to), self.story_limit)
        return InvalidTransition(self.table.machine, self.ident, self.state, to, self.story, why)

    def broken_invariants(self) -> list[str]:
        """Each invariant the machine breaks, named. The base checks the state and the story."""
        broken = []
        if self.state not in self.table.states:
            broken.append(f"unknown state {self.state!r}")
        if len(self.story) > self.story_limit:
            broken.append(f"story of {len(self.story)} entries, above {self.story_limit}")
        return broken

    def validate(self) -> None:
        """Raise InvalidState naming every invariant broken (tests call it after each step)."""
        broken = self.broken_invariants()
        if broken:
            raise InvalidState(self.table.machine, self.ident, broken)
