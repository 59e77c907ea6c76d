"""Early warnings (rebalance recommendations, scheduled maintenance, live migration): the node
is at risk, not reclaimed. Pure: advisories and the time in, commands out.

With `prepare` an advisory is told to the coordinator (`advisory_received`), which stops placing
work here and starts replacements elsewhere while this node keeps serving; nothing is drained.
It is lifted (`advisory_lifted`) when its source withdraws it or after `ttl_s`, so a warning no
notice follows does not keep a node out of work. With `drain` it opens a reclamation as a notice
would; with `ignore` it is only logged. Each advisory key is acted on once: a source that keeps
showing a lifted advisory (AWS leaves a rebalance recommendation up until the end) does not
raise it again, and the book is saved so a restart does not either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spotdrain.agent.core.notice import Notice
from spotdrain.agent.notices.base import Advisory
from spotdrain.agent.notices.settings import AdvisoryPolicy
from spotdrain.protocol.machine import InvalidState, Table

# Lifted advisories are remembered this long (and at most MAX_KEPT of them), so a source that
# keeps showing one does not raise it again; older ones are forgotten.
KEEP_LIFTED_S = 7 * 24 * 3600.0
MAX_KEPT = 1000
RECEIVED, LIFTED = "received", "lifted"
# The advisory's life: a key is received once, lifted once, and never comes back.
TRANSITIONS: Table[str | None, str] = Table(
    "advisory",
    {
        (None, RECEIVED): "a source reported it",
        (RECEIVED, LIFTED): "its source withdrew it, or its ttl passed",
    },
)


@dataclass
class Entry:
    key: str
    source: str
    reason: str
    received_at: float
    expires_at: float  # absolute, stored once: received_at + ttl_s
    state: str = RECEIVED
    lifted_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass(frozen=True)
class Record:
    kind: str  # advisory_received | advisory_lifted
    details: dict[str, Any]


@dataclass(frozen=True)
class Drain:
    notice: Notice


Command = Record | Drain


class AdvisoryBook:
    def __init__(self, policy: AdvisoryPolicy, saved: dict[str, dict[str, Any]] | None = None):
        self.policy = policy
        self.entries: dict[str, Entry] = {}
        for key, doc in (saved or {}).items():
            try:
                self.entries[key] = Entry(**doc)
            except TypeError:
                continue  # a book from another version: forget that one entry, not all

    def handle(self, advisory: Advisory | None, now: float) -> list[Command]:
        """The one entry point: an advisory a source reported (None: only the time moved)."""
        commands = self._expire(now)
        if advisory is not None:
            commands += self._seen(advisory, now)
        self.validate()
        return commands

    def next_expiry(self) -> float | None:
        due = [e.expires_at for e in self.entries.values() if e.state == RECEIVED]
        return min(due, default=None)

    def active(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.state == RECEIVED]

    def saved(self) -> dict[str, dict[str, Any]]:
        return {k: e.to_json() for k, e in self.entries.items()}

    def validate(self) -> None:
        """Raise InvalidState naming every entry that breaks the book's invariants."""
        broken = []
        for e in self.entries.values():
            if e.state not in (RECEIVED, LIFTED):
                broken.append(f"{e.key}: unknown state {e.state!r}")
            if (e.state == LIFTED) != (e.lifted_at is not None):
                broken.append(f"{e.key}: {e.state} with lifted_at {e.lifted_at}")
            if e.expires_at < e.received_at:
                broken.append(f"{e.key}: expires before it was received")
        if broken:
            raise InvalidState("advisory", "book", broken)

    # --- transitions -------------------------------------------------------------------------

    def _move(self, key: str, entry: Entry | None, to: str) -> None:
        TRANSITIONS.check(key, entry.state if entry is not None else None, to)

    def _seen(self, adv: Advisory, now: float) -> list[Command]:
        entry = self.entries.get(adv.key)
        if adv.withdrawn:
            if entry is None or entry.state != RECEIVED:
                return []
            return self._lift(entry, now, "withdrawn")
        if entry is not None:
            return []  # the same advisory again, or one already lifted: once only
        if self.policy.action == "ignore":
            return []
        self._move(adv.key, None, RECEIVED)
        entry = Entry(adv.key, adv.source, adv.reason, now, now + self.policy.ttl_s)
        self.entries[adv.key] = entry
        self._forget_old(now)
        details = {
            "source": adv.source,
            "reason": adv.reason,
            "key": adv.key,
            "action": self.policy.action,
            "expires_at": entry.expires_at,
            "not_before": adv.not_before,
            "detail": adv.detail,
        }
        commands: list[Command] = [Record("advisory_received", details)]
        if self.policy.action == "drain":
            deadline = adv.not_before if adv.not_before and adv.not_before > now else None
            commands.append(
                Drain(
                    Notice(
                        key=f"advisory:{adv.key}",
                        notice_id=f"advisory-{adv.key}",
                        action="terminate",
                        terminate_at=deadline,
                        source=adv.source,
                    )
                )
            )
        return commands

    def _expire(self, now: float) -> list[Command]:
        out: list[Command] = []
        for entry in self.active():
            if now >= entry.expires_at:
                out += self._lift(entry, now, "ttl")
        return out

    def _lift(self, entry: Entry, now: float, why: str) -> list[Command]:
        self._move(entry.key, entry, LIFTED)
        entry.state, entry.lifted_at = LIFTED, now
        details = {"source": entry.source, "reason": entry.reason, "key": entry.key, "why": why}
        return [Record("advisory_lifted", details)]

    def _forget_old(self, now: float) -> None:
        lifted = sorted(
            (e for e in self.entries.values() if e.state == LIFTED),
            key=lambda e: e.lifted_at or 0.0,
        )
        for e in lifted:
            if now - (e.lifted_at or 0.0) > KEEP_LIFTED_S or len(self.entries) > MAX_KEPT:
                del self.entries[e.key]
