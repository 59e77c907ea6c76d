"""The signal ledger: where each container stands in a reclamation's SIGTERM and SIGKILL.

SIGTERM at most once, across restarts too: a round first lists its targets (RoundListed), the
machine records them as announced and only then answers DeliverSignals, which the shell carries
out after saving the bundle (the first SIGTERM round, when the shell listed the node while the
Taint call was in flight, is announced in the taint's own step instead: TaintAnswered.listed).
A restarted agent finds the announced containers in the bundle and counts them as signalled by
the previous run: no second SIGTERM, ever (many runtimes take one as "exit now, skip the
cleanup"); SIGKILL at G still comes. Each container's place moves only along
LEDGER_TRANSITIONS, and every move is told in the reclamation's story.

The ledger is kept in the record's own fields (announced, signalled, sigterm_by_previous_run),
so the bundle's stored form is the record's; ledger_move is the one writer of those fields. The
signal rounds that move it (started, listed, done, strays) are here too.
"""

from __future__ import annotations

from typing import Any

from spotdrain.agent.core.reclamation_commands import (
    SIGKILL,
    SIGTERM,
    Command,
    DeliverSignals,
    Emit,
    SignalContainers,
    WatchExits,
)
from spotdrain.agent.core.reclamation_events import ContainerSignalled, RoundListed, RoundTarget
from spotdrain.agent.core.reclamation_record import ReclamationRecord
from spotdrain.agent.core.reclamation_reports import held_reports
from spotdrain.protocol.machine import InvalidTransition, Table, remember

# How a restarted agent reports the SIGTERMs its predecessor announced (sigterm_sent "by").
BY_PREVIOUS_RUN = "previous run"

# A container's place in the ledger: no signal yet (None), announced for a round (on disk
# before anything is sent, so possibly delivered by a process that has died since), delivered,
# or delivered as far as anyone can tell by the previous agent process.
TERM_ANNOUNCED = "SIGTERM announced"
TERM_SENT = "SIGTERM"
TERM_BY_PREVIOUS_RUN = "SIGTERM by previous run"
KILL_ANNOUNCED = "SIGKILL announced"
KILL_SENT = "SIGKILL"
LEDGER_TRANSITIONS: Table[str | None, str] = Table(
    "reclamation",
    {
        (None, TERM_ANNOUNCED): "a SIGTERM round is about to signal it",
        (TERM_ANNOUNCED, TERM_SENT): "delivered",
        (TERM_ANNOUNCED, None): "neither route delivered it, or its round ended without sending "
        "it (a cancel between the announcing step and the round): it may be signalled again",
        (TERM_ANNOUNCED, TERM_BY_PREVIOUS_RUN): "the agent restarted before the result came back",
        (None, KILL_ANNOUNCED): "the SIGKILL round (or a later stray) is about to kill it",
        (TERM_SENT, KILL_ANNOUNCED): "the SIGKILL round is about to kill it",
        (TERM_BY_PREVIOUS_RUN, KILL_ANNOUNCED): "the SIGKILL round is about to kill it",
        (KILL_ANNOUNCED, KILL_SENT): "delivered",
        # Not delivered, or the agent restarted: a SIGKILL may safely be sent again.
        (KILL_ANNOUNCED, None): "withdrawn",
        (KILL_ANNOUNCED, TERM_SENT): "withdrawn",
        (KILL_ANNOUNCED, TERM_BY_PREVIOUS_RUN): "withdrawn",
    },
)


def ledger(rec: ReclamationRecord, container: str) -> str | None:
    """Where a container stands in the signal ledger (see LEDGER_TRANSITIONS)."""
    entry = rec.announced.get(container)
    if entry is not None:
        return TERM_ANNOUNCED if entry["signal"] == SIGTERM else KILL_ANNOUNCED
    signal = rec.signalled.get(container)
    if signal == SIGKILL:
        return KILL_SENT
    if signal == SIGTERM:
        if container in rec.sigterm_by_previous_run:
            return TERM_BY_PREVIOUS_RUN
        return TERM_SENT
    return None


def ledger_move(
    rec: ReclamationRecord,
    container: str,
    finish: str | None,
    target: RoundTarget | None = None,
    now: float = 0.0,
) -> None:
    """A container's move in the signal ledger, checked against LEDGER_TRANSITIONS and told
    in the reclamation's story."""
    start = ledger(rec, container)
    ident = f"{rec.reclaim_id}: container {container}"
    LEDGER_TRANSITIONS.check(ident, start, finish, rec.story)
    entry = (now, f"ledger {container}", str(start), str(finish))
    remember(rec.story, entry, rec.story_limit)
    if finish in (TERM_ANNOUNCED, KILL_ANNOUNCED):
        assert target is not None
        rec.signal_announced = True
        rec.announced[container] = {
            "signal": SIGTERM if finish == TERM_ANNOUNCED else SIGKILL,
            "name": target.name,
            "kind": target.kind,
            "image": target.image,
            "at": now,
            "before": start,
        }
        return
    rec.announced.pop(container, None)
    if finish == TERM_SENT:
        rec.signalled[container] = SIGTERM
    elif finish == KILL_SENT:
        rec.signalled[container] = SIGKILL
    elif finish == TERM_BY_PREVIOUS_RUN:
        rec.signalled[container] = SIGTERM
        if container not in rec.sigterm_by_previous_run:
            rec.sigterm_by_previous_run.append(container)
    # None, or back to what it was before a withdrawn SIGKILL: nothing more to change.


def announce(rec: ReclamationRecord, ev: RoundListed) -> tuple[str, ...]:
    """A round's targets: announce those it may signal, and only those. A SIGTERM goes to a
    container at most once, whoever sent it (this process or the one before it)."""
    approved: list[str] = []
    for target in ev.targets:
        c = target.container
        if c in rec.exited or c in approved:
            continue
        start = ledger(rec, c)
        if ev.signal == SIGTERM:
            if start is not None or c in rec.gated:
                continue
            ledger_move(rec, c, TERM_ANNOUNCED, target, ev.now)
        else:
            if start in (TERM_ANNOUNCED, KILL_ANNOUNCED, KILL_SENT):
                continue
            ledger_move(rec, c, KILL_ANNOUNCED, target, ev.now)
        rec.names[c] = target.name
        approved.append(c)
    return tuple(approved)


# --- the rounds that move it --------------------------------------------------------------


def start_round(
    rec: ReclamationRecord,
    signal: str,
    skip: frozenset[str] = frozenset(),
    listed: tuple[RoundTarget, ...] | None = None,
    now: float = 0.0,
) -> SignalContainers:
    """A signal round asked of the shell. With `listed` (the node as listed during the Taint
    call), its targets are announced here, in the bundle this step saves, before it sends."""
    rec.rounds_in_flight += 1
    if listed is None:
        return SignalContainers(signal, skip)
    skip_kinds = SignalContainers(signal).skip_kinds
    wanted = tuple(t for t in listed if t.container not in skip and t.kind not in skip_kinds)
    return SignalContainers(signal, skip, announce(rec, RoundListed(now, signal, wanted)))


def deliver(rec: ReclamationRecord, ev: RoundListed) -> list[Command]:
    """A round listed its targets: send to those announced now (none once lifted)."""
    if rec.lifted:
        return [DeliverSignals(ev.signal, ())]  # cancelled or resumed: nothing more to send
    return [DeliverSignals(ev.signal, announce(rec, ev))]


def round_done(rec: ReclamationRecord, now: float, signal: str) -> bool:
    """A round is over, its results all in: whether to look at the node at once (after the
    first SIGTERM round and the SIGKILL round) rather than at the usual pace."""
    rec.rounds_in_flight = max(0, rec.rounds_in_flight - 1)
    # What it announced and never sent (a cancel or resume reached the shell between the
    # announcing step and the round) was not signalled: a later notice may signal it.
    pending = TERM_ANNOUNCED if signal == SIGTERM else KILL_ANNOUNCED
    for container in [c for c in rec.announced if ledger(rec, c) == pending]:
        ledger_move(rec, container, rec.announced[container]["before"], now=now)
    first = signal == SIGTERM and not rec.sigterm_round_done
    if signal == SIGTERM:
        rec.sigterm_round_done = True
    if first or signal == SIGKILL:
        return True
    # A stray round: look again at the usual pace, not at once (a stray the round could
    # not signal, such as an ungated inference worker, would make it spin).
    if not rec.observing and rec.next_observe_at is None:
        rec.next_observe_at = now + rec.observe_every_s
    return False


def strays(
    rec: ReclamationRecord, running: tuple[str, ...], rentals: tuple[str, ...] = ()
) -> list[Command]:
    """Running containers that lack the signal they are due: never signalled (started by
    hand, missed by a round that died with the agent), or not yet killed after G. Before G
    a rental is due nothing."""
    if rec.rounds_in_flight or not rec.sigterm_round_done:
        return []  # a round still under way may reach them: no second SIGTERM
    if rec.sigkill_round:
        signal = SIGKILL
        done = frozenset(c for c, sig in rec.signalled.items() if sig == SIGKILL)
    else:
        signal = SIGTERM
        done = frozenset(rec.signalled) | frozenset(rec.gated) | frozenset(rentals)
    done |= frozenset(rec.announced)
    if not frozenset(running) - done:
        return []
    return [start_round(rec, signal, skip=done)]


def signal_result(rec: ReclamationRecord, ev: ContainerSignalled) -> list[Command]:
    """A round's result for one announced container: delivered, or failed (announced no
    more, so it may be signalled again)."""
    announced = TERM_ANNOUNCED if ev.signal == SIGTERM else KILL_ANNOUNCED
    if ledger(rec, ev.container) != announced:
        # Only an announced container may be signalled (write before act).
        raise InvalidTransition(
            "reclamation",
            f"{rec.reclaim_id}: container {ev.container}",
            ledger(rec, ev.container),
            ev.signal,
            rec.story,
            why="only an announced container may be signalled",
        )
    details: dict[str, Any] = {"container": ev.container, "name": ev.name, "via": ev.via}
    if ev.error:
        details["error"] = ev.error
        ledger_move(rec, ev.container, rec.announced[ev.container]["before"], now=ev.now)
        return [Emit("signal_failed", {**details, "signal": ev.signal})]
    _with_contract(details, ev.image, ev.kind)
    rec.names[ev.container] = ev.name
    new = ev.container not in rec.signalled
    ledger_move(rec, ev.container, TERM_SENT if ev.signal == SIGTERM else KILL_SENT, now=ev.now)
    if ev.signal == SIGTERM:
        rec.sigterm_at.setdefault(ev.container, ev.now)
    kind = "sigterm_sent" if ev.signal == SIGTERM else "sigkill_sent"
    commands: list[Command] = [Emit(kind, details)]
    commands += held_reports(rec, ev.container, ev.now)
    if new and ev.container not in rec.exited:
        commands.append(WatchExits((ev.container,)))
    return commands


def previous_run_announcements(
    rec: ReclamationRecord, delivered: set[str] | None, now: float
) -> list[Command]:
    """The announcements an old agent process left: each SIGTERM may have been delivered, so it
    counts as sent (reported with `by: previous run`) and is never sent again, unless the
    engine says it was never asked to (`delivered` without it): then it is withdrawn and the
    container, still running and never signalled, gets its SIGTERM at the next look. A SIGKILL
    is withdrawn (the next look kills it again if it still runs, which is harmless) and
    reported the same way, since it may have been delivered: a container that exits 137 has
    its sigkill_sent."""
    commands: list[Command] = []
    for container, entry in list(rec.announced.items()):
        if entry["signal"] == SIGTERM and delivered is not None and container not in delivered:
            ledger_move(rec, container, entry["before"], now=now)
            continue
        details: dict[str, Any] = {
            "container": container,
            "name": entry["name"],
            "by": BY_PREVIOUS_RUN,
            "announced_at": entry["at"],
        }
        if entry["signal"] != SIGTERM:
            ledger_move(rec, container, entry["before"], now=now)
            commands.append(Emit("sigkill_sent", details))
            continue
        ledger_move(rec, container, TERM_BY_PREVIOUS_RUN, now=now)
        rec.sigterm_at.setdefault(container, entry["at"])
        _with_contract(details, entry.get("image") or "", entry.get("kind") or "")
        commands.append(Emit("sigterm_sent", details))
        commands += held_reports(rec, container, None)
    return commands


def _with_contract(details: dict[str, Any], image: str, kind: str) -> None:
    """What the coordinator tracks the workload's contract by, where the engine named it."""
    if image:
        details["image"] = image
    if kind:
        details["kind"] = kind
